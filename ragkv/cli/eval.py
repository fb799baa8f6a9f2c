"""`ragkv eval`, `ragkv sweep`, `ragkv calibrate`, `ragkv report` (heavy imports stay inside the handlers)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ragkv.cli.common import add_fusion_args, add_model_args, floats, ints, print_json
from ragkv.cli.eval_data import base_fusion, dataset_spec, load_engine, load_examples, model_label, rank_passages, say
from ragkv.engine.measure.risk import SIGNALS
from ragkv.engine.modes import MODES, get_mode
from ragkv.errors import RagkvError
from ragkv.eval.suite import SUITES, get_suite
from ragkv.rag.order import PASSAGE_ORDERS

DEFAULT_MODES = "full,prefix,reuse,ape,blend"


def _floats(s: str) -> tuple[float, ...]:
    return floats(s, "this option")


def _ints(s: str) -> tuple[int, ...]:
    return ints(s, "this option")


def _data_args(p, default: str | None, limit: int | None) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--dataset", default=None, help=f"a named data set (default: {default})")
    g.add_argument("--data-file", default=None, help="any file in one of the loader formats (with --format)")
    g.add_argument("--format", default=None, help="cacheblend | hotpotqa | longbench | samsum | nq | kv")
    g.add_argument("--limit", type=int, default=limit, help="first N examples" + (f" (default {limit})" if limit
                                                                                    else " (default: all)"))
    g.add_argument("--num-passages", type=int, default=None, help="nq: gold passage + N-1 distractors")
    g.add_argument("--gold-position", type=int, default=None,
                   help="nq with distractors (nq-distractors or --num-passages > 1): 0-based index of the gold "
                   "passage (default: cycles over every position)")
    g.add_argument("--split", default=None, help="samsum: test (default) | train | validation | all")
    g.add_argument("--passage-order", default="as-given", choices=PASSAGE_ORDERS,
                   help="as-given (the data set's layout, e.g. --gold-position) or each example's passages ranked "
                        "by a real retriever (MiniLM cosine to the question) and put best-last (as ask and serve "
                        "do) or best-first")
    p.set_defaults(default_dataset=default)


def _model_args(p) -> None:
    add_model_args(p, decode_weights=False)


def _fusion_args(p) -> None:
    add_fusion_args(p, default_mode=None, title="defaults for bare mode keys (a key's own parameters win)")


def _run_args(p, output_help: str) -> None:
    p.add_argument("--max-new-tokens", type=int, default=None, help="greedy tokens per answer (0: first token only)")
    p.add_argument("--overwrite", action="store_true", help="replace a results file of another configuration")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--output", default=None, help=output_help)


def _shard(text: str) -> tuple[int, int]:
    """`K/N` -> (K, N): the K-th of N interleaved parts of the examples, 1 <= K <= N."""
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants K/N like 1/2, got {text!r}") from None
    if not 1 <= k <= n:
        raise argparse.ArgumentTypeError(f"wants K/N with 1 <= K <= N, got {text!r}")
    return k, n


def register(sub) -> None:
    e = sub.add_parser("eval", help="quality of each fusion mode on a benchmark: task metric, fidelity to full, TTFT",
                       description="Greedy evaluation of fusion modes on a data set. Mode keys: "
                       f"{', '.join(MODES)}, with parameters like ape:T=0.8,S=0.9, blend:r=0.3,dev=k,check=1+4,"
                       "gradual=1,sink=4, blend:sel=query,r=0.15 or blend:sel=sinks,sink=8 (each key parameter is "
                       "a FusionOptions field's short name). `full` always runs first per example (the fidelity "
                       "reference). Records are "
                       "appended to a JSONL file; rerunning the same command resumes it.")
    _data_args(e, "required", None)
    e.add_argument("--modes", default=None, help=f"comma-separated mode keys (default {DEFAULT_MODES}; with "
                                                 "--suite, the suite's)")
    e.add_argument("--suite", default=None, choices=tuple(SUITES),
                   help="every data set of a named suite, each into its own results file (--limit: per set, "
                        "default the suite's); `ragkv report --share-of-full` prints the table: " +
                        "; ".join(f"{s.name}: {s.summary}" for s in SUITES.values()))
    _model_args(e)
    _fusion_args(e)
    _run_args(e, "results JSONL (default runs/eval-<dataset>-<model>.jsonl)")
    e.add_argument("--shard", type=_shard, default=None, metavar="K/N",
                   help="evaluate every N-th example starting at the K-th (of those --limit keeps), into its own "
                   "file (default name: runs/eval-<dataset>-shardKofN-<model>.jsonl), to run N processes side by "
                   "side; `ragkv report` merges the shards of one run")
    e.add_argument("--truncate", action="store_true",
                   help="drop each example's passages farthest from the question until the prompt and the answer "
                        "fit the model's window: the baseline for sets longer than the window (nq-long)")
    e.add_argument("--decode-weights", default="exact", choices=("exact", "w8a8"),
                   help="the weights every mode runs on (default exact); w8a8: int8 products in prefill too, an "
                        "approximate path whose `full` is itself judged against --reference-from")
    e.add_argument("--reference-from", default=None, metavar="FILES",
                   help="results files (comma-separated; shards of one run) of the same data and model on the exact "
                        "weights: their stored `full` answers are the fidelity reference of every mode here, `full` "
                        "included (with --decode-weights w8a8: how far its replies are from the exact weights')")
    e.set_defaults(func=run_eval_cmd)

    s = sub.add_parser("sweep", help="blend ratio, APE T x S grid or passage-count sweep: JSON + PNG")
    s.add_argument("--kind", required=True, choices=("blend-ratio", "ape-grid", "passages"))
    _data_args(s, "musique (blend-ratio), hotpotqa (ape-grid), nq-distractors (passages)", 10)
    s.add_argument("--ratios", default="0,0.05,0.1,0.15,0.2,0.3,0.5,1.0", help="blend-ratio: values of r")
    s.add_argument("--temperatures", default="0.5,0.6,0.7,0.8,0.9,1.0", help="ape-grid: values of T")
    s.add_argument("--scales", default="0.5,0.6,0.7,0.8,0.9,1.0", help="ape-grid: values of S")
    s.add_argument("--counts", default="1,3,5,10", help="passages: numbers of passages")
    s.add_argument("--modes", default="full,reuse,ape,blend", help="passages: mode keys")
    s.add_argument("--output-dir", default="runs/sweeps", help="where the JSON and PNG go")
    s.add_argument("--results-dir", default="runs", help="where the resumable JSONL records go")
    _model_args(s)
    _fusion_args(s)
    _run_args(s, argparse.SUPPRESS)
    s.set_defaults(func=run_sweep_cmd)

    c = sub.add_parser("calibrate", help="choose APE's T and S, or auto's risk signal and threshold, on held-out "
                                         "data",
                       description="--target ape (default): grid search of APE's temperature T and scale S on a "
                       "calibration split that is not evaluation data (default hotpotqa-train; "
                       "nq-distractors-heldout holds NQ questions no evaluation uses): the best task score of greedy "
                       "answers, as the APE paper tunes them (ties: the lower KL), or with --objective kl the lowest "
                       "mean KL of the first-token distribution to `full` (no answers generated: much faster). "
                       "--target auto: runs full and blend:sel=query,r=R (first token only), measures how well each "
                       "risk signal (shift, entropy, margin) ranks the blend's KL to full, and picks the threshold "
                       "that brings the mean KL under --target-kl while escalating at most --max-escalation of the "
                       "answers (or reads such records with --records). Results are stored per model fingerprint: "
                       "`ape` and `auto` use them by default.")
    _data_args(c, "hotpotqa-train", 20)
    c.add_argument("--target", choices=("ape", "auto", "fidelity"), default="ape",
                   help="what to calibrate (default ape); fidelity: the per-reply estimate, from --records")
    c.add_argument("--test-records", default=None, help="fidelity: eval records to judge the fit on (default: two "
                   "folds by question of --records)")
    c.add_argument("--save-to", default=None, help="fidelity: where the fit goes (default: the model's in the cache)")
    c.add_argument("--keys", default=None, metavar="KEYS",
                   help="fidelity: save only these fit keys (comma-separated, e.g. 'full||w8a8'; default: every key "
                        "the records fit); the held-out table still judges them all")
    c.add_argument("--temperatures", default="0.5,0.6,0.7,0.8,0.9,1.0", help="ape: values of T")
    c.add_argument("--scales", default="0.5,0.6,0.7,0.8,0.9,1.0", help="ape: values of S")
    c.add_argument("--objective", choices=("score", "kl"), default="score",
                   help="ape: score: best task score of greedy answers (default; --max-new-tokens default 32); kl: "
                        "lowest first-token KL to full")
    c.add_argument("--ratio", type=float, default=0.15, help="auto: the cheap run's recompute ratio r (default 0.15)")
    c.add_argument("--signal", choices=SIGNALS, default=None,
                   help="auto: calibrate this signal (default: the one that ranks the KL to full best)")
    c.add_argument("--target-kl", type=float, default=0.03,
                   help="auto: mean first-token KL to full to stay under after escalations (default 0.03)")
    c.add_argument("--max-escalation", type=float, default=0.15,
                   help="auto: the most answers escalated to a full recompute, a fraction (default 0.15)")
    c.add_argument("--records", default=None, help="fidelity: eval records to fit (comma-separated); auto: eval records (JSONL) of full and blend:sel=query,r=R on "
                   "held-out data to calibrate from instead of running them (for the model that wrote them)")
    c.add_argument("--allow-eval-data", action="store_true", help="calibrate on an evaluation data set anyway")
    c.add_argument("--output-dir", default="runs/calibration", help="where the grid JSON and heatmap go")
    c.add_argument("--results-dir", default="runs", help="where the resumable JSONL records go")
    _model_args(c)
    _run_args(c, argparse.SUPPRESS)
    c.set_defaults(func=run_calibrate_cmd)

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
                   help="with --vs-work or --paired: only these mode keys (comma-separated, as in the records) "
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

def run_eval_cmd(args) -> int:
    if args.suite:
        return _run_suite(args)
    if args.modes is None:
        args.modes = DEFAULT_MODES
    return _run_one(args)


def _run_suite(args) -> int:
    """Each of the suite's data sets as one `ragkv eval --dataset` run (its own file, sharded and resumed alike)."""
    suite = get_suite(args.suite)
    if args.dataset or args.data_file or args.output:
        raise RagkvError("--suite names its own data sets and files (runs/eval-<set>-<model>.jsonl): drop "
                         "--dataset / --data-file / --output")
    for name in suite.datasets:
        one = argparse.Namespace(**vars(args))
        one.dataset, one.suite = name, None
        one.modes = args.modes or suite.modes
        one.limit = args.limit if args.limit is not None else suite.limit
        say(f"suite {suite.name}: {name} ({suite.datasets.index(name) + 1} of {len(suite.datasets)})")
        _run_one(one)
    return 0


