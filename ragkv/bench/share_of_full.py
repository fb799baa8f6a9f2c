"""`ragkv report --share-of-full`: each mode key's task score as a share of `full`'s, the way the KV-reuse papers
print it (CacheBlend, ProphetKV: F1 or Rouge-L relative to the full prefill at 15-20% recompute), per data set and
pooled, per model, with its work, and a picture of share against work.

Per data set: share = sum of the key's scores / sum of full's, over the questions both answered (each set's own
metric: the records name it). Pooled: the mean of the sets' shares (each set weighs the same, as the papers
average). Intervals: a percentile bootstrap by question, the key's and full's scores on the same drawn questions
(paired with full); each key's questions are drawn anew from one generator that runs through the sets and keys in
turn, so the intervals are not paired between keys and a key added to a file moves the draws of the keys after it.
For the pooled share each set is resampled on its own (stratified). Work: the key's mean `recompute_vs_full` (pooled:
the mean of the sets' means).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from ragkv.bench.common import markdown_table
from ragkv.eval.results import read_runs
from ragkv.eval.suite import PAPERS
from ragkv.eval.summary import BOOTSTRAP_SEED, CONFIDENCE

REFERENCE = "full"
RESAMPLES = 4000
TARGET_WORK = 0.2     # the papers' budget: at most a fifth of full's work
TARGET_POOLED = 0.98  # and at least this share of full's score pooled
TARGET_EACH = 0.95    # with no data set below this
MIN_QUESTIONS = 60    # per data set, for the bar to be claimed


def _set_label(config: dict) -> str:
    return config.get("dataset") or Path(config.get("data_file") or "?").stem


def collect(paths: list[Path], metrics: dict | None = None) -> dict:
    """{(model, dtype): {data set: {"metric", "scores": {key: {example: score}}, "work": {key: [recompute_vs_full]},
    "kl": {key: [first-token KL to full]}}}}
    from the runs' records (the shards of one run merged); `metrics`: data set -> the metric to read (a suite's),
    else each record's own."""
    out: dict = {}
    for _, config, records in read_runs(paths):
        model = (config.get("model"), config.get("dtype"))
        label = _set_label(config)
        entry = out.setdefault(model, {}).setdefault(label, {"metric": None, "scores": {}, "work": {}, "kl": {}})
        for r in records:
            metric = (metrics or {}).get(label) or r.get("metric")
            if metric is None or metric not in r.get("scores", {}):
                continue
            entry["metric"] = entry["metric"] or metric
            entry["scores"].setdefault(r["mode_key"], {})[r["example_id"]] = float(r["scores"][metric])
            if r.get("recompute_vs_full") is not None:
                entry["work"].setdefault(r["mode_key"], []).append(float(r["recompute_vs_full"]))
            kl = (r.get("fidelity") or {}).get("first_token_kl")
            if kl is not None:
                entry["kl"].setdefault(r["mode_key"], []).append(float(kl))
    return out


def _interval(samples: np.ndarray) -> list[float]:
    lo, hi = np.quantile(samples, [(1 - CONFIDENCE) / 2, (1 + CONFIDENCE) / 2])
    return [round(float(lo), 4), round(float(hi), 4)]


def shares(sets: dict, keys: list[str], resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED) -> dict:
    """Per key: each set's share (point, interval, n) and the pooled one over the sets that hold the key."""
    rng = np.random.default_rng(seed)
    per_key: dict = {k: {"sets": {}, "work": None} for k in keys}
    draws: dict = {k: [] for k in keys}  # per key, each set's bootstrap shares (for the pooled interval)
    for name, entry in sets.items():
        full = entry["scores"].get(REFERENCE, {})
        for k in keys:
            mine = entry["scores"].get(k, {})
            ids = sorted(set(full) & set(mine))
            if not ids:
                continue
            f = np.array([full[i] for i in ids])
            m = np.array([mine[i] for i in ids])
            if f.sum() <= 0:
                continue  # full scored nothing here: no share to take
            idx = rng.integers(0, len(ids), size=(resamples, len(ids)))  # questions drawn with replacement
            fs = f[idx].sum(axis=1)
            boot = np.where(fs > 0, m[idx].sum(axis=1) / np.maximum(fs, 1e-12), np.nan)
            point = float(m.sum() / f.sum())
            per_key[k]["sets"][name] = {"share": round(point, 4), "ci": _interval(boot[~np.isnan(boot)]),
                                        "n": len(ids), "score": round(float(m.mean()), 4),
                                        "full": round(float(f.mean()), 4), "metric": entry["metric"]}
            draws[k].append(boot)
    for k in keys:
        got = per_key[k]["sets"]
        if got:
            with warnings.catch_warnings():  # a draw where full scored nothing in every set has no share
                warnings.simplefilter("ignore", RuntimeWarning)
                pooled = np.nanmean(np.stack(draws[k]), axis=0)
            per_key[k]["pooled"] = {"share": round(float(np.mean([s["share"] for s in got.values()])), 4),
                                    "ci": _interval(pooled[~np.isnan(pooled)]), "sets": len(got)}
        work = [np.mean(entry["work"][k]) for entry in sets.values() if entry["work"].get(k)]
        per_key[k]["work"] = round(float(np.mean(work)), 4) if work else None  # each set weighs the same
        # the first token's KL to full's, per record: at n = 60 it tells keys apart where the task score cannot
        kls = [np.mean(entry["kl"][k]) for entry in sets.values() if entry.get("kl", {}).get(k)]
        per_key[k]["kl"] = round(float(np.mean(kls)), 4) if kls else None
    return per_key


