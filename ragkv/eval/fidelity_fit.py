"""`ragkv calibrate --target fidelity`: a per-reply estimate of how close an approximate answer is to `full`,
fitted on eval records of held-out data.

Per (mode, selection), from features every reply has when its prefill ends: the recomputed share r (token-layers
against a full prefill), the answer's first-token entropy H and margin m (engine/measure/estimates.py reads the same):
- expected_top1: logistic regression of "first token equals full's" on [1, r, H, m] (ridge 1e-2, Newton steps);
- expected_kl: linear regression of log(KL + 1e-4) on the same, back-transformed with Duan's smearing factor (the
  mean of exp(residual)), so that its mean matches the KL's mean rather than its geometric mean.

Held-out figures come from two folds split by question (every record of a question on one side): the binned
calibration error of expected_top1 (equal-width bins of the stated probability; per bin |mean stated - mean
measured|), Spearman(expected_kl, measured KL) pooled and per key, and the same for what the replies state without
the fit (`without`: the population estimate of engine/measure/estimates.py; for w8a8's replies, the exact weights'
estimate composed with w8a8's figures), for comparison."""

from __future__ import annotations

import hashlib
import math

import numpy as np

from ragkv.engine.modes import get_mode
from ragkv.engine.measure.estimates import FEATURES, FidelityFits, fit_key, population_estimate, with_weights
from ragkv.eval.risk import spearman
from ragkv.models.quant import INEXACT_PREFILL

KL_FLOOR = 1e-4
MIN_RECORDS = 20  # per key: fewer leaves the key to the population estimate


def usable(records: list[dict]) -> list[dict]:
    """Approximate answers with a measured fidelity to full and the features (answer_confidence)."""
    return [r for r in records if r.get("fidelity") and "first_token_kl" in r["fidelity"]
            and r.get("answer_confidence") and not (r.get("mode_fidelity") or {}).get("exact", True)]


def features(r: dict) -> list[float]:
    conf = r["answer_confidence"]
    return [1.0, float(r.get("recompute_vs_full") or 0.0), conf["entropy"], conf["margin"]]


def weights_of(r: dict) -> str | None:
    """The record's weights where they change its first token (w8a8; an eval run with --decode-weights w8a8)."""
    w = (r.get("mode_fidelity") or {}).get("decode_weights")
    return w if w in INEXACT_PREFILL else None


def record_key(r: dict) -> str:
    return fit_key(r["mode"], (r.get("mode_fidelity") or {}).get("select"), weights_of(r))


def _logistic(X: np.ndarray, y: np.ndarray, lam: float = 1e-2, steps: int = 50) -> np.ndarray:
    w = np.zeros(X.shape[1])
    for _ in range(steps):
        p = 1 / (1 + np.exp(-np.clip(X @ w, -30, 30)))
        grad = X.T @ (p - y) + lam * w
        hess = (X * (p * (1 - p))[:, None]).T @ X + lam * np.eye(X.shape[1])
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.abs(step).max() < 1e-8:
            break
    return w


def _ridge(X: np.ndarray, y: np.ndarray, lam: float = 1e-2) -> np.ndarray:
    return np.linalg.solve(X.T @ X + lam * np.eye(X.shape[1]), X.T @ y)


def fit(records: list[dict]) -> dict:
    """{key: {top1, log_kl, smear, n, share_range, entropy_range, margin_range}} for every (mode, selection) with
    enough records; the ranges: the recomputed shares and first-token entropies and margins it was fitted on (a reply
    outside them is an extrapolation)."""
    groups: dict[str, list[dict]] = {}
    for r in usable(records):
        groups.setdefault(record_key(r), []).append(r)
    out = {}
    for key, rows in sorted(groups.items()):
        if len(rows) < MIN_RECORDS:
            continue
        X = np.array([features(r) for r in rows])
        top1 = np.array([r["fidelity"]["top1_agreement"] for r in rows], dtype=float)
        log_kl = np.log(np.array([r["fidelity"]["first_token_kl"] for r in rows]) + KL_FLOOR)
        w_kl = _ridge(X, log_kl)
        smear = float(np.mean(np.exp(log_kl - X @ w_kl)))
        out[key] = {"top1": _logistic(X, top1).round(6).tolist(), "log_kl": w_kl.round(6).tolist(),
                    "smear": round(smear, 6), "kl_floor": KL_FLOOR, "n": len(rows),
                    **{f"{name}_range": [round(float(X[:, i].min()), 4), round(float(X[:, i].max()), 4)]
                       for i, name in ((1, "share"), (2, "entropy"), (3, "margin"))}}
    return out


def _fold(r: dict) -> int:
    return int(hashlib.sha256(str(r["example_id"]).encode()).hexdigest(), 16) % 2


