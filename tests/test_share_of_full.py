"""`ragkv report --share-of-full`: shares of full's score per data set and pooled, their paired bootstrap, the
papers' bar, and the suite's CLI checks (ragkv/bench/share_of_full.py, ragkv/eval/suite.py)."""

from __future__ import annotations

import pytest

from ragkv.bench.share_of_full import meets, share_of_full
from ragkv.errors import RagkvError
from ragkv.eval.results import ResultsFile
from ragkv.eval.suite import PAPERS, get_suite


def _write(path, dataset, metric, scores: dict[str, list[float]], work: dict[str, float]):
    f = ResultsFile(path, {"model": "m", "dtype": "float32", "dataset": dataset})
    for key, xs in scores.items():
        for i, x in enumerate(xs):
            f.append({"example_id": str(i), "mode_key": key, "metric": metric, "scores": {metric: x, "other": 9.0},
                      "recompute_vs_full": work[key], "fidelity": {"first_token_kl": work[key] * i}})


def test_shares_per_set_and_pooled_with_intervals(tmp_path):
    # set a: blend scores 90% of full's; set b: 100%; pooled = mean of the sets' shares = 95%
    _write(tmp_path / "a.jsonl", "a", "f1", {"full": [1.0, 0.5, 0.5, 1.0], "blend": [0.9, 0.45, 0.45, 0.9],
                                             "reuse": [0.0, 0.0, 0.5, 0.5]}, {"full": 1.0, "blend": 0.18, "reuse": 0.01})
    _write(tmp_path / "b.jsonl", "b", "rouge_l", {"full": [0.2, 0.4], "blend": [0.2, 0.4], "reuse": [0.1, 0.1]},
           {"full": 1.0, "blend": 0.2, "reuse": 0.01})
    out = share_of_full([tmp_path / "a.jsonl", tmp_path / "b.jsonl"], tmp_path / "p.png")
    rows = out["models"]["m float32"]
    blend = rows["blend"]
    assert blend["sets"]["a"]["share"] == pytest.approx(0.9) and blend["sets"]["b"]["share"] == pytest.approx(1.0)
    assert blend["sets"]["a"]["metric"] == "f1" and blend["sets"]["b"]["metric"] == "rouge_l"
    assert blend["pooled"]["share"] == pytest.approx(0.95) and blend["work"] == pytest.approx(0.19)
    # every resample keeps blend at exactly 90% of full on a (paired), so its interval is a point
    assert blend["sets"]["a"]["ci"] == [pytest.approx(0.9), pytest.approx(0.9)]
    lo, hi = rows["reuse"]["sets"]["a"]["ci"]  # reuse's share varies with the questions drawn
    assert rows["reuse"]["sets"]["a"]["share"] == pytest.approx(1 / 3, abs=1e-4) and lo < 1 / 3 < hi
    assert not meets(blend)  # 95% pooled: below the 98% bar
    assert (tmp_path / "p.png").stat().st_size > 0 and "| blend | 19.0% |" in out["markdown"]
    # first-token KL: each set's mean (a: 0.18 x mean(0..3) = 0.27; b: 0.2 x 0.5 = 0.1), the sets weighing alike
    assert blend["kl"] == pytest.approx((0.27 + 0.1) / 2, abs=1e-4) and "| 0.185 |" in out["markdown"]


def test_the_bar_needs_the_pooled_share_every_set_and_the_work():
    ok = {"work": 0.2, "pooled": {"share": 0.985}, "sets": {"a": {"share": 0.96, "n": 60}, "b": {"share": 1.01, "n": 80}}}
    assert meets(ok)
    assert not meets({**ok, "work": 0.21})
    assert not meets({**ok, "sets": {"a": {"share": 0.94, "n": 60}, "b": {"share": 1.03, "n": 60}}})
    few = {**ok, "sets": {"a": {"share": 0.96, "n": 12}, "b": {"share": 1.01, "n": 80}}}
    assert not meets(few) and meets(few, min_n=0)  # 12 questions cannot claim the bar


def test_the_table_says_whether_the_interval_clears_the_bar_or_only_the_point():
    from ragkv.bench.share_of_full import _verdict

    row = {"work": 0.2, "sets": {"a": {"share": 0.99, "n": 60}}}
    assert _verdict({**row, "pooled": {"share": 0.99, "ci": [0.985, 1.0]}}) == "yes, interval above 98%"
    assert _verdict({**row, "pooled": {"share": 0.986, "ci": [0.818, 1.16]}}) == "point only (interval from 82%)"
    assert _verdict({**row, "pooled": {"share": 0.9, "ci": [0.8, 1.0]}}) == "no"


def test_no_full_records_is_an_error(tmp_path):
    _write(tmp_path / "a.jsonl", "a", "f1", {"blend": [1.0]}, {"blend": 0.2})
    with pytest.raises(ValueError, match="no `full` records"):
        share_of_full([tmp_path / "a.jsonl"])


def test_the_papers_suite_runs_full_first_and_each_selection_at_both_ratios():
    keys = PAPERS.modes.split(",")
    assert keys[0] == "full" and "reuse" in keys
    assert get_suite("papers") is PAPERS and PAPERS.limit == 60
    with pytest.raises(RagkvError):
        get_suite("nope")


def test_the_suite_refuses_its_own_data_flags(capsys):
    from ragkv.cli.main import main

    assert main(["eval", "--suite", "papers", "--dataset", "musique"]) == 2
    assert "--suite names its own data sets" in capsys.readouterr().err


def test_a_suite_set_is_read_by_the_metric_the_papers_print(tmp_path):
    """HotpotQA's records name accuracy; the papers' table prints F1 for it (the suite's `metrics`)."""
    f = ResultsFile(tmp_path / "h.jsonl", {"model": "m", "dtype": "float32", "dataset": "hotpotqa"})
    for key, acc, f1 in (("full", 1.0, 0.8), ("blend", 1.0, 0.4)):
        f.append({"example_id": "0", "mode_key": key, "metric": "accuracy", "scores": {"accuracy": acc, "f1": f1},
                  "recompute_vs_full": 0.2})
    papers = share_of_full([tmp_path / "h.jsonl"])["models"]["m float32"]["blend"]["sets"]["hotpotqa"]
    own = share_of_full([tmp_path / "h.jsonl"], metrics={})["models"]["m float32"]["blend"]["sets"]["hotpotqa"]
    assert (papers["metric"], papers["share"]) == ("f1", 0.5) and (own["metric"], own["share"]) == ("accuracy", 1.0)