def _run_one(args) -> int:
    import torch

    from ragkv.config import cpu_name
    from ragkv.eval.harness import results_config, run_eval
    from ragkv.eval.modes import engine_defaults, parse_mode_key, resolve_modes, split_mode_list
    from ragkv.eval.results import ResultsFile
    from ragkv.eval.summary import summarize, text_table

    base = base_fusion(args)
    keys = split_mode_list(args.modes)
    for k in keys:  # fail on a bad key before loading anything
        parse_mode_key(k, base)
    label, desc, kw = dataset_spec(args, None)
    examples = load_examples(kw, args.limit)
    if args.passage_order != "as-given":
        examples = rank_passages(examples, args.passage_order)
    if args.shard:
        k, n = args.shard
        examples = examples[k - 1::n]  # interleaved, so each shard gets the same mix of long and short examples
        desc["shard"] = f"{k}/{n}"  # only when set: unsharded files resume as before
        label += f"-shard{k}of{n}"
    max_new = 32 if args.max_new_tokens is None else args.max_new_tokens
    if args.decode_weights != "exact" and not args.reference_from:
        raise RagkvError(f"--decode-weights {args.decode_weights} is judged against the exact weights: run the same "
                         "command without it first, then pass that results file as --reference-from")
    engine = load_engine(args, args.decode_weights)
    if args.decode_weights != "exact":
        desc["decode_weights"] = args.decode_weights  # only when set: files written before the flag still resume
    from ragkv.eval.datasets import DATASETS, dataset_prompt, dataset_stop

    prompt = dataset_prompt(kw["name"])  # e.g. the in-context-learning sets' own prompt
    stop = dataset_stop(kw["name"])  # e.g. a one-line summary
    if args.truncate:
        from ragkv.eval.harness import truncate_to_window

        examples = truncate_to_window(engine, examples, max_new, prompt)
        desc["truncate"] = True  # only when set: files written before the flag still resume
        label += "-truncated"
    from ragkv.engine.fusion.calibration import load_ape_params

    # APE's T and S: calibrated for this data set's task when that was done, else the model's
    T, S, source = load_ape_params(engine.fingerprint, examples[0].task) if examples else (
        engine.ape_temperature, engine.ape_scale, engine.ape_source)
    modes = resolve_modes(keys, base, engine_defaults(engine, T, S))
    if any(":" not in m.key and "max_risk" in get_mode(m.mode).option_fields for m in modes):
        say(f"auto: escalates when {engine.auto_signal} > {engine.auto_max_risk:g} ({engine.auto_source})")
    if any(":" not in m.key and "ape_temperature" in get_mode(m.mode).option_fields for m in modes):
        say(f"ape: T={T:g}, S={S:g} ({source})")
    output = Path(args.output or f"runs/eval-{label}-{model_label(args)}.jsonl")
    config = results_config(engine, desc, max_new, prompt, stop)
    reference = None
    if args.reference_from:
        from ragkv.eval.references import ExternalReferences

        reference = ExternalReferences.open(args.reference_from.split(","), config)
        missing = reference.missing([ex.id for ex in examples])
        if missing:
            raise RagkvError(f"--reference-from has no stored `full` answer for {len(missing)} of the "
                             f"{len(examples)} examples (e.g. {missing[0]}): run the exact eval on them first, with "
                             "the same data flags and a --limit that covers these")
        config["reference_from"] = reference.names  # only when set: files written before the flag still resume
    results = ResultsFile(output, config, args.overwrite)
    done = len(results.done_keys())
    if done:
        say(f"resuming {output}: {done} records already there")
    run = run_eval(engine, examples, modes, results, max_new_tokens=max_new, progress=not args.no_progress,
                   desc=label, prompt_format=prompt, stop=stop, reference=reference,
                   # in-context examples are the same blocks for every question: encoded once, kept
                   keep_cache=bool(DATASETS[kw["name"]].shots) if kw["name"] in DATASETS else False)
    summary = summarize(run["records"], keys)
    if run["skipped"]:
        say(f"skipped {len(run['skipped'])} examples longer than the model's {engine.max_positions} positions")
    if args.json:
        print_json({"summary": summary, "dataset": label, "n_examples": len(examples) - len(run["skipped"]),
                    "skipped": run["skipped"], "results_file": str(output)})
    else:
        print(f"{label}: {len(examples) - len(run['skipped'])} examples, {engine.model_name} {engine.dtype_name} "
              f"on {engine.device.type} ({cpu_name()}, {torch.get_num_threads()} threads); records in {output}\n")
        print(text_table(summary))
    return 0


