"""`ragkv report`: the results page, or one of its tables (paired differences, share of full, quality vs work,
lost in the middle, auto replayed, step signals) from eval records (heavy imports stay inside the handlers)."""

from __future__ import annotations

import json
from pathlib import Path

from ragkv.cli.common import print_json
from ragkv.cli.eval_data import say
from ragkv.errors import RagkvError



def register(sub) -> None:
    r = sub.add_parser("report", help="render docs/results/README.md from eval runs, sweeps and bench ttft")
    r.add_argument("runs", nargs="*", help="eval results JSONL files (default: runs/eval-*.jsonl)")
    r.add_argument("--bench", default="bench_out/ttft.json", help="`ragkv bench ttft` JSON")
    r.add_argument("--output-dir", default="docs/results", help="page, PNGs and summary.json; also where sweep "
                   "and calibration JSON are looked up, and notes.md is read")
    r.add_argument("--tables", action="store_true", help="only print the markdown tables of the given runs "
                   "(accuracy with 95%% bootstrap intervals), write nothing")
    r.add_argument("--lost-in-the-middle", metavar="PNG", default=None,
                   help="only the accuracy-vs-gold-position figure and table from runs of one data set at several "
                   "--gold-position values (one or more models): write PNG, print the markdown table")
    r.add_argument("--share-of-full", metavar="PNG", default=None,
                   help="only the papers' table: each key's task score as a share of full's per data set and pooled "
                        "(bootstrap by question), its work, per model; the share-vs-work picture to PNG")
    r.add_argument("--vs-work", metavar="PNG", default=None,
                   help="only the quality-vs-work figure and table: per mode, recompute_vs_full against the paired "
                   "accuracy difference to full (pooled over the given runs) and the first-token KL")
    r.add_argument("--paired", action="store_true",
                   help="only the paired differences (95%% bootstrap intervals) on the questions every compared key "
                   "answered: of one run, each key minus full and minus the key it extends (k,draft=16 minus k); "
                   "of two runs (e.g. two models, two passage orders), also the same key in the second minus the "
                   "first, and the second's gap to its full minus the first's")
    r.add_argument("--modes", default=None, metavar="KEYS",
                   help="with --vs-work, --paired or --share-of-full: only these mode keys (comma-separated, as in the records) "
                   "beside full")
    r.add_argument("--replay-auto", metavar="RISK,BUDGET", default=None,
                   help="only `auto:r=0.15,sig=expected_kl,risk=RISK,budget=BUDGET` replayed from the runs' `full` and "
                   "`blend:sel=query,r=0.15` records under --fit (ragkv/eval/auto_replay.py): writes each file with "
                   "the replayed records added into --output-dir, prints the quality-vs-work table")
    r.add_argument("--fit", default=None, metavar="JSON",
                   help="with --replay-auto or --step-signals: the fidelity fit (default: the one shipped for the runs' "
                        "model)")
    r.add_argument("--step-signals", metavar="KEY", default=None,
                   help="only how well each risk signal, at the first token and a few decoded tokens in (the records' "
                        "answer_steps), singles out KEY's answers that differ from full's, and the accuracy after "
                        "escalating its riskiest 10/20/30%% (ragkv/eval/step_signals.py)")
    r.add_argument("--json", action="store_true", help="with --step-signals: print the result as JSON")
    r.set_defaults(func=run_report_cmd)


# -- handlers ---------------------------------------------------------------------------------------------

def run_report_cmd(args) -> int:
    from ragkv.bench.report import render_report

    paths = [Path(p) for p in args.runs] or sorted(Path("runs").glob("eval-*.jsonl"))
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise RagkvError(f"results file(s) not found: {', '.join(missing)}")
    if args.lost_in_the_middle:
        from ragkv.bench.report import lost_in_the_middle

        if not args.runs:
            raise RagkvError("--lost-in-the-middle wants the results files, e.g. runs/eval-nq-distractors-g*.jsonl")
        try:
            result = lost_in_the_middle(paths, Path(args.lost_in_the_middle))
        except ValueError as e:
            raise RagkvError(str(e)) from None
        print(result["markdown"])
        return 0
    if args.share_of_full:
        from ragkv.bench.share_of_full import share_of_full
        from ragkv.eval.modes import split_mode_list

        try:
            result = share_of_full(paths, Path(args.share_of_full), split_mode_list(args.modes) if args.modes else None)
        except ValueError as e:
            raise RagkvError(str(e)) from None
        print(result["markdown"])
        return 0
    if args.vs_work:
        from ragkv.bench.report import quality_vs_work
        from ragkv.eval.modes import split_mode_list

        keys = split_mode_list(args.modes) if args.modes else None
        result = quality_vs_work(paths, Path(args.vs_work), modes=keys)
        print(result["markdown"])
        return 0
    if args.replay_auto:
        return _replay_auto(args, paths)
    if args.step_signals:
        return _step_signals(args, paths)
    if args.paired:
        from ragkv.bench.paired import paired_report
        from ragkv.eval.modes import split_mode_list

        if not args.runs:
            raise RagkvError("--paired wants one run's results files, or two runs' (e.g. two models)")
        try:
            result = paired_report(paths, split_mode_list(args.modes) if args.modes else None)
        except ValueError as e:
            raise RagkvError(str(e)) from None
        print("\n".join(f"{'AB'[i]}: {run}" for i, run in enumerate(result["runs"])) + "\n")
        print(result["markdown"])
        return 0
    if args.tables:
        from ragkv.bench.report import eval_tables, load_eval

        print("\n".join(eval_tables(load_eval(paths))))
        return 0
    path = render_report(paths, Path(args.bench) if args.bench else None, Path(args.output_dir))
    print(path)
    return 0