def without_fit(r: dict, base: FidelityFits | None) -> dict:
    """What the record's reply states where no fit covers its key: the population figure; on w8a8 weights, the exact
    weights' estimate (`base`'s fit where it has one, else the population's) composed with w8a8's figures."""
    mf = r.get("mode_fidelity") or {}
    pop = population_estimate(r["mode"], mf.get("select"), mf.get("ratio") or 0.0 if mf.get("select") else 0.0)
    if not weights_of(r):
        return pop
    if get_mode(r["mode"]).always_exact:  # `full`, `prefix`: the weights' error alone
        return with_weights(None, weights_of(r))
    exact = base.predict(r["mode"], mf.get("select"), features(r)[1:]) if base is not None else None
    return with_weights(exact or pop, weights_of(r))


def held_out(records: list[dict], test: list[dict] | None = None, bins: int = 5,
             base: FidelityFits | None = None) -> dict:
    """Out-of-sample figures: fitted on `records` and judged on `test` when given, else two folds by question;
    beside them, the same figures of what the replies state without the fit (`without_fit`, `base`: the fit this
    one is saved beside)."""
    rows = usable(records)
    if test is not None:
        pairs = [(FidelityFits(fit(rows), "held-out"), usable(test))]
    else:
        pairs = [(FidelityFits(fit([r for r in rows if _fold(r) != k]), "fold"), [r for r in rows if _fold(r) == k])
                 for k in (0, 1)]
    judged = []  # (key, stated top1, stated kl, top1 and kl stated without the fit, measured top1, measured kl)
    for fits, part in pairs:
        for r in part:
            mf = r.get("mode_fidelity") or {}
            est = fits.predict(r["mode"], mf.get("select"), features(r)[1:], weights_of(r))
            if est is None:
                continue
            pop = without_fit(r, base)
            judged.append((record_key(r), est["expected_top1"], est["expected_kl"],
                           pop["expected_top1"], pop["expected_kl"], r["fidelity"]["top1_agreement"],
                           r["fidelity"]["first_token_kl"]))
    return summarize(judged, bins)


def calibration_bins(stated: list[float], measured: list[float], bins: int) -> list[dict]:
    out = []
    for b in range(bins):
        lo, hi = b / bins, (b + 1) / bins
        idx = [i for i, s in enumerate(stated) if lo <= s < hi or (b == bins - 1 and s == 1.0)]
        if idx:
            out.append({"bin": [round(lo, 2), round(hi, 2)], "n": len(idx),
                        "stated": round(sum(stated[i] for i in idx) / len(idx), 4),
                        "measured": round(sum(measured[i] for i in idx) / len(idx), 4)})
    return out


def _judge(rows: list[tuple], bins: int) -> dict:
    def block(stated_top1, stated_kl):
        cal = calibration_bins([r[stated_top1] for r in rows if r[stated_top1] is not None],
                               [r[5] for r in rows if r[stated_top1] is not None], bins)
        n = sum(c["n"] for c in cal) or 1
        pairs = [(r[stated_kl], r[6]) for r in rows if r[stated_kl] is not None]
        rho = spearman([a for a, _ in pairs], [b for _, b in pairs]) if len(pairs) > 2 else None
        return {"calibration_bins": cal,
                "calibration_error": round(sum(c["n"] * abs(c["stated"] - c["measured"]) for c in cal) / n, 4),
                "max_bin_error": round(max((abs(c["stated"] - c["measured"]) for c in cal if c["n"] >= 5),
                                           default=math.nan), 4),
                "spearman_kl": None if rho is None else round(rho, 4)}
    return {"n": len(rows), "fitted": block(1, 2), "without": block(3, 4)}


def summarize(judged: list[tuple], bins: int = 5) -> dict:
    out = {"pooled": _judge(judged, bins), "per_key": {}}
    for key in sorted({j[0] for j in judged}):
        out["per_key"][key] = _judge([j for j in judged if j[0] == key], bins)
    return out


def document(model: str, dtype: str, records_desc: str, fits: dict) -> dict:
    """The JSON `ragkv calibrate --target fidelity` saves (engine/measure/estimates.py FidelityFits reads it): the
    model and dtype it was fitted on, each key's fit, its held-out figures and the records' files (to re-derive it)."""
    return {"kind": "fidelity-fit", "version": 2, "model": model, "dtype": dtype, "features": list(FEATURES),
            "source": records_desc, "fits": fits}


def held_out_figures(judged: dict, key: str) -> dict | None:
    """A key's out-of-sample figures as a shipped fit states them (None: the key was never judged out of sample)."""
    got = judged.get("per_key", {}).get(key, {}).get("fitted")
    if not got:
        return None
    worst = got["max_bin_error"]
    return {"n": judged["per_key"][key]["n"], "calibration_error": got["calibration_error"],
            "max_bin_error": None if worst is None or math.isnan(worst) else worst, "spearman_kl": got["spearman_kl"]}
