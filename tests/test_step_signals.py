"""Few-tokens-in risk signals (ragkv/eval/step_signals.py): judged on eval records, a signal that separates the
answers that go wrong gets AUC 1 and recovers full's accuracy at the budget that escalates exactly those."""

import json
import math

from ragkv.cli import main
from ragkv.eval.results import ResultsFile
from ragkv.eval.step_signals import accuracy_after, auc, judge, pairs_of, signals


def records(n: int = 10) -> list[dict]:
    """n examples: full always right; the approximate answer is wrong on the first 2, whose second token wavers
    (top-2 close) while their first token is as sure as the others'."""
    out = []
    for i in range(n):
        wrong = i < 2
        second = [math.log(0.5), math.log(0.45)] if wrong else [math.log(0.9), math.log(0.05)]
        out.append({"example_id": str(i), "mode_key": "full", "mode": "full", "scores": {"accuracy": 1.0},
                    "fidelity": {}, "answer_confidence": {"entropy": 0.3, "margin": 0.8}})
        out.append({"example_id": str(i), "mode_key": "blend:sel=query,r=0.15", "mode": "blend",
                    "scores": {"accuracy": 0.0 if wrong else 1.0},
                    "fidelity": {"prefix_agreement": 0.5 if wrong else 1.0, "first_token_kl": 0.1},
                    "answer_confidence": {"entropy": 0.3 + 0.01 * i, "margin": 0.8},
                    "mode_fidelity": {"mode": "blend", "select": "query", "exact": False},
                    "answer_steps": [[math.log(0.9), math.log(0.05)], second, [math.log(0.9), math.log(0.05)]]})
    return out


def test_a_signal_a_few_tokens_in_can_see_what_the_first_token_hides():
    pairs, missing = pairs_of(records(), "blend:sel=query,r=0.15")
    assert len(pairs) == 10 and missing == 0
    res = judge(pairs)
    assert res["loses"] == 2 and res["accuracy_minus_full"] == -0.2
    assert res["signals"]["margin@2"]["auc_loses"] == 1.0 and res["signals"]["margin@4"]["auc_differs"] == 1.0
    assert res["signals"]["first_entropy"]["auc_loses"] == 0.0  # here the first token's entropy points the wrong way
    assert res["signals"]["margin@2"]["after"]["0.2"] == 0.0  # escalating the two riskiest recovers full
    assert signals(pairs[0][0])["margin@2"] > signals(pairs[5][0])["margin@2"]


def test_the_pieces():
    assert auc([1, 2, 3], [False, False, True]) == 1.0 and auc([1, 1], [True, False]) == 0.5
    assert auc([1, 2], [True, True]) is None
    assert accuracy_after([0.9, 0.1], [0.0, 0.0], [1.0, 1.0], 0.5) == 0.5


def test_the_report_flag(tmp_path, capsys):
    recs = records()
    old = {k: v for k, v in recs[3].items() if k != "answer_steps"}  # a record written before answer_steps
    path = tmp_path / "run.jsonl"
    rf = ResultsFile(path, {"model": "m", "dtype": "float32"})
    for r in recs[:3] + [old] + recs[4:]:
        rf.append(r)
    assert main(["report", str(path), "--step-signals", "blend:sel=query,r=0.15", "--fit", str(tmp_path / "none")]) == 0
    out = capsys.readouterr()
    assert "1 blend:sel=query,r=0.15 records have no answer_steps" in out.err
    assert "| margin@2 | 1.00 | 1.00 |" in out.out and "9 answers" in out.out
    assert main(["report", str(path), "--step-signals", "reuse"]) == 2
    assert "no reuse record" in capsys.readouterr().err
    assert main(["report", str(path), "--step-signals", "blend:sel=query,r=0.15", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["n"] == 9
