"""A population-level statement of how close an approximate reply is to `full`, for a model never calibrated: the
expected first-token KL to `full` and the probability that the first token equals `full`'s, read off one measured
population and interpolated in the recomputed ratio r (r = 0 is the mode's no-recompute point, r = 1 is `full`:
KL 0, top-1 1). Not a per-reply estimate and not calibrated for the model at hand: every reply says so
(`calibration: "none"`, `basis: "population"`), and the figures are where a per-reply fit would start (issue 49).

The population: NQ-10 (60 questions at gold positions 0, 4 and 9; 170 pairs), Qwen2.5-Coder-0.5B fp32, greedy;
records docs/results/quality_selection/grid-nq10-g{0,4,9}-qwen05.jsonl (session 25; the table below is their
means; recent's from 12 records only)."""

from __future__ import annotations

SOURCE = "NQ-10, Qwen2.5-Coder-0.5B fp32, 170 (gold position, question) pairs (docs/results/quality_selection.md)"
# (mode, selection) -> [(r, mean first-token KL to full, top-1 agreement)], r ascending
POPULATION: dict[tuple[str, str | None], list[tuple[float, float, float]]] = {
    ("reuse", None): [(0.0, 0.399, 0.559)],
    ("ape", None): [(0.0, 0.287, 0.741)],
    ("blend", "deviation"): [(0.0, 0.399, 0.559), (0.15, 0.188, 0.759)],
    ("blend", "query"): [(0.0, 0.399, 0.559), (0.15, 0.113, 0.829), (0.3, 0.053, 0.865)],
    ("blend", "sinks"): [(0.0, 0.399, 0.559), (0.21, 0.131, 0.782)],  # 20 per block: ~21% of the block tokens
    ("blend", "recent"): [(0.0, 0.399, 0.559), (0.15, 0.263, 0.750), (0.3, 0.221, 0.750)],
    ("auto", "query"): [(0.0, 0.399, 0.559), (0.15, 0.077, 0.871)],
}
EXACT = (1.0, 0.0, 1.0)
EXACT_ESTIMATE = {"expected_kl": 0.0, "expected_top1": 1.0, "calibration": "exact", "basis": "exact", "source": None}


def _interpolate(points: list[tuple[float, float, float]], r: float) -> tuple[float, float]:
    pts = points + [EXACT] if points[-1][0] < 1.0 else points
    r = min(max(r, 0.0), 1.0)
    for (r0, kl0, t0), (r1, kl1, t1) in zip(pts, pts[1:]):
        if r <= r1:
            w = 0.0 if r1 == r0 else (r - r0) / (r1 - r0)
            return kl0 + w * (kl1 - kl0), t0 + w * (t1 - t0)
    return pts[-1][1], pts[-1][2]


def population_estimate(mode: str, select: str | None = None, ratio: float = 0.0) -> dict:
    """{expected_kl, expected_top1, calibration, basis, source} for an approximate reply; a mode or selection not
    in the population is stated as unknown (None values), never silently as another's."""
    points = POPULATION.get((mode, select))  # the modes without a selection pass None (and r = 0)
    if points is None:
        return {"expected_kl": None, "expected_top1": None, "calibration": "none", "basis": "unmeasured",
                "source": None}
    kl, top1 = _interpolate(points, ratio)
    return {"expected_kl": round(kl, 4), "expected_top1": round(top1, 4), "calibration": "none",
            "basis": "population", "source": SOURCE}
