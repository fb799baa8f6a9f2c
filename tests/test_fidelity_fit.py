"""The per-reply fidelity estimate (eval/fidelity_fit.py, engine/measure/estimates.py): a fit recovers a known relation
out of sample, beats the population figure where the features carry the signal, and an engine with a fit states it
on every approximate reply (and only there)."""

import json
import math
import random

import pytest

from ragkv.engine.measure.estimates import FidelityFits, fidelity_fit_path, population_estimate
from ragkv.eval import fidelity_fit


def synthetic(n: int, seed: int) -> list[dict]:
    """Records whose top-1 agreement follows a logistic law of the entropy, and whose KL grows with it."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        h = rng.uniform(0.1, 3.0)
        m = rng.uniform(0.0, 1.0)
        p_top1 = 1 / (1 + math.exp(-(3.0 - 2.0 * h)))
        kl = math.exp(-4.0 + 1.2 * h + rng.gauss(0, 0.3))
        out.append({"example_id": str(i), "mode": "reuse", "mode_key": "reuse", "recompute_vs_full": 0.03,
                    "answer_confidence": {"entropy": h, "margin": m},
                    "fidelity": {"first_token_kl": kl, "top1_agreement": float(rng.random() < p_top1)},
                    "mode_fidelity": {"mode": "reuse", "exact": False, "select": None}})
    return out


def test_a_fit_states_calibrated_top1_and_ranks_the_kl_out_of_sample():
    train, test = synthetic(600, 1), synthetic(400, 2)
    judged = fidelity_fit.held_out(train, test)
    fitted, population = judged["pooled"]["fitted"], judged["pooled"]["without"]
    assert judged["pooled"]["n"] == 400
    assert fitted["calibration_error"] < 0.06, fitted  # stated probabilities match the measured agreement
    assert fitted["spearman_kl"] > 0.8  # the entropy carries the KL's order
    assert population["spearman_kl"] is None or abs(population["spearman_kl"]) < 0.2  # one figure ranks nothing
    assert fitted["calibration_error"] < population["calibration_error"]


def test_too_few_records_leave_the_key_to_the_population_and_exact_answers_are_never_fitted():
    rows = synthetic(fidelity_fit.MIN_RECORDS - 1, 3)
    rows.append({**rows[0], "mode_fidelity": {"mode": "full", "exact": True}, "mode": "full"})
    assert fidelity_fit.fit(rows) == {}


def test_an_engine_with_a_fit_states_it_per_reply(tiny_engine, tmp_path):
    from tiny import rand_ids

    from ragkv.engine.options import FusionOptions
    from ragkv.engine.request.segments import Segments

    engine = tiny_engine()
    fits = fidelity_fit.fit(synthetic(300, 4))
    # synthetic features are not the tiny engine's: call every share, entropy and margin fitted
    fits["reuse|"].update(share_range=[0.0, 1.0], entropy_range=[0.0, 100.0], margin_range=[0.0, 1.0])
    doc = fidelity_fit.document("tiny", "float32", "synthetic", fits)
    path = fidelity_fit_path(engine.model_name.replace("/", "_"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    try:
        engine = tiny_engine()  # loads the fit saved for its model
        assert engine.fidelity_fits is not None
        segs = Segments(rand_ids(4, 1), [rand_ids(12, 2), rand_ids(12, 3)], rand_ids(5, 4))
        reuse = engine.prefill(segs, FusionOptions(mode="reuse"))[1].fidelity["estimate"]
        assert reuse["basis"] == "per-reply" and reuse["calibration"] == "fitted"
        assert 0 <= reuse["expected_top1"] <= 1 and reuse["expected_kl"] >= 0
        assert reuse != population_estimate("reuse")
        # a mode the fit does not cover keeps the population statement; an exact one states nothing to fit
        ape = engine.prefill(segs, FusionOptions(mode="ape"))[1].fidelity["estimate"]
        assert ape["basis"] == "population"
        full = engine.prefill(segs, FusionOptions(mode="full"))[1].fidelity
        assert "estimate" not in full or full["estimate"]["basis"] != "per-reply"
    finally:
        path.unlink()


def test_a_damaged_fit_file_is_ignored(tmp_path):
    bad = tmp_path / "fit.json"
    bad.write_text("{not json")
    assert FidelityFits.load(bad) is None
    bad.write_text(json.dumps({"kind": "fidelity-fit", "features": ["other"], "fits": {}}))
    assert FidelityFits.load(bad) is None


@pytest.mark.parametrize("h,expect_high", [(0.2, True), (2.9, False)])
def test_the_fitted_probability_follows_the_entropy(h, expect_high):
    fits = FidelityFits(fidelity_fit.fit(synthetic(600, 5)), "synthetic")
    est = fits.predict("reuse", None, [0.03, h, 0.5])
    assert (est["expected_top1"] > 0.8) == expect_high


def _on_w8a8(records: list[dict], shift: float) -> list[dict]:
    """The same records as replies on w8a8 weights, judged against the exact weights' `full`: a larger KL."""
    return [{**r, "fidelity": {**r["fidelity"], "first_token_kl": r["fidelity"]["first_token_kl"] + shift},
             "mode_fidelity": {**r["mode_fidelity"], "decode_weights": "w8a8"}} for r in records]


