"""A population-level statement of how close an approximate reply is to `full`, for a model never calibrated: the
expected first-token KL to `full` and the probability that the first token equals `full`'s, read off one measured
population and interpolated in the recomputed ratio r (r = 0 is the mode's no-recompute point, r = 1 is `full`:
KL 0, top-1 1). Not a per-reply estimate and not calibrated for the model at hand: every reply says so
(`calibration: "none"`, `basis: "population"`), and the figures are where a per-reply fit would start.

The population: NQ-10 (60 questions at gold positions 0, 4 and 9; 170 pairs), Qwen2.5-Coder-0.5B fp32, greedy;
records docs/results/quality_selection/grid-nq10-g{0,4,9}-qwen05.jsonl (the table below is their
means; recent's from 12 records only)."""

from __future__ import annotations

import math

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
# weights that change the first token too (w8a8: int8 products in prefill) -> (first-token KL of their `full` to the
# exact weights' `full`, top-1 agreement, where measured): `ragkv bench weights --weights onednn,w8a8`
WEIGHTS_POPULATION: dict[str, tuple[float, float, str]] = {
    "w8a8": (0.0039, 0.875, "Qwen2.5-Coder-0.5B bf16, 16 MuSiQue prompts, `full` on w8a8 against the exact weights "
                            "(docs/results/cpu_bf16.md)"),
}
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


def with_weights(estimate: dict | None, weights: str) -> dict:
    """A reply's estimate when its weights are approximate too and no fit covers both: the weights' own population
    figures composed with the mode's estimate (the exact weights' fit, else its population figure; exact for `full`
    and `prefix`): KL added, top-1 multiplied, the two errors taken as independent, a rough rule, so basis says
    "..., composed" and calibration "none"."""
    kl_w, top1_w, source = WEIGHTS_POPULATION.get(weights, (None, None, None))
    if kl_w is None:
        return {"expected_kl": None, "expected_top1": None, "calibration": "none", "basis": "unmeasured",
                "source": None}
    est = estimate or EXACT_ESTIMATE
    if est.get("expected_kl") is None:
        return {**est, "calibration": "none"}
    return {"expected_kl": round(est["expected_kl"] + kl_w, 4),
            "expected_top1": round(est["expected_top1"] * top1_w, 4), "calibration": "none",
            "basis": "population" if est.get("basis") == "exact" else f"{est.get('basis')}, composed",
            "source": source if est.get("basis") == "exact" else f"{est.get('source')}; {source}"}


# --- a per-reply estimate, fitted on held-out records by `ragkv calibrate --target fidelity` (eval/fidelity_fit) ---

FEATURES = ("1", "recompute_share", "entropy", "margin")  # the reply's, when its prefill ends


def fit_key(mode: str, select: str | None, weights: str | None = None) -> str:
    """`mode|select`, and `|weights` for a reply on weights that change its first token (w8a8): its distance to the
    exact weights' `full` is fitted apart."""
    return f"{mode}|{select or ''}" + (f"|{weights}" if weights else "")


SHARE_SLACK = 0.02  # a reply's recomputed share this far outside a fit's range is still within it