def _sweep_run(args, label, desc, engine, out_dir, max_new):
    from ragkv.bench.sweeps import SweepRun

    return SweepRun(engine, Path(out_dir), Path(args.results_dir), label, desc, max_new,
                    base_fusion(args), args.overwrite, not args.no_progress)


def run_sweep_cmd(args) -> int:
    from ragkv.bench import sweeps

    default = {"blend-ratio": "musique", "ape-grid": "hotpotqa", "passages": "nq-distractors"}[args.kind]
    if args.kind == "passages" and args.num_passages:
        raise RagkvError("--num-passages does not apply to the passages sweep; use --counts")
    label, desc, kw = dataset_spec(args, default)
    max_new = args.max_new_tokens if args.max_new_tokens is not None else (0 if args.kind == "ape-grid" else 32)
    if args.kind == "passages":
        counts = _ints(args.counts)
        if not counts or min(counts) < 1:
            raise RagkvError(f"--counts wants positive integers, got {args.counts!r}")
        from ragkv.eval.modes import parse_mode_key, split_mode_list

        keys = split_mode_list(args.modes)
        for k in keys:
            parse_mode_key(k)
        from dataclasses import replace

        from ragkv.eval.datasets import DATASETS

        nq = (kw["fmt"] or DATASETS[kw["name"]].fmt if kw["name"] in DATASETS else kw["fmt"]) == "nq"
        first = None if nq else load_examples(kw, args.limit)

        def load(k: int):  # nq: gold + k-1 distractors; other formats: the first k passages of each example
            if nq:
                return load_examples({**kw, "num_passages": k}, args.limit)
            return [replace(ex, passages=ex.passages[:k]) for ex in first]
        engine = load_engine(args)
        result = sweeps.passages_sweep(_sweep_run(args, label, desc, engine, args.output_dir, max_new), load,
                                       counts, tuple(keys))
    else:
        examples = load_examples(kw, args.limit)
        engine = load_engine(args)
        sw = _sweep_run(args, label, desc, engine, args.output_dir, max_new)
        if args.kind == "blend-ratio":
            ratios = _floats(args.ratios)
            if not ratios or not all(0 <= r <= 1 for r in ratios):
                raise RagkvError(f"--ratios wants values in [0, 1], got {args.ratios!r}")
            result = sweeps.blend_ratio_sweep(sw, examples, ratios)
        else:
            result = sweeps.ape_grid_sweep(sw, examples, _floats(args.temperatures), _floats(args.scales))
    if args.json:
        print_json(result)
    else:
        say(f"wrote {Path(args.output_dir)}/sweep-{args.kind}-{label}.json and .png")
        _print_sweep(result)
    return 0


