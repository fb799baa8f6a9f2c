"""Each shipped fidelity fit (ragkv/engine/measure/fidelity_fits/) holds what its file states: re-fitted from the
committed records it names, the coefficients and the held-out figures come out the same; it applies to its own
dtype only; a reply outside the recomputed shares, first-token entropies or margins a key was fitted on says it is an
extrapolation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ragkv.engine.measure.estimates import FidelityFits, load_fidelity_fits
from ragkv.eval import fidelity_fit
from ragkv.eval.results import read_results

ROOT = Path(__file__).resolve().parent.parent
FITS = sorted((ROOT / "ragkv" / "engine" / "measure" / "fidelity_fits").glob("*.json"))


def _records(files: list[str]) -> list[dict]:
    return [r for f in files for r in read_results(ROOT / f)[1]]


@pytest.mark.parametrize("path", FITS, ids=lambda p: p.stem)
def test_a_shipped_fit_is_re_derived_from_its_committed_records(path):
    doc = json.loads(path.read_text())
    assert doc["dtype"] in ("float32", "bfloat16") and doc["fits"]
    for key, shipped in doc["fits"].items():
        assert shipped.get("held_out"), f"{path.name} {key}: shipped without a held-out figure"
        rows = _records(shipped["records"])
        assert {read_results(ROOT / f)[0]["dtype"] for f in shipped["records"]} == {doc["dtype"]}
        again = fidelity_fit.fit(rows)[key]
        for field in ("top1", "log_kl"):
            assert again[field] == pytest.approx(shipped[field], abs=1e-5), (key, field)
        for field in ("n", "share_range", "entropy_range", "margin_range"):
            assert again[field] == shipped[field], (key, field)
        test = _records(shipped.get("test_records") or []) or None
        judged = fidelity_fit.held_out(rows, test)
        assert fidelity_fit.held_out_figures(judged, key) == shipped["held_out"], key


def test_a_fit_holds_for_its_own_dtype_only():
    assert load_fidelity_fits("qwen2.5-coder-0.5b", "bfloat16").dtype == "bfloat16"
    assert load_fidelity_fits("qwen2.5-coder-0.5b", "float32") is None  # fp32 replies state the population figure
    assert load_fidelity_fits("smollm2", "float32") is not None and load_fidelity_fits("smollm2", "bfloat16") is None


def test_a_reply_outside_the_fitted_shares_says_it_is_extrapolated():
    fits = FidelityFits.load(ROOT / "ragkv/engine/measure/fidelity_fits/qwen2.5-coder-0.5b.json")
    lo, hi = fits.fits["blend|query"]["share_range"]
    inside = fits.predict("blend", "query", [(lo + hi) / 2, 1.0, 0.5])
    outside = fits.predict("blend", "query", [0.05, 1.0, 0.5])
    assert inside["calibration"] == "fitted"
    assert outside["calibration"] == "extrapolated" and f"{lo:.2f}-{hi:.2f}" in outside["source"]


def test_a_reply_whose_first_token_is_unlike_the_fits_says_it_is_extrapolated():
    """The 1.5B was fitted on NQ-10 under the RAG prompt: a reply whose first-token entropy or margin lies outside
    those (a short-answer prompt's, mostly) states its estimate as an extrapolation, naming the feature."""
    fits = FidelityFits.load(ROOT / "ragkv/engine/measure/fidelity_fits/qwen2.5-coder-1.5b.json")
    f = fits.fits["blend|query"]
    share = sum(f["share_range"]) / 2
    (e0, e1), (m0, m1) = f["entropy_range"], f["margin_range"]
    assert fits.predict("blend", "query", [share, (e0 + e1) / 2, (m0 + m1) / 2])["calibration"] == "fitted"
    high = fits.predict("blend", "query", [share, e1 + 1.0, (m0 + m1) / 2])
    assert high["calibration"] == "extrapolated" and f"first-token entropy {e0:.2f}-{e1:.2f}" in high["source"]
    wide = fits.predict("blend", "query", [share, (e0 + e1) / 2, min(1.0, m1 + 0.2)])
    assert wide["calibration"] == "extrapolated" and "first-token margin" in wide["source"]
    both = fits.predict("blend", "query", [0.05, e1 + 1.0, (m0 + m1) / 2])
    assert "recomputed shares" in both["source"] and "first-token entropy" in both["source"]