def _step_signals(args, paths: list[Path]) -> int:
    """`ragkv report --step-signals KEY`: first-token and few-tokens-in risk signals judged on KEY's records."""
    from ragkv.engine.measure.estimates import FidelityFits, load_fidelity_fits
    from ragkv.eval.results import read_results
    from ragkv.eval.step_signals import judge, markdown, pairs_of

    if not paths:
        raise RagkvError("--step-signals wants results files with full and the key's records")
    pairs, missing, models = [], 0, set()
    for path in paths:
        config, records = read_results(path)
        models.add((config["model"], config.get("dtype")))
        got, lacking = pairs_of(records, args.step_signals)
        pairs += got
        missing += lacking
    if len(models) != 1:
        raise RagkvError(f"--step-signals judges one model's records in one dtype at a time, got "
                         f"{', '.join(' '.join(map(str, m)) for m in sorted(models, key=str))}")
    if missing:
        say(f"{missing} {args.step_signals} records have no answer_steps (written before eval kept them): left out")
    if not pairs:
        raise RagkvError(f"no {args.step_signals} record with answer_steps and a full record beside it")
    fit = FidelityFits.load(args.fit) if args.fit else load_fidelity_fits(*models.pop())
    result = judge(pairs, fit)
    if args.json:
        print_json(result)
    else:
        print(markdown(result, args.step_signals))
    return 0


def _replay_auto(args, paths: list[Path]) -> int:
    """`ragkv report --replay-auto RISK,BUDGET`: auto's answers from each file's full and r = 0.15 records, written
    beside the originals' copies, then the quality-vs-work table of the three."""

    from ragkv.bench.report import quality_vs_work
    from ragkv.engine.measure.estimates import FidelityFits, load_fidelity_fits
    from ragkv.eval.auto_replay import replay_auto, replay_key
    from ragkv.eval.results import read_results

    try:
        risk, budget = (float(v) for v in args.replay_auto.split(","))
    except ValueError:
        raise RagkvError(f"--replay-auto wants RISK,BUDGET (e.g. 0.15,0.2), got {args.replay_auto!r}") from None
    if not paths:
        raise RagkvError("--replay-auto wants the results files of a run with full and blend:sel=query,r=0.15")
    key = replay_key(0.15, risk, budget)  # auto's own records at these settings, if any, give way to the replay
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written, fits_of = [], {}
    for path in paths:
        config, records = read_results(path)
        model = (config["model"], config.get("dtype"))
        if model not in fits_of:  # read once per model and dtype, not per shard file
            fits_of[model] = FidelityFits.load(args.fit) if args.fit else load_fidelity_fits(*model)
        fits = fits_of[model]
        if fits is None:
            raise RagkvError(f"no fidelity fit {'at ' + args.fit if args.fit else 'for ' + ' '.join(map(str, model))}: pass "
                             "--fit, or run `ragkv calibrate --target fidelity`")
        try:
            replayed = replay_auto(records, fits, risk, budget)
        except ValueError as e:
            raise RagkvError(str(e)) from None
        target = out_dir / f"replayed-{path.name}"
        lines = [{"ragkv_results": 1, "config": config}, *(r for r in records if r["mode_key"] != key), *replayed]
        target.write_text("".join(json.dumps(r) + "\n" for r in lines), encoding="utf-8")
        written.append(target)
        print(f"{path}: {sum(r['escalated'] for r in replayed)} of {len(replayed)} escalated -> {target}")
    result = quality_vs_work(written, out_dir / "vs-work-replayed.png",
                             modes=["blend:sel=query,r=0.15", key])
    print(result["markdown"])
    return 0
