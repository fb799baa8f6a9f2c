"""Per-mode summaries of evaluation records, and their rendering as a plain-text or markdown table.

Every task metric comes with a 95% percentile-bootstrap interval over the examples (`<metric>_ci`), and every mode
other than `full` with the paired difference to `full` on the same examples and its interval (`<metric>_vs_full`,
`<metric>_vs_full_ci`): the examples are resampled together, so the interval of the difference is much narrower
than the two separate intervals suggest. The resampling is seeded: the same records give the same intervals.
"""

from __future__ import annotations

import statistics
from typing import Iterable, Sequence

from ragkv.engine.modes import is_reference

TASK_KEYS = ("accuracy", "f1", "exact_match", "rouge_l")
MEAN_KEYS = ("ttft_ms", "encode_ms", "reused_tokens", "recomputed_tokens", "prompt_tokens", "completion_tokens")
BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
CONFIDENCE = 0.95


def _is_reference(key: str) -> bool:
    """Whether a mode key (e.g. `full`, `blend:r=0.3`) names the reference mode, which has no row to compare with."""
    return is_reference(key.partition(":")[0])


def _mean(xs: list[float]) -> float | None:
    return round(statistics.fmean(xs), 6) if xs else None


def bootstrap_ci(values: Sequence[float], confidence: float = CONFIDENCE, resamples: int = BOOTSTRAP_RESAMPLES,
                 seed: int = BOOTSTRAP_SEED) -> tuple[float, float] | None:
    """Percentile bootstrap interval of the mean of `values` (Efron & Tibshirani 1993, ch. 13): `resamples`
    draws of len(values) values with replacement, the (1 - confidence) / 2 and (1 + confidence) / 2 quantiles of
    their means. Deterministic for a given seed. Pass per-example differences (mode - full on the same examples)
    for a paired interval. None for no values.
    """
    import numpy as np

    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return None
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    step = max(1, 2_000_000 // x.size)  # bound the index matrix to ~16 MB
    for start in range(0, resamples, step):
        stop = min(resamples, start + step)
        means[start:stop] = x[rng.integers(0, x.size, size=(stop - start, x.size))].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - confidence) / 2, (1 + confidence) / 2])
    return round(float(lo), 6), round(float(hi), 6)


def summarize_mode(records: list[dict]) -> dict:
    """Means over one mode's records (task metrics only where the task defines them)."""
    out: dict = {"n": len(records)}
    for k in TASK_KEYS:
        vals = [r["scores"][k] for r in records if k in r.get("scores", {})]
        if vals:
            out[k] = _mean(vals)
            out[f"{k}_ci"] = list(bootstrap_ci(vals))
    # examples longer than `full` can take have no reference: no fidelity (eval/harness.py)
    kl = [r["fidelity"]["first_token_kl"] for r in records if "first_token_kl" in r["fidelity"]]
    out["first_token_kl"] = _mean(kl)
    out["first_token_kl_median"] = round(statistics.median(kl), 6) if kl else None
    out["first_token_kl_max"] = round(max(kl), 6) if kl else None
    out["top1_agreement"] = _mean([r["fidelity"]["top1_agreement"] for r in records
                                   if "top1_agreement" in r["fidelity"]])
    for k in ("greedy_agreement", "prefix_agreement"):
        vals = [r["fidelity"][k] for r in records if k in r["fidelity"]]
        if vals:
            out[k] = _mean(vals)
    for k in MEAN_KEYS:
        out[k] = _mean([r[k] for r in records if k in r])
    ttft = [r["ttft_ms"] for r in records]
    out["ttft_ms_median"] = round(statistics.median(ttft), 3) if ttft else None
    params = records[0].get("params") if records else None
    if params:
        out["params"] = params
    return out


def summarize(records: Iterable[dict], modes: list[str] | None = None) -> dict[str, dict]:
    """{mode_key: summary} in the order of `modes` (default: first appearance), plus TTFT relative to `full`
    over the same examples when `full` is among the records."""
    groups: dict[str, list[dict]] = {}
    for r in records:
        if modes is None or r["mode_key"] in modes:
            groups.setdefault(r["mode_key"], []).append(r)
    order = [m for m in (modes or list(groups)) if m in groups]
    out = {m: summarize_mode(groups[m]) for m in order}
    full = {r["example_id"]: r["ttft_ms"] for r in groups.get("full", [])}
    for m in order:
        pairs = [(r["ttft_ms"], full[r["example_id"]]) for r in groups[m] if r["example_id"] in full]
        if pairs and sum(f for _, f in pairs) > 0:
            out[m]["ttft_vs_full"] = round(sum(t for t, _ in pairs) / sum(f for _, f in pairs), 4)
    full_scores = {r["example_id"]: r.get("scores", {}) for r in groups.get("full", [])}
    for m in order:
        if is_reference(m):
            continue
        for k in TASK_KEYS:  # paired: mode - full on the examples both ran
            diffs = [r["scores"][k] - full_scores[r["example_id"]][k] for r in groups[m]
                     if k in r.get("scores", {}) and k in full_scores.get(r["example_id"], {})]
            if diffs:
                out[m][f"{k}_vs_full"] = _mean(diffs)
                out[m][f"{k}_vs_full_ci"] = list(bootstrap_ci(diffs))
                out[m][f"{k}_vs_full_n"] = len(diffs)
    return out


def _fmt(v, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _with_ci(s: dict, key: str, digits: int = 3, signed: bool = False) -> str:
    """'0.190 [0.120, 0.270]': the value and its 95% interval where the summary has one."""
    v, ci = s.get(key), s.get(f"{key}_ci")
    if v is None:
        return "-"
    f = f"{{:+.{digits}f}}" if signed else f"{{:.{digits}f}}"
    return f.format(v) + (f" [{f.format(ci[0])}, {f.format(ci[1])}]" if ci else "")


def table_rows(summary: dict[str, dict]) -> tuple[list[str], list[list[str]]]:
    """Column headers and rows shared by the CLI table and the report. Accuracy carries its 95% bootstrap
    interval, and (with `full` in the summary) the paired difference to `full` with its interval."""
    tasks = [k for k in TASK_KEYS if any(k in s for s in summary.values())]
    delta = "accuracy" in tasks and any("accuracy_vs_full" in s for s in summary.values())
    headers = (["mode", "n"] + [f"{k} [95% CI]" if k == "accuracy" else k for k in tasks]
               + (["acc - full [95% CI]"] if delta else [])
               + ["KL mean", "KL median", "top-1", "greedy=", "prefix len", "TTFT ms", "vs full", "encode ms",
                  "reused", "recomputed"])
    rows = []
    for mode, s in summary.items():
        rows.append([mode, str(s["n"])] + [_with_ci(s, k) if k == "accuracy" else _fmt(s.get(k)) for k in tasks]
                    + ([_with_ci(s, "accuracy_vs_full", signed=True) if not _is_reference(mode) else "-"]
                       if delta else []) + [
            _fmt(s["first_token_kl"], 4), _fmt(s["first_token_kl_median"], 4), _fmt(s["top1_agreement"], 2),
            _fmt(s.get("greedy_agreement"), 2), _fmt(s.get("prefix_agreement"), 1), _fmt(s["ttft_ms"], 0),
            f"{100 * s['ttft_vs_full']:.1f}%" if "ttft_vs_full" in s else "-", _fmt(s["encode_ms"], 0),
            _fmt(s["reused_tokens"], 0), _fmt(s["recomputed_tokens"], 0)])
    return headers, rows


def text_table(summary: dict[str, dict]) -> str:
    headers, rows = table_rows(summary)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells):
        return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])

