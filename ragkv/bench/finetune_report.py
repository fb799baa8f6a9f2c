"""The fine-tuning table (Block-Attention table 1 layout) and accuracy-vs-steps plot (its figure 4) from
`ragkv eval` results files of the base model, the fine-tuned models and their checkpoints.

    ragkv finetune-report --row base=runs/base-s1.jsonl,runs/base-s2.jsonl --row vanilla-ft=runs/vanilla.jsonl \\
        --row block-ft=runs/block.jsonl --curve vanilla-ft:25=runs/v25.jsonl ... --plot docs/results/finetune_curve.png

A model given once per data set (`--row block-ft=hotpot.jsonl --row block-ft=nq.jsonl`) is pooled over them.
"""

from __future__ import annotations

import statistics
from pathlib import Path

LOCAL = "reuse:pos=local"  # no position re-encoding: the paper's w/o-pos rows
CURVE_KEYS = ("full", "reuse", LOCAL)  # the mode keys the accuracy-against-steps curve draws
ROWS = [("base", "full"), ("base", "reuse"), ("base", LOCAL), ("vanilla-ft", "full"), ("vanilla-ft", "reuse"),
        ("block-ft", "reuse"), ("block-ft", "full"), ("block-ft", LOCAL), ("block-local-ft", LOCAL)]
# the paper's claims as paired differences on the same examples: (row, minus row, what the target asks)
TARGETS = [(("block-ft", "reuse"), ("vanilla-ft", "full"), "within 1 point: the interval's upper end >= -1"),
           (("block-ft", "reuse"), ("block-ft", LOCAL), "above: > 0 (re-encoding positions helps)"),
           (("block-ft", "reuse"), ("block-local-ft", LOCAL), "above: > 0 (trained without re-encoding)"),
           (("block-ft", "reuse"), ("base", "reuse"), "above: > 0 (block fine-tuning helps reuse)"),
           # both fine-tunes learn the short answer format; this pair isolates what the block mask adds
           (("block-ft", "reuse"), ("vanilla-ft", "reuse"), "above: > 0 (the block mask, not the format, helps reuse)")]


def data_label(config: dict) -> str:
    """Which examples a run answered: its data set (or file), and the gold position where the set places it."""
    label = str(config.get("dataset") or config.get("data_file") or "data")
    return label if config.get("gold_position") is None else f"{label}@gold{config['gold_position']}"


def load_scores(paths: Path | list[Path], limit: int | None = None) -> tuple[str, dict[str, dict[str, dict]]]:
    """(data label, {mode_key: {example_id: record}}) of one run's results file, or of the files of its shards
    (`ragkv eval --shard`), keeping its first `limit` examples."""
    from ragkv.eval.results import ResultsFileError, read_runs

    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    runs = read_runs(paths)
    if len(runs) != 1:
        raise ResultsFileError(f"{', '.join(map(str, paths))} are {len(runs)} different runs, not the shards of one; "
                               "give one row one run's files")
    _, config, records = runs[0]
    order: dict[str, None] = {}  # example ids in first-seen order (a list made this quadratic)
    out: dict[str, dict[str, dict]] = {}
    for r in records:
        order.setdefault(r["example_id"])
        out.setdefault(r["mode_key"], {})[r["example_id"]] = r
    keep = set(list(order)[:limit]) if limit else set(order)
    return data_label(config), {m: {i: r for i, r in recs.items() if i in keep} for m, recs in out.items()}


def load_row(runs: list[Path | list[Path]], limit: int | None = None) -> dict[str, dict[tuple[str, str], dict]]:
    """One model's runs on one or more data sets, pooled: {mode_key: {(label, example_id): record}}. Pooling
    raises n (more power) and keeps the pairing: two rows are compared over the examples both answered."""
    from ragkv.eval.results import ResultsFileError

    out: dict[str, dict[tuple[str, str], dict]] = {}
    seen: dict[str, str] = {}
    for paths in runs:
        label, scores = load_scores(paths, limit)
        names = ",".join(str(p) for p in (paths if isinstance(paths, list) else [paths]))  # as given to --row
        if label in seen:
            raise ResultsFileError(f"{names} and {seen[label]} are two runs on the same data ({label}); "
                                   "give a model one run per data set")
        seen[label] = names
        for mode, recs in scores.items():
            out.setdefault(mode, {}).update({(label, i): r for i, r in recs.items()})
    return out


def _grouped(rows) -> dict[str, list]:
    """{model: [run, ...]} from (model, run) pairs or a {model: run} dict; a run is a file or its shards."""
    pairs = rows.items() if isinstance(rows, dict) else rows
    out: dict[str, list] = {}
    for model, paths in pairs:
        out.setdefault(model, []).append(paths)
    return out


