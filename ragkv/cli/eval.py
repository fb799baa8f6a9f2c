"""`ragkv eval` (a data set or a named suite) and `ragkv sweep`, and the flags `calibrate` shares with them (heavy
imports stay inside the handlers)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ragkv.cli.common import print_json
from ragkv.cli.eval_data import _data_args, _floats, _ints, _model_args, _fusion_args, _run_args, _shard, base_fusion, dataset_spec, load_engine, load_examples, model_label, rank_passages, say
from ragkv.engine.modes import MODES, get_mode
from ragkv.errors import RagkvError
from ragkv.eval.suite import SUITES, get_suite

DEFAULT_MODES = "full,prefix,reuse,ape,blend"


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
    e.add_argument("--prompt", default="dataset", choices=("dataset", "rag", "short"),
                   help="dataset (default): the set's own prompt where it has one (MuSiQue and HotpotQA: answers of "
                        "at most five words, as CacheBlend asks; the few-shot sets' formats); rag: the engine's RAG "
                        "prompt for every set (records written before the sets had their own); short: MuSiQue's and "
                        "HotpotQA's short-answer instruction for any question set (held-out calibration data)")
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
    from ragkv.eval.datasets import DATASETS, SHORT_ANSWER_PROMPT, dataset_prompt, dataset_stop

    prompt = {"dataset": dataset_prompt(kw["name"]), "rag": None, "short": SHORT_ANSWER_PROMPT}[args.prompt]
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
    reference = _reference(args.reference_from, config, examples) if args.reference_from else None
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


def _reference(files: str, config: dict, examples):
    """`--reference-from`: the stored `full` answers every mode here is judged against (each example must have one)."""
    from ragkv.eval.references import ExternalReferences

    reference = ExternalReferences.open(files.split(","), config)
    missing = reference.missing([ex.id for ex in examples])
    if missing:
        raise RagkvError(f"--reference-from has no stored `full` answer for {len(missing)} of the {len(examples)} "
                         f"examples (e.g. {missing[0]}): run the exact eval on them first, with the same data flags "
                         "and a --limit that covers these")
    config["reference_from"] = reference.names  # only when set: files written before the flag still resume
    return reference


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
