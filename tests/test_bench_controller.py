"""The pure parts of `ragkv bench controller`: the verdict, the spread placement, the KL, the throttled tier."""

import time

import pytest
import torch

from ragkv.bench.controller import ThrottledStore, first_token_kl, spread_placement, verdict
from ragkv.store.base import BlockKV, CacheKey
from ragkv.store.memory import MemoryStore


def row(name, kind, ttft, kl):
    return {"name": name, "kind": kind, "ttft_ms": ttft, "kl": kl}


def test_verdict_compares_with_the_fastest_fixed_choice_at_equal_or_better_kl():
    rows = [row("full", "full", 1000, 0.0), row("controller", "controller", 105, 0.02),
            row("memory r=0.05", "fixed", 50, 0.08),    # faster but less faithful: not a rival
            row("memory r=0.15", "fixed", 100, 0.02),   # equal KL: the one to beat
            row("memory r=0.3", "fixed", 150, 0.01),
            row("spread r=0.15", "spread", 90, 0.02)]   # not a fixed (r, tier) choice
    v = verdict(rows)
    assert v["best_fixed"] == "memory r=0.15" and v["ttft_ratio"] == pytest.approx(1.05)
    assert v["meets"] is True and "MEETS" in v["text"]
    assert v["fastest_fixed"] == "memory r=0.05"
    assert verdict(rows, target=1.04)["meets"] is False
    assert v["dominated_by"] == []


def test_verdict_names_faster_and_more_faithful_choices():
    rows = [row("controller", "controller", 150, 0.02), row("a r=0.15", "fixed", 148, 0.02),
            row("a r=0.3", "fixed", 149, 0.015), row("b r=0.5", "fixed", 200, 0.01)]
    v = verdict(rows)
    assert v["meets"] is True and v["dominated_by"] == ["a r=0.3"] and "better KL" in v["text"]


def test_verdict_counts_kl_within_the_tolerance_as_equal():
    rows = [row("controller", "controller", 120, 0.0200), row("a", "fixed", 100, 0.0201),
            row("b", "fixed", 200, 0.01)]
    assert verdict(rows)["best_fixed"] == "a"                      # 0.5% worse KL: equal
    assert verdict(rows, kl_rel_tol=0.0)["best_fixed"] == "b"      # strictly: only b is as faithful
    assert verdict(rows)["meets"] is False and "MISSES" in verdict(rows)["text"]


def test_verdict_without_a_fixed_choice_as_faithful():
    rows = [row("controller", "controller", 300, 0.001), row("a", "fixed", 100, 0.05)]
    v = verdict(rows)
    assert v["meets"] is None and v["best_fixed"] is None and v["ttft_ratio"] is None
    assert "no fixed choice" in v["text"]


def test_verdict_wants_one_controller_and_a_fixed_row():
    with pytest.raises(ValueError):
        verdict([row("a", "fixed", 1, 0.1)])
    with pytest.raises(ValueError):
        verdict([row("c", "controller", 1, 0.1)])


def test_spread_placement_uses_every_tier_and_gives_the_controller_a_choice():
    p = spread_placement(6)
    assert p[0] == ("memory",) and {t for h in p for t in h} == {"memory", "disk", "redis", "throttled"}
    assert ("disk", "throttled") in p                        # two holders: the controller picks disk
    assert sum(h == ("throttled",) for h in p) == 3
    assert all("redis" not in h for h in spread_placement(6, ("memory", "disk", "throttled")))


def test_first_token_kl():
    a = torch.tensor([2.0, 1.0, 0.0])
    assert first_token_kl(a, a) == 0.0
    b = torch.tensor([0.0, 1.0, 2.0])
    p, q = torch.softmax(a, -1), torch.softmax(b, -1)
    assert first_token_kl(a, b) == pytest.approx(float((p * (p / q).log()).sum()), rel=1e-5)


def test_throttled_store_delays_every_layer_read_and_keeps_the_data():
    kv = BlockKV(torch.randn(3, 2, 5, 4), torch.randn(3, 2, 5, 4))
    key = CacheKey("fp", "none", "h", 5, "ns")
    t = ThrottledStore(MemoryStore(), delay_s=0.02)
    t.put(key, kv)
    assert t.contains(key) and "20ms/layer" in t.describe()
    reader = t.open_layers(key)
    assert not reader.instant
    t0 = time.perf_counter()
    for i in range(3):
        k, v = reader.read(i)
        assert torch.equal(k, kv.keys[i]) and torch.equal(v, kv.values[i])
    assert time.perf_counter() - t0 >= 0.06 and t.reads == 3
    bw = ThrottledStore(MemoryStore(), bytes_per_s=1e6)
    assert bw.wait_s(500_000) == pytest.approx(0.5)
    assert t.open_layers(CacheKey("fp", "none", "other", 5, "ns")) is None
    with pytest.raises(ValueError):
        ThrottledStore(MemoryStore(), delay_s=-1)
