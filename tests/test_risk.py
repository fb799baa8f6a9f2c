"""The risk signals `auto` escalates on and their calibration on held-out records (ragkv/engine/measure/risk.py,
ragkv/eval/risk.py)."""

import math

import pytest
import torch

from ragkv.engine.measure.risk import SIGNALS, measure
from ragkv.eval.risk import calibrate_auto, choose_threshold, spearman


def test_spearman_matches_hand_computed_ranks_with_ties():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ranks x: 0, 1.5, 1.5, 3; y: 0, 1, 2, 3 -> Pearson of the ranks
    rx, ry = [0, 1.5, 1.5, 3], [0, 1, 2, 3]
    mx, my = sum(rx) / 4, sum(ry) / 4
    want = sum((a - mx) * (b - my) for a, b in zip(rx, ry)) / math.sqrt(
        sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    assert spearman([1, 2, 2, 3], [5, 6, 7, 8]) == pytest.approx(want)
    assert spearman([1, 1, 1], [1, 2, 3]) is None


def test_threshold_escalates_the_riskiest_until_the_kl_target_or_the_work_budget():
    risks, kls = [0.9, 0.1, 0.5, 0.2], [0.4, 0.0, 0.2, 0.0]
    t = choose_threshold(risks, kls, target_kl=0.04, max_escalation=1.0)
    assert t["threshold"] == pytest.approx(0.35) and t["escalation_rate"] == 0.5 and t["mean_kl_after"] == 0
    assert t["target_met"] and t["mean_kl_random_escalation"] == pytest.approx(0.5 * 0.15)
    capped = choose_threshold(risks, kls, target_kl=0.0, max_escalation=0.25)
    assert capped["escalation_rate"] == 0.25 and capped["mean_kl_after"] == pytest.approx(0.05)
    assert not capped["target_met"]
    none = choose_threshold(risks, kls, target_kl=1.0, max_escalation=1.0)
    assert none["escalation_rate"] == 0 and none["threshold"] == 0.9


def test_measure_gives_every_signal_and_the_shift_is_zero_for_an_unmoved_answer():
    logits = torch.tensor([2.0, 1.0, 0.0])
    m = measure(logits, logits, 0.25)
    assert set(m) == set(SIGNALS) and m["shift"] == 0
    assert m["margin"] == pytest.approx(1 - (logits.softmax(0)[0] - logits.softmax(0)[1]).item(), abs=1e-6)
    assert m["uncovered"] == 0.25
    flat = measure(torch.zeros(3), logits, None)
    assert flat["entropy"] == pytest.approx(math.log(3), abs=1e-6) and flat["margin"] == pytest.approx(1.0)
    assert flat["shift"] > 0


def test_calibration_picks_the_signal_that_ranks_the_distance_to_full():
    recs = []
    for i, kl in enumerate([0.0, 0.1, 0.3, 0.6, 0.02]):
        risk = {"shift": 0.5 - kl, "entropy": kl * 2, "margin": 0.3, "uncovered": None}  # entropy ranks KL best
        recs.append({"mode_key": "q", "stats_extra": {"risk": risk}, "recompute_vs_full": 0.2,
                     "fidelity": {"first_token_kl": kl, "top1_agreement": 1.0 if kl < 0.5 else 0.0}})
    cal = calibrate_auto(recs + [{"mode_key": "full"}], "q", target_kl=0.05, max_escalation=0.5)
    assert cal["signal"] == "entropy" and cal["spearman"]["entropy"]["kl"] == pytest.approx(1.0)
    assert cal["escalation_rate"] == 0.4 and cal["target_met"] and cal["n"] == 5
    assert cal["mean_recompute_vs_full"] == pytest.approx(0.6)
    with pytest.raises(ValueError, match="at least 3 records"):
        calibrate_auto(recs[:2], "q", 0.05, 0.5)