class FidelityFits:
    """Per (mode, selection): a logistic model of "the first token is full's" and a log-linear one of the first-token
    KL, on FEATURES, fitted on one model in one dtype. Keys without a fit fall back to the population estimate; a
    reply whose recomputed share, first-token entropy or margin lies outside those a key was fitted on says
    `calibration: "extrapolated"`."""

    def __init__(self, fits: dict, source: str, calibration: str = "fitted", dtype: str | None = None):
        self.fits, self.source, self.calibration, self.dtype = fits, source, calibration, dtype

    @classmethod
    def load(cls, path) -> "FidelityFits | None":
        import json
        from pathlib import Path

        try:
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if doc.get("kind") != "fidelity-fit" or list(doc.get("features", ())) != list(FEATURES):
            return None
        return cls(doc.get("fits") or {}, str(doc.get("source") or path), dtype=doc.get("dtype"))

    def predict(self, mode: str, select: str | None, x: list[float], weights: str | None = None) -> dict | None:
        """{expected_kl, expected_top1, calibration, basis, source} from the features after the constant, or None."""
        f = self.fits.get(fit_key(mode, select, weights))
        if f is None:
            return None
        z = [1.0, *x]
        logit = sum(w * v for w, v in zip(f["top1"], z))
        top1 = 1 / (1 + math.exp(-max(-30.0, min(30.0, logit))))
        log_kl = sum(w * v for w, v in zip(f["log_kl"], z))
        kl = max(0.0, math.exp(min(log_kl, 10.0)) * f["smear"] - f["kl_floor"])
        source, calibration = f.get("source") or self.source, self.calibration
        beyond = []  # features outside what the key was fitted on: a guess beyond the data
        lo, hi = f.get("share_range") or (0.0, 1.0)
        if not lo - SHARE_SLACK <= x[0] <= hi + SHARE_SLACK:
            beyond.append(f"recomputed shares {lo:.2f}-{hi:.2f}, this reply's {x[0]:.2f}")
        # a prompt unlike the fit's shows in the first token (the 1.5B fitted on NQ-10 under the RAG prompt, entropy
        # 0.76-2.34: under a short-answer prompt 50 of its 60 MuSiQue replies lay above, their KL 3x the estimate)
        for name, v in (("entropy", x[1]), ("margin", x[2])):
            rng = f.get(f"{name}_range")
            if rng is not None and not rng[0] <= v <= rng[1]:
                beyond.append(f"first-token {name} {rng[0]:.2f}-{rng[1]:.2f}, this reply's {v:.2f}")
        if beyond:
            calibration = "extrapolated"
            source = f"{source}; fitted on " + "; ".join(beyond)
        return {"expected_kl": round(kl, 4), "expected_top1": round(top1, 4), "calibration": calibration,
                "basis": "per-reply", "source": source}

    def estimate(self, fidelity: dict, share: float, logits, weights: str | None = None) -> dict | None:
        """The reply's estimate from its fidelity statement (mode, select), recomputed share and first-token logits."""
        return self.from_logits(fidelity.get("mode", ""), fidelity.get("select"), share, logits, weights)

    def from_logits(self, mode: str, select: str | None, share: float, logits, weights: str | None = None) -> dict | None:
        """`predict` on a reply's features: its recomputed share and its first-token entropy and margin."""
        if fit_key(mode, select, weights) not in self.fits:
            return None
        from ragkv.ops.divergence import confidence

        conf = confidence(logits)
        return self.predict(mode, select, [share, conf["entropy"], conf["margin"]], weights)


def expected_kl(fits: FidelityFits | None, logits, share: float, mode: str = "blend", select: str = "query") -> float:
    """A reply's expected first-token KL to `full` from its logits and recomputed share: the model's fit where it has
    one for (mode, select), else the population's figure at that share (the same for every reply: it cannot rank)."""
    fitted = fits.from_logits(mode, select, share, logits) if fits is not None else None
    if fitted is not None:
        return fitted["expected_kl"]
    return population_estimate(mode, select, share)["expected_kl"] or 0.0


def _safe(model_name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in str(model_name))


def shipped_fit_path(model_name: str):
    """The fit shipped for a registered model (ragkv/engine/measure/fidelity_fits/)."""
    from pathlib import Path

    return Path(__file__).parent / "fidelity_fits" / f"{_safe(model_name)}.json"


def fidelity_fit_path(model_name: str):
    """Where `ragkv calibrate --target fidelity` saves a model's fit (a user's own, over the shipped one)."""
    from ragkv.config import cache_dir

    return cache_dir() / "calibration" / f"fidelity-{model_name}.json"


def load_fidelity_fits(model_name: str, dtype: str | None) -> FidelityFits | None:
    """The user's fit for this model in this dtype, else the one shipped for a registered model
    (ragkv/engine/measure/fidelity_fits/), else None (replies state the population estimate). A fit of another
    dtype (or one that does not say its dtype) is not this model's: bf16's errors are not fp32's. `dtype` None:
    any dtype (reading records whose dtype the caller checks)."""
    for path in (fidelity_fit_path(_safe(model_name)), shipped_fit_path(model_name)):
        if path.exists():
            fits = FidelityFits.load(path)
            if fits is not None and (dtype is None or fits.dtype == dtype):
                return fits
    return None