def mean(xs) -> float | None:
    xs = list(xs)
    return statistics.fmean(xs) if xs else None


def row_stats(recs: dict[str, dict]) -> dict:
    from ragkv.eval.summary import bootstrap_ci

    return {"n": len(recs), "accuracy": mean(r["scores"]["accuracy"] for r in recs.values()),
            "accuracy_ci": bootstrap_ci([r["scores"]["accuracy"] for r in recs.values()]),
            "f1": mean(r["scores"]["f1"] for r in recs.values()),
            "kl": mean(r["fidelity"]["first_token_kl"] for r in recs.values()),
            "tokens": mean(r["completion_tokens"] for r in recs.values())}


def _pct(ci) -> str:
    return f"[{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]"


def table(rows, limit: int | None) -> str:
    """Table 1's rows present in `rows` (accuracy with its 95% bootstrap interval), then the targets as paired
    differences over the examples both rows answered. `rows` is (model, run) pairs or a {model: run} dict; a
    model given once per data set is pooled over them, with a table by data set after."""
    from ragkv.eval.summary import bootstrap_ci

    scores = {model: load_row(runs, limit) for model, runs in _grouped(rows).items()}
    lines = ["| model / mode | accuracy [95% CI] | F1 | first-token KL to the same model's `full` | answer tokens | n |",
             "|---|---|---|---|---|---|"]
    for model, mode in ROWS:
        recs = scores.get(model, {}).get(mode)
        if not recs:
            continue
        s = row_stats(recs)
        lo, hi = s["accuracy_ci"]
        lines.append(f"| {model} / {mode} | {100 * s['accuracy']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}] | "
                     f"{100 * s['f1']:.1f} | {s['kl']:.3f} | {s['tokens']:.1f} | {s['n']} |")
    checks = []
    for (am, amode), (bm, bmode), want in TARGETS:
        a, b = scores.get(am, {}).get(amode), scores.get(bm, {}).get(bmode)
        both = sorted(set(a or ()) & set(b or ()))
        if not both:
            continue
        diff = [a[i]["scores"]["accuracy"] - b[i]["scores"]["accuracy"] for i in both]
        checks.append(f"| {am} / {amode} - {bm} / {bmode} | {100 * mean(diff):+.1f} {_pct(bootstrap_ci(diff))} | "
                      f"{want} | {len(both)} |")
    if checks:
        lines += ["", "| paired difference (points) | mean [95% CI] | target | n |", "|---|---|---|---|", *checks]
    labels = sorted({label for model in scores.values() for recs in model.values() for label, _ in recs})
    if len(labels) > 1:
        lines += ["", "| accuracy by data set (n) | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
        for model, mode in ROWS:
            recs = scores.get(model, {}).get(mode)
            if recs:
                lines.append(f"| {model} / {mode} | " + " | ".join(_by_label(recs, label) for label in labels) + " |")
    return "\n".join(lines)


def _by_label(recs: dict[tuple[str, str], dict], label: str) -> str:
    accs = [r["scores"]["accuracy"] for (of, _), r in recs.items() if of == label]
    return f"{100 * mean(accs):.1f}% ({len(accs)})" if accs else ""


def curve(points: dict[str, dict[int, list[Path | list[Path]]]], limit: int | None) -> dict[str, dict[int, float]]:
    """{"model/mode": {step: accuracy}} over the checkpoints' results files (each point: one run per data set,
    pooled)."""
    out: dict[str, dict[int, float]] = {}
    for model, by_step in points.items():
        for step, runs in sorted(by_step.items()):
            for key, recs in load_row(runs, limit).items():
                if key in CURVE_KEYS and recs:
                    accuracy = mean(r["scores"]["accuracy"] for r in recs.values())  # a point: no bootstrap
                    out.setdefault(f"{model} / {key}", {})[step] = 100 * accuracy
    return out


def plot_curve(series: dict[str, dict[int, float]], path: Path, title: str) -> Path:
    from ragkv.figures import pyplot, save_figure

    fig, ax = pyplot().subplots(figsize=(6.4, 4.2))
    for name, pts in series.items():
        steps = sorted(pts)
        style = "-" if name.endswith("reuse") else "--"
        ax.plot(steps, [pts[s] for s in steps], style, marker="o", label=name)
    base = any(0 in pts for pts in series.values())
    ax.set_xlabel("training steps" + (" (0 = base model)" if base else ""))
    ax.set_ylabel("accuracy (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)