def test_w8a8_replies_are_fitted_apart_and_state_the_weights_error_without_a_fit(tiny_engine, tmp_path):
    """A reply on w8a8 weights is judged against the exact weights' `full`: its fit is keyed apart (`reuse||w8a8`)
    from the exact weights' (`reuse|`), and where no fit covers it the population figures of the mode and of the
    weights are composed and labelled so; w8a8's `full` states the weights' own figure."""
    from tiny import rand_ids

    from ragkv.engine.measure.estimates import WEIGHTS_POPULATION, with_weights
    from ragkv.engine.options import FusionOptions
    from ragkv.engine.request.segments import Segments

    fits = fidelity_fit.fit(synthetic(300, 4) + _on_w8a8(synthetic(300, 5), 0.5))
    assert set(fits) == {"reuse|", "reuse||w8a8"}
    exact = tiny_engine("qwen2")
    path = fidelity_fit_path(exact.model_name.replace("/", "_"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(fidelity_fit.document("tiny", "float32", "synthetic", fits)))
    try:
        exact = tiny_engine("qwen2")
        fast = type(exact)(exact._loaded, exact.store, decode_weights="w8a8")
        segs = Segments(rand_ids(4, 1), [rand_ids(12, 2), rand_ids(12, 3)], rand_ids(5, 4))
        for engine, weights in ((fast, "w8a8"), (exact, None)):
            state, stats = engine.prefill(segs, FusionOptions(mode="reuse"))
            share = stats.recomputed_token_layers / stats.full_token_layers
            want = FidelityFits(fits, "synthetic").from_logits("reuse", None, share, state.logits, weights)
            assert stats.fidelity["estimate"]["basis"] == "per-reply"
            assert stats.fidelity["estimate"]["expected_kl"] == want["expected_kl"]
        assert fits["reuse||w8a8"]["log_kl"] != fits["reuse|"]["log_kl"]
        kl_w, top1_w, _ = WEIGHTS_POPULATION["w8a8"]
        full = fast.prefill(segs, FusionOptions(mode="full"))[1].fidelity
        assert full["exact"] is False and full["estimate"]["basis"] == "population"
        assert (full["estimate"]["expected_kl"], full["estimate"]["expected_top1"]) == (kl_w, top1_w)
        ape = fast.prefill(segs, FusionOptions(mode="ape"))[1].fidelity["estimate"]
        pop = population_estimate("ape")
        assert ape["basis"] == "population, composed"
        assert ape["expected_kl"] == pytest.approx(pop["expected_kl"] + kl_w, abs=1e-4)
        assert ape["expected_top1"] == pytest.approx(pop["expected_top1"] * top1_w, abs=1e-4)
        assert with_weights(pop, "int9")["basis"] == "unmeasured"  # weights never measured are not guessed
        # a fit of the exact weights only: w8a8's reply composes that per-reply estimate with the weights' figures
        path.write_text(json.dumps(fidelity_fit.document("tiny", "float32", "synthetic", {"reuse|": fits["reuse|"]})))
        exact = tiny_engine("qwen2")
        fast = type(exact)(exact._loaded, exact.store, decode_weights="w8a8")
        state, stats = fast.prefill(segs, FusionOptions(mode="reuse"))
        mine = stats.fidelity["estimate"]
        share = stats.recomputed_token_layers / stats.full_token_layers
        theirs = FidelityFits(fits, "synthetic").from_logits("reuse", None, share, state.logits)  # its own features
        assert mine["basis"] == "per-reply, composed" and mine["calibration"] == "none"
        assert mine["expected_kl"] == pytest.approx(theirs["expected_kl"] + kl_w, abs=2e-4)
        assert mine["expected_top1"] == pytest.approx(theirs["expected_top1"] * top1_w, abs=2e-4)
    finally:
        path.unlink()


def test_a_fit_of_some_keys_keeps_the_others_of_the_fit_it_replaces(tmp_path, capsys):
    """`calibrate --target fidelity` on w8a8 records saved over a fit of the exact weights keeps the exact keys (and
    says so): a user's w8a8 fit must not drop the shipped ones."""
    from ragkv.cli import main
    from ragkv.eval.results import ResultsFile

    save_to = tmp_path / "fit.json"
    save_to.write_text(json.dumps(fidelity_fit.document("m", "bfloat16", "the exact weights' fit", fidelity_fit.fit(
        synthetic(100, 6)))))
    records = tmp_path / "w8a8.jsonl"
    rf = ResultsFile(records, {"model": "m", "dtype": "bfloat16", "decode_weights": "w8a8"})
    for r in _on_w8a8(synthetic(100, 7), 0.2):
        rf.append(r)
    assert main(["calibrate", "--target", "fidelity", "--records", str(records), "--save-to", str(save_to),
                 "--output-dir", str(tmp_path / "out")]) == 0
    assert "kept the earlier fits of reuse|" in capsys.readouterr().err
    doc = json.loads(save_to.read_text())
    assert set(doc["fits"]) == {"reuse|", "reuse||w8a8"}
    assert doc["fits"]["reuse|"]["source"] == "the exact weights' fit"
    assert "w8a8.jsonl" in doc["fits"]["reuse||w8a8"]["source"]
    # --keys saves only the named fits, and names what the records fit when a key is not among them
    args = ["calibrate", "--target", "fidelity", "--records", str(records), "--save-to", str(tmp_path / "only.json"),
            "--output-dir", str(tmp_path / "out")]
    assert main(args + ["--keys", "full||w8a8"]) == 2
    assert "not fitted from these records (fitted: reuse||w8a8)" in capsys.readouterr().err
    assert main(args + ["--keys", "reuse||w8a8"]) == 0
    assert set(json.loads((tmp_path / "only.json").read_text())["fits"]) == {"reuse||w8a8"}


def test_a_w8a8_fit_is_judged_against_what_its_replies_state_without_it():
    """The held-out table's comparison for w8a8's replies is what they state without their own fit: the exact
    weights' fit (the one saved before) composed with w8a8's figures; `full`'s is w8a8's own figure."""
    from ragkv.engine.measure.estimates import with_weights

    base = FidelityFits(fidelity_fit.fit(synthetic(200, 8)), "exact weights")
    r = _on_w8a8(synthetic(1, 9), 0.1)[0]
    x = fidelity_fit.features(r)[1:]
    assert fidelity_fit.without_fit(r, base) == with_weights(base.predict("reuse", None, x), "w8a8")
    assert fidelity_fit.without_fit(r, None) == with_weights(population_estimate("reuse"), "w8a8")
    full = {**r, "mode": "full", "mode_fidelity": {"mode": "full", "exact": False, "decode_weights": "w8a8"}}
    assert fidelity_fit.without_fit(full, base) == with_weights(None, "w8a8")
    exact = synthetic(1, 9)[0]
    assert fidelity_fit.without_fit(exact, base) == population_estimate("reuse")
