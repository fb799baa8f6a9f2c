"""`ragkv report --paired` (ragkv/bench/paired.py): paired differences on the questions every key answered, checked
against hand-computed values on small synthetic results files."""

import pytest

from ragkv.bench.paired import paired_report
from ragkv.cli import main
from ragkv.eval.results import ResultsFile

Q, QD = "blend:sel=query,r=0.15", "blend:sel=query,r=0.15,draft=16"


def _run(path, model, acc: dict[str, list[int]], kl: float = 0.1):
    """One results file: acc[key][i] is question i's accuracy under key (None: the key did not answer it)."""
    f = ResultsFile(path, {"dataset": "nq-distractors", "model": model, "dtype": "float32"})
    for key, xs in acc.items():
        for i, x in enumerate(xs):
            if x is not None:
                f.append({"example_id": str(i), "mode_key": key, "scores": {"accuracy": float(x)},
                          "fidelity": {"first_token_kl": 0.0 if key == "full" else kl}})
    return path


def test_one_run_gaps_to_full_and_to_the_key_a_draft_extends(tmp_path):
    # question 3 lacks the draft's record: it is left out of every comparison
    path = _run(tmp_path / "a.jsonl", "m", {"full": [1, 1, 0, 1], Q: [0, 1, 0, 1], QD: [1, 1, 1, None]})
    out = paired_report([path], [Q, QD])
    assert out["n"] == 3
    rows = {r["key"]: r for r in out["rows"]}
    assert rows["full"]["value"] == pytest.approx(2 / 3)
    assert rows[Q]["minus_full"]["mean"] == pytest.approx(-1 / 3)
    assert rows[QD]["minus_full"]["mean"] == pytest.approx(1 / 3)
    assert rows[QD]["base"] == Q and rows[QD]["minus_base"]["mean"] == pytest.approx(2 / 3)
    lo, hi = rows[QD]["minus_base"]["ci"]
    assert 0 <= lo <= 2 / 3 <= hi <= 1  # every per-question difference is 0 or +1
    assert "base" not in rows[Q]
    assert "+66.7" in out["markdown"]


def test_two_runs_the_same_key_and_the_gaps_compared(tmp_path):
    a = _run(tmp_path / "small.jsonl", "small", {"full": [1, 1, 1, 0], "reuse": [0, 0, 1, 0]}, kl=0.4)
    b = _run(tmp_path / "large.jsonl", "large", {"full": [1, 1, 0, 1], "reuse": [1, 1, 0, None]}, kl=0.2)
    out = paired_report([a, b], ["reuse"])
    assert out["n"] == 3 and len(out["runs"]) == 2
    reuse = next(r for r in out["rows"] if r["key"] == "reuse")
    assert reuse["value_a"] == pytest.approx(1 / 3) and reuse["value_b"] == pytest.approx(2 / 3)
    assert reuse["b_minus_a"]["mean"] == pytest.approx(1 / 3)
    assert reuse["minus_full_a"]["mean"] == pytest.approx(-2 / 3)
    assert reuse["minus_full_b"]["mean"] == pytest.approx(0.0)
    assert reuse["gap_b_minus_gap_a"]["mean"] == pytest.approx(2 / 3)
    assert (reuse["kl_a"], reuse["kl_b"]) == (pytest.approx(0.4), pytest.approx(0.2))
    # `full` alone (e.g. an exact run against a w8a8 one): its row once, the second run's minus the first's
    out = paired_report([a, b], ["full"])
    assert [r["key"] for r in out["rows"]] == ["full"]


def test_paired_refuses_what_it_cannot_pair(tmp_path, capsys):
    a = _run(tmp_path / "a.jsonl", "a", {"full": [1], "reuse": [1]})
    with pytest.raises(ValueError, match="ape"):
        paired_report([a], ["ape"])
    runs = [_run(tmp_path / f"{m}.jsonl", m, {"full": [1], "reuse": [0]}) for m in "xyz"]
    with pytest.raises(ValueError, match="one run or two"):
        paired_report(runs)
    assert main(["report", "--paired", str(a), "--modes", "ape"]) == 2
    assert "no records of ape" in capsys.readouterr().err
    assert main(["report", "--paired", str(a)]) == 0
    assert "| reuse | 1.000 | +0.0" in capsys.readouterr().out