def _print_sweep(s: dict) -> None:
    if s["kind"] == "blend-ratio":
        m = s["metric"]
        print(f"{'r':>6} {'KL mean':>9} {'KL med':>9} {'top-1':>6} {'greedy':>6} {m:>8} {'TTFT ms':>9}")
        for r in s["rows"]:
            print(f"{r['ratio']:>6g} {r['first_token_kl']:>9.4f} {r['first_token_kl_median']:>9.4f} "
                  f"{r['top1_agreement']:>6.2f} {r.get('greedy_agreement') or 0:>6.2f} {r.get(m) or 0:>8.3f} "
                  f"{r['ttft_ms']:>9.0f}")
    elif s["kind"] in ("ape-grid", "calibrate"):
        print("mean first-token KL to full (rows T, columns S)")
        print("T \\ S " + " ".join(f"{x:>7g}" for x in s["scales"]))
        for t, row in zip(s["temperatures"], s["first_token_kl"]):
            print(f"{t:>5g} " + " ".join(f"{v:>7.4f}" for v in row))
    else:
        for r in s["rows"]:
            print(f"{r['num_passages']:>3} passages: " + ", ".join(
                f"{m} {v.get(s['metric']) or 0:.3f}" for m, v in r["modes"].items()))


def run_calibrate_cmd(args) -> int:
    from ragkv.eval.datasets import EVAL_DATASETS  # reported on: calibrating there would tune on the test set

    if args.dataset in EVAL_DATASETS and not args.allow_eval_data:
        raise RagkvError(f"{args.dataset!r} is evaluation data: calibrating on it would tune {args.target} on the "
                         "test set; use the default hotpotqa-train, nq-distractors-heldout or a --data-file (or "
                         "--allow-eval-data)")
    if args.target == "auto":
        return _calibrate_auto(args)
    if args.target == "fidelity":
        from ragkv.cli.calibrate_fidelity import run_fidelity_calibration

        return run_fidelity_calibration(args)
    from ragkv.bench import sweeps

    label, desc, kw = dataset_spec(args, "hotpotqa-train")
    examples = load_examples(kw, args.limit)
    temps, scales = _floats(args.temperatures), _floats(args.scales)
    if not temps or not scales or min(temps + scales) <= 0:
        raise RagkvError("--temperatures and --scales want positive numbers")
    max_new = getattr(args, "max_new_tokens", None)
    if args.objective == "score" and max_new == 0:
        raise RagkvError("--objective score compares answers: give --max-new-tokens > 0 (default 32), or use "
                         "--objective kl")
    max_new = (32 if args.objective == "score" else 0) if max_new is None else max_new
    engine = load_engine(args)
    sw = _sweep_run(args, label, desc, engine, args.output_dir, max_new)
    grid = sweeps.calibrate_ape(sw, examples, temps, scales, args.objective)
    if args.json:
        print_json(grid)
        return 0
    _print_sweep(grid)
    b, d, metric = grid["best"], grid.get("default"), grid.get("metric")
    score = lambda x: f"{metric} {x.get(metric) or 0:.3f}, " if metric else ""  # noqa: E731
    print(f"\ncalibrated by {grid['objective']} T={b['temperature']:g}, S={b['scale']:g}: {score(b)}mean KL "
          f"{b['first_token_kl']:.4f} (median {b['first_token_kl_median']:.4f}, top-1 {b['top1_agreement']:.2f}) "
          f"on {label}, n={grid['n_examples']}")
    if d:
        print(f"default    T=0.9, S=0.9: {score(d)}mean KL {d['first_token_kl']:.4f} (median "
              f"{d['first_token_kl_median']:.4f}, top-1 {d['top1_agreement']:.2f})")
    print(f"saved to {grid['saved_to']}; `ape` now uses it by default for this model")
    return 0


