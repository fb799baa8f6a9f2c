"""`auto` replayed from an evaluation's records (ragkv.eval.auto_replay) against `auto`'s own answers."""

import json
from pathlib import Path

import pytest

from ragkv.engine.measure.estimates import FidelityFits
from ragkv.eval.auto_replay import replay_agrees, replay_auto

RUN = Path(__file__).parent.parent / "docs" / "results" / "fidelity" / "auto-qwen05"
FIT = Path(__file__).parent.parent / "ragkv" / "engine" / "measure" / "fidelity_fits" / "qwen2.5-coder-0.5b.json"


def _records(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if "mode_key" in r]


def test_the_replay_gives_autos_own_answers_on_session_36s_run():
    """Qwen 0.5B, 60 pairs run with auto, full and query-aware r = 0.15 side by side: the replay from the last two
    escalates the same 7 and answers every question with auto's own tokens."""
    fits = FidelityFits.load(FIT)
    files = sorted(RUN.glob("*.jsonl"))
    assert len(files) == 6 and fits is not None
    agree = total = escalated = 0
    for f in files:
        recs = _records(f)
        a, n = replay_agrees(recs, fits, 0.1526, 0.2)
        agree, total = agree + a, total + n
        escalated += sum(r["escalated"] for r in replay_auto(recs, fits, 0.1526, 0.2))
    assert (agree, total, escalated) == (60, 60, 7)


def test_the_replay_escalates_within_its_budget_and_adds_fulls_work():
    """Every reply over the threshold: the budget's window lets through one escalation whenever the share of recent
    ones is under it; an escalated answer is full's, at the r reply's work plus full's."""
    fits = FidelityFits({"blend|query": {"top1": [0, 0, 0, 0], "log_kl": [0, 0, 0, 0], "smear": 1.0,
                                         "kl_floor": 0.0}}, "test")  # expected KL 1.0 for every reply
    recs = []
    for i in range(10):
        conf = {"entropy": 1.0, "margin": 0.1}
        recs += [{"example_id": str(i), "mode_key": "full", "token_ids": [1], "recompute_vs_full": 1.0},
                 {"example_id": str(i), "mode_key": "blend:sel=query,r=0.15", "token_ids": [2],
                  "recompute_vs_full": 0.2, "answer_confidence": conf}]
    out = replay_auto(recs, fits, max_risk=0.5, budget=0.3)
    assert [r["escalated"] for r in out] == [True, False, False, False, True, False, False, True, False, False]
    assert all(r["token_ids"] == ([1] if r["escalated"] else [2]) for r in out)
    assert all(r["recompute_vs_full"] == (1.2 if r["escalated"] else 0.2) for r in out)
    assert replay_auto(recs, fits, max_risk=2.0, budget=1.0) and \
        not any(r["escalated"] for r in replay_auto(recs, fits, max_risk=2.0, budget=1.0))
    with pytest.raises(ValueError, match="no key"):
        replay_auto(recs, FidelityFits({}, "empty"), 0.5, 0.3)


def test_report_replays_auto_beside_full_and_its_base(tmp_path, capsys):
    """`ragkv report --replay-auto RISK,BUDGET`: each file written again with the replayed records (auto's own at
    those settings give way to them), and the quality-vs-work table of full, r = 0.15 and the replay; a malformed
    spec is a clear error."""
    from ragkv.cli.main import main

    files = [str(p) for p in sorted(RUN.glob("*.jsonl"))]
    assert main(["report", "--replay-auto", "0.1526,0.2", "--fit", str(FIT), "--output-dir", str(tmp_path),
                 *files]) == 0
    out = capsys.readouterr().out
    assert "auto:r=0.15,sig=expected_kl,risk=0.1526,budget=0.2 | 0.323 | 0.400" in out
    written = _records(tmp_path / "replayed-auto-qwen05-g0.s1.jsonl")
    autos = [r for r in written if r["mode_key"].startswith("auto")]
    assert len(autos) == 10 and all(r.get("replayed") for r in autos)
    assert main(["report", "--replay-auto", "high", "--output-dir", str(tmp_path), *files]) != 0


def test_the_replay_refuses_records_without_the_fits_features():
    recs = [{"example_id": "0", "mode_key": "full", "token_ids": [1], "recompute_vs_full": 1.0},
            {"example_id": "0", "mode_key": "blend:sel=query,r=0.15", "token_ids": [2], "recompute_vs_full": 0.2}]
    with pytest.raises(ValueError, match="answer_confidence"):
        replay_auto(recs, FidelityFits.load(FIT), 0.1, 0.2)
