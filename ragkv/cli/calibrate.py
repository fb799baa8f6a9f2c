"""`ragkv calibrate`: APE's T and S, auto's risk signal and threshold, or the per-reply fidelity fit, on held-out
data (heavy imports stay inside the handlers)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ragkv.cli.common import print_json
from ragkv.cli.eval import _print_sweep, _sweep_run
from ragkv.cli.eval_data import _data_args, _floats, _model_args, _run_args
from ragkv.cli.eval_data import dataset_spec, load_engine, load_examples, rank_passages
from ragkv.engine.measure.risk import SIGNALS
from ragkv.errors import RagkvError


def register(sub) -> None:
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


# -- handlers ---------------------------------------------------------------------------------------------

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