def meets(row: dict, min_n: int = MIN_QUESTIONS) -> bool:
    """The papers' bar: at most a fifth of full's work, >= 98% of its score pooled, no set below 95%, each set on at
    least `min_n` questions (fewer cannot tell 98% from 90%)."""
    pooled, work = row.get("pooled"), row.get("work")
    return bool(pooled and work is not None and work <= TARGET_WORK and pooled["share"] >= TARGET_POOLED
                and all(s["share"] >= TARGET_EACH and s["n"] >= min_n for s in row["sets"].values()))


def share_of_full(paths: list[Path], png: Path | None = None, modes: list[str] | None = None,
                  metrics: dict | None = None) -> dict:
    """Returns {"models": {label: {key: row}}, "markdown"}; writes the share-vs-work picture to `png`. `metrics`:
    data set -> metric (default: the papers' suite's, eval/suite.py; a set it does not name: its records' own)."""
    data = collect(paths, PAPERS.metrics if metrics is None else metrics)
    if not data:
        raise ValueError("no records with a task metric in the given files")
    models, parts = {}, []
    for (model, dtype), sets in sorted(data.items(), key=lambda kv: str(kv[0])):
        keys = modes or list(dict.fromkeys(k for e in sets.values() for k in e["scores"]))
        keys = [k for k in keys if k != REFERENCE]
        if not any(REFERENCE in e["scores"] for e in sets.values()):
            raise ValueError(f"{model} {dtype}: no `full` records to take shares of")
        rows = shares(sets, keys)
        label = f"{model} {dtype}"
        models[label] = rows
        parts.append(_markdown(label, sets, rows))
    if png is not None:
        _plot(models, png)
    return {"models": models, "markdown": "\n\n".join(parts)}


def _cell(s: dict | None) -> str:
    if not s:
        return "-"
    return f"{100 * s['share']:.1f}% [{100 * s['ci'][0]:.1f}, {100 * s['ci'][1]:.1f}]" + (
        f" n={s['n']}" if "n" in s else "")


def _mean_score(entry: dict, key: str) -> str:
    xs = list(entry["scores"].get(key, {}).values())
    return f"{np.mean(xs):.3f} n={len(xs)}" if xs else "-"


def _verdict(row: dict) -> str:
    """The bar on the point share, and whether the pooled interval clears it too (a point of 98.6% with an interval
    from 82% is not the same claim as one whose interval starts above 98%)."""
    if not meets(row):
        return f"not yet (n < {MIN_QUESTIONS})" if meets(row, min_n=0) else "no"
    low = row["pooled"]["ci"][0]
    return "yes, interval above 98%" if low >= TARGET_POOLED else f"point only (interval from {100 * low:.0f}%)"


def _markdown(label: str, sets: dict, rows: dict) -> str:
    names = sorted(sets)
    head = ["key", "work"] + [f"{n} ({sets[n]['metric']})" for n in names] + ["pooled", "first-token KL",
                                                                              "meets 98% at <= 20%"]
    body = []
    body.append(["full (mean score)", "100%"] + [_mean_score(sets[n], REFERENCE) for n in names] + ["100%", "0",
                                                                                                  "-"])
    for k, row in rows.items():
        work = "-" if row["work"] is None else f"{100 * row['work']:.1f}%"
        verdict = _verdict(row)
        kl = "-" if row.get("kl") is None else f"{row['kl']:.3f}"
        body.append([k, work] + [_cell(row["sets"].get(n)) for n in names] + [_cell(row.get("pooled")), kl, verdict])
    return f"### {label}\n\nShare of `full`'s score (95% bootstrap by question); work = token-layers vs full; " \
        "first-token KL: the mean over each set's records of KL(full || key) of the answer's first token, the sets " \
        "weighing alike.\n\n" + \
        markdown_table(head, body)


def _curve(key: str) -> str:
    """A selection's curve: its key without the ratio (`blend:sel=query,r=0.15` -> `blend:sel=query`)."""
    mode, _, params = key.partition(":")
    rest = [p for p in params.split(",") if p and not p.startswith("r=")]
    return mode + (":" + ",".join(rest) if rest else "")


def _plot(models: dict, png: Path) -> None:
    from ragkv.figures import pyplot, save_figure

    plt = pyplot()
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, (label, rows) in zip(axes[0], models.items()):
        curves: dict = {}
        for k, row in rows.items():
            if row.get("pooled") and row["work"] is not None:
                curves.setdefault(_curve(k), []).append((row["work"], row["pooled"]["share"], row["pooled"]["ci"]))
        for name, pts in curves.items():
            pts.sort()
            x = [100 * p[0] for p in pts]
            y = [100 * p[1] for p in pts]
            err = [[100 * (p[1] - p[2][0]) for p in pts], [100 * (p[2][1] - p[1]) for p in pts]]
            ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=name, linestyle="-" if len(pts) > 1 else "")
        ax.axhline(100, color="gray", linewidth=0.8)
        ax.axhline(100 * TARGET_POOLED, color="gray", linestyle=":", linewidth=0.8)
        ax.axvline(100 * TARGET_WORK, color="gray", linestyle=":", linewidth=0.8)
        ax.set_xlabel("work (% of full's token-layers)")
        ax.set_ylabel("score (% of full's), pooled over the suite")
        ax.set_title(label)
        ax.legend(fontsize=7)
    save_figure(fig, png)
