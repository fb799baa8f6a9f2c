"""Every approximate reply states how close to `full` it is expected to be (engine/measure/estimates.py): a population's
figures, interpolated in the recomputed share, labelled uncalibrated; exact replies say exact. The table is the
committed records' means, re-derived here."""

import collections
import json
from pathlib import Path

import pytest
from tiny import make_segs

from ragkv.engine.measure.estimates import POPULATION, population_estimate
from ragkv.engine.options import FusionOptions
from ragkv.engine.recompute import SELECTIONS

GRID = Path(__file__).resolve().parent.parent / "docs/results/quality_selection"
KEYS = {("reuse", None): ("reuse", 0.0), ("ape", None): ("ape", 0.0), ("blend", "deviation"): ("blend:r=0.15", 0.15),
        ("blend", "query"): ("blend:sel=query,r=0.3", 0.3), ("blend", "sinks"): ("blend:sel=sinks,sink=20", 0.21),
        ("auto", "query"): ("auto:r=0.15", 0.15)}


def test_the_table_is_the_committed_records_means():
    sums = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for path in sorted(GRID.glob("grid-nq10-g*-qwen05.jsonl")):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            fid = r.get("fidelity", {})
            if "mode_key" in r and "first_token_kl" in fid:
                s = sums[r["mode_key"]]
                s[0], s[1], s[2] = s[0] + fid["first_token_kl"], s[1] + fid["top1_agreement"], s[2] + 1
    for (mode, select), (key, r) in KEYS.items():
        kl, top1, n = sums[key]
        point = next(p for p in POPULATION[(mode, select)] if p[0] == r)
        assert n == 170 and point[1] == pytest.approx(kl / n, abs=1e-3)
        assert point[2] == pytest.approx(top1 / n, abs=1e-3)


def test_the_estimate_moves_toward_full_as_more_is_recomputed():
    kls = [population_estimate("blend", "query", r)["expected_kl"] for r in (0.0, 0.1, 0.15, 0.3, 0.6, 1.0)]
    tops = [population_estimate("blend", "query", r)["expected_top1"] for r in (0.0, 0.1, 0.15, 0.3, 0.6, 1.0)]
    assert kls == sorted(kls, reverse=True) and tops == sorted(tops) and kls[-1] == 0.0 and tops[-1] == 1.0
    assert population_estimate("blend", "query", 0.0)["expected_kl"] == population_estimate("reuse")["expected_kl"]
    unknown = population_estimate("blend", "no-such-selection", 0.2)
    assert unknown["expected_kl"] is None and unknown["basis"] == "unmeasured"  # never another's figures


def test_every_approximate_reply_states_an_estimate_and_exact_ones_say_exact(tiny_engine):
    eng = tiny_engine("llama")
    segs = make_segs(blocks=(20, 30, 25))
    runs = [dict(mode="reuse"), dict(mode="ape"), dict(mode="auto", ratio=0.2, max_risk=100.0)]
    runs += [dict(mode="blend", select=s, ratio=0.2, sink_tokens=4 if s == "sinks" else 0) for s in SELECTIONS]
    for kw in runs:
        est = eng.prefill(segs, FusionOptions(**kw))[1].fidelity["estimate"]
        assert est["calibration"] == "none" and est["basis"] == "population" and est["source"], kw
        assert 0 < est["expected_kl"] < 1 and 0 < est["expected_top1"] < 1, (kw, est)
    exact = eng.prefill(segs, FusionOptions(mode="blend", ratio=1.0))[1].fidelity
    assert exact["exact"] and exact["estimate"]["calibration"] == "exact" and exact["estimate"]["expected_kl"] == 0
