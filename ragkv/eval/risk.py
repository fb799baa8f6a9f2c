"""Which cheap risk signal (ragkv/engine/measure/risk.py) says an approximate answer is far from `full`'s, and the
threshold above which `auto` escalates: measured on held-out eval records by `ragkv calibrate --target auto`."""

from __future__ import annotations

import math

from ragkv.engine.measure.risk import SIGNALS


def _ranks(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):  # ties share their mean rank
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation (Pearson over ranks, ties averaged); None when either side is constant."""
    if len(xs) != len(ys) or len(xs) < 3:
        return None
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return None if sxx == 0 or syy == 0 else sxy / math.sqrt(sxx * syy)


def choose_threshold(risks: list[float], kls: list[float], target_kl: float, max_escalation: float) -> dict:
    """The largest threshold t such that escalating every answer with risk > t (to `full`, KL 0) leaves a mean KL
    to full <= target_kl, but escalating at most `max_escalation` of the answers (the work budget wins). Also the
    mean KL that escalating the same number of answers at random would leave, so that the signal's worth shows."""
    n = len(risks)
    if n == 0 or n != len(kls):
        raise ValueError("calibration needs one risk and one KL per example")
    order = sorted(range(n), key=lambda i: -risks[i])  # most at risk first
    allowed = math.floor(max_escalation * n + 1e-9)
    kept_kl, escalated = sum(kls), 0
    while escalated < allowed and kept_kl / n > target_kl:
        kept_kl -= kls[order[escalated]]
        escalated += 1
    # halfway between the last escalated risk and the next lower one (ties with the last are escalated too)
    if not escalated:
        threshold = max(risks)
    else:
        last = risks[order[escalated - 1]]
        lower = [r for r in risks if r < last]
        threshold = (last + max(lower)) / 2 if lower else last - 1e-12
    escalate = [r > threshold for r in risks]
    left = sum(k for k, e in zip(kls, escalate) if not e) / n
    rate = sum(escalate) / n
    return {"threshold": threshold, "escalation_rate": rate, "mean_kl_after": left,
            "mean_kl_before": sum(kls) / n, "mean_kl_random_escalation": (1 - rate) * sum(kls) / n,
            "target_met": left <= target_kl, "n": n}


def record_risk(record: dict) -> dict | None:
    """An eval record's first stage-2 risk signals: its Recompute record's, or where records older than it kept
    them (`stats_extra.risk`)."""
    return (record.get("recompute") or {}).get("risk") or (record.get("stats_extra") or {}).get("risk")


def calibrate_auto(records: list[dict], mode_key: str, target_kl: float, max_escalation: float,
                   signal: str | None = None) -> dict:
    """From eval records of `full` and one query-aware blend (`mode_key`) on held-out data: each signal's rank
    correlation with the blend's first-token KL to full and with its top-1 disagreement, the signal chosen (the
    given one, else the one that ranks the KL best) and its threshold (`choose_threshold`)."""
    rows = [r for r in records if r.get("mode_key") == mode_key and record_risk(r)]
    if len(rows) < 3:
        raise ValueError(f"calibrating auto needs at least 3 records of {mode_key!r} with risk signals (a "
                         f"query-aware blend: blend:sel=query,r=...), found {len(rows)}")
    kls = [r["fidelity"]["first_token_kl"] for r in rows]
    misses = [1.0 - r["fidelity"]["top1_agreement"] for r in rows]
    values = {s: [record_risk(r).get(s) for r in rows] for s in SIGNALS}
    values = {s: v for s, v in values.items() if None not in v}  # a signal the records lack is not a candidate
    if signal is not None and signal not in values:
        raise ValueError(f"the records carry no {signal!r} signal for every example")
    rho = {s: {"kl": spearman(v, kls), "top1_miss": spearman(v, misses)} for s, v in values.items()}
    chosen = signal or max(rho, key=lambda s: rho[s]["kl"] if rho[s]["kl"] is not None else -2)
    pick = choose_threshold(values[chosen], kls, target_kl, max_escalation)
    rvf = [r["recompute_vs_full"] for r in rows]
    # an escalation adds the rest of the blocks' rows at every layer: about full's work on top of the cheap run's
    pick["mean_recompute_vs_full"] = sum(rvf) / len(rvf) + pick["escalation_rate"]
    return {"mode_key": mode_key, "signal": chosen, "target_kl": target_kl, "max_escalation": max_escalation,
            "spearman": rho, **pick}