def _calibrate_auto(args) -> int:
    from ragkv.engine.fusion.calibration import save_auto_params
    from ragkv.eval.datasets import EVAL_DATASETS
    from ragkv.eval.results import read_results
    from ragkv.eval.risk import calibrate_auto

    if not 0 < args.ratio < 1 or args.target_kl < 0 or not 0 <= args.max_escalation <= 1:
        raise RagkvError("--ratio wants (0, 1), --target-kl >= 0 and --max-escalation [0, 1]")
    key = f"blend:sel=query,r={args.ratio:g}"
    if args.records:  # the records' own model is the one calibrated: no model to load
        config, records = read_results(Path(args.records))
        label = config.get("dataset") or Path(args.records).stem
        if label in EVAL_DATASETS and not args.allow_eval_data:
            raise RagkvError(f"{args.records} holds {label!r}, evaluation data: calibrate on held-out records "
                             "(or --allow-eval-data)")
        if not config.get("fingerprint"):
            raise RagkvError(f"{args.records} does not say which model wrote it (no fingerprint in its header)")
        fingerprint, model, dtype = config["fingerprint"], config.get("model"), config.get("dtype")
    else:
        engine = load_engine(args)
        fingerprint, model, dtype = engine.fingerprint, engine.model_name, engine.dtype_name
        label, desc, kw = dataset_spec(args, "hotpotqa-train")
        examples = load_examples(kw, args.limit)
        if args.passage_order != "as-given":
            examples = rank_passages(examples, args.passage_order)
        sw = _sweep_run(args, label, desc, engine, args.output_dir, 0)  # the first token is all it compares
        records = sw.evaluate(examples, ["full", key], "calibrate-auto")[1]["records"]
    try:
        cal = calibrate_auto(records, key, args.target_kl, args.max_escalation, args.signal)
    except ValueError as e:
        raise RagkvError(str(e)) from None
    cal.update(data=label, model=model, dtype=dtype)
    path = save_auto_params(fingerprint, cal["signal"], cal["threshold"], **{
        k: v for k, v in cal.items() if k not in ("signal", "threshold")})
    out = Path(args.output_dir) / f"calibration-auto-{label}-{model}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**cal, "saved_to": str(path)}, indent=2) + "\n")
    if args.json:
        print_json({**cal, "saved_to": str(path)})
        return 0
    print(f"{'signal':<8} {'rho vs KL':>10} {'rho vs top-1 miss':>18}   ({key}, n={cal['n']}, {label})")
    fmt = lambda v: "-" if v is None else f"{v:+.2f}"  # noqa: E731
    for s, r in cal["spearman"].items():
        print(f"{s:<8} {fmt(r['kl']):>10} {fmt(r['top1_miss']):>18}")
    print(f"\nauto escalates when {cal['signal']} > {cal['threshold']:.4g}: {cal['escalation_rate']:.0%} of answers, "
          f"mean KL to full {cal['mean_kl_before']:.4f} -> {cal['mean_kl_after']:.4f} (escalating as many at random: "
          f"{cal['mean_kl_random_escalation']:.4f}; target {args.target_kl:g}"
          f"{'' if cal['target_met'] else ', NOT met within --max-escalation'}), mean recompute_vs_full about "
          f"{cal['mean_recompute_vs_full']:.2f}")
    print(f"saved to {path}; `auto` now uses it by default for this model")
    return 0


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
    import json

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
