import json

import pytest
import torch

from ragkv.engine.blocks.loading import (
    StoreProfiles,
    choose_ratio,
    hidden_ratio,
    load_seconds,
    recompute_seconds,
    schedule_loads,
)
from ragkv.store.disk import DiskStore
from ragkv.store.memory import MemoryStore
from ragkv.store.probe import measure_tier

MB = 1e6


def test_cost_model():
    assert load_seconds(2 * MB, 1000 * MB) == pytest.approx(2e-3)
    assert recompute_seconds(0.15, 1000, 1e-5) == pytest.approx(1.5e-3)
    assert hidden_ratio(1.5e-3, 1000, 1e-5) == pytest.approx(0.15)
    assert hidden_ratio(1.0, 1000, 1e-5) == 1.0 and hidden_ratio(0.0, 1000, 1e-5) == 0.0
    assert hidden_ratio(1e-3, 0, 1e-5) == 1.0           # nothing to recompute: any ratio is free


def test_ratio_is_max_of_r_min_and_what_loading_hides():
    """CacheBlend sec. 5.1: r = max(r_min, r whose recompute time equals the load time)."""
    assert choose_ratio(1e-3, 1000, 1e-5, r_min=0.15) == 0.15     # loading hides only r = 0.1
    assert choose_ratio(3e-3, 1000, 1e-5, r_min=0.15) == pytest.approx(0.3)
    assert choose_ratio(1.0, 1000, 1e-5, r_min=0.15) == 1.0
    with pytest.raises(ValueError):
        choose_ratio(1e-3, 1000, 1e-5, r_min=1.5)


def test_measure_and_cache_bandwidth(tmp_path, monkeypatch):
    tiers = [MemoryStore(8 << 20), DiskStore(tmp_path / "kv", 64 << 20)]
    bw = measure_tier(tiers[1], nbytes=1 << 20).bytes_per_s
    assert bw > 0 and tiers[1].stats()["entries"] == 0             # the probe entry is gone again
    path = tmp_path / "profile.json"
    first = StoreProfiles.load(path).measure_tiers(tiers)
    assert [p.name for p in first] == ["memory", "disk"] and all(p.bytes_per_s > 0 for p in first)
    saved = json.loads(path.read_text())
    assert set(saved) == {"memory", f"disk:{tmp_path / 'kv'}"}
    monkeypatch.setattr("ragkv.engine.blocks.loading.measure_tier", lambda *a, **k: pytest.fail("re-measured"))
    assert StoreProfiles.load(path).measure_tiers(tiers) == first  # profiled once, then read from the file


@pytest.mark.parametrize("delay_ms,mbps", [(5.0, None), (0.0, 50.0)])
def test_profile_separates_per_read_latency_from_bandwidth(delay_ms, mbps):
    """A tier whose every layer read waits a fixed delay (a remote round trip) is priced by that latency, not by
    a bandwidth that one big probe would mistake it for (the bench controller's finding)."""
    from ragkv.bench.controller import ThrottledStore

    tier = ThrottledStore(MemoryStore(), delay_ms / 1e3, mbps * 1e6 if mbps else None)
    p = measure_tier(tier, nbytes=4 << 20, repeats=2)
    if delay_ms:
        assert delay_ms / 1e3 <= p.latency_s < 3 * delay_ms / 1e3 and p.bytes_per_s > 1e9
    else:
        assert p.latency_s < 2e-3 and 0.5 * mbps * 1e6 < p.bytes_per_s <= 1.05 * mbps * 1e6


def test_load_schedule_pays_latency_per_read():
    """Per block and layer, T_load = latency + bytes / bandwidth: a small block is read sooner from the
    low-latency tier, a big one from the high-bandwidth tier, and each read's latency adds up."""
    holders = {"near": (10 * MB, 0.0), "far": (1000 * MB, 2e-3)}
    plan = schedule_loads([(10, 0.001 * MB, holders), (5000, 100 * MB, holders)], 1e-6, r_min=0.15)
    assert plan.tiers == ("near", "far")
    assert plan.load_ms_per_layer == pytest.approx(0.1 + 2.0 + 100.0)
    assert load_seconds(1 * MB, 100 * MB, 0.004) == pytest.approx(0.014)


def test_unreadable_profile_file_is_measured_again(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text("{not json")
    profiles = StoreProfiles.load(path).measure_tiers([MemoryStore(4 << 20)])
    assert profiles[0].bytes_per_s > 0 and "memory" in json.loads(path.read_text())


def test_default_profile_location_is_under_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("RAGKV_CACHE_DIR", str(tmp_path))
    StoreProfiles.load().measure_tiers([MemoryStore(4 << 20)])
    assert (tmp_path / "store_bandwidth.json").exists()


def test_engine_reads_each_block_from_the_tier_its_schedule_names(tiny_engine, tmp_path):
    """A block may be in several tiers; the load schedule names the one it is read from, and the engine
    obeys."""
    from tiny import make_segs

    from ragkv.engine.options import FusionOptions
    from ragkv.store.spec import open_store

    store = open_store(f"memory:64MiB,disk:{tmp_path}:1GiB")
    engine = tiny_engine(store=store)
    segs = make_segs(prefix=0, blocks=(20, 30))
    engine.warm(segs)  # both blocks in memory and on disk
    keys = engine.cache_keys(segs, FusionOptions(mode="blend"))
    store.tiers[0].delete(keys[0])  # the first block now only on disk
    engine.profile_store()
    before = dict(store.counters["hits"])
    _, stats = engine.prefill(segs, FusionOptions(mode="blend"))
    plan = stats.extra["loading_plan"]
    mem, disk = (t.describe() for t in store.tiers)
    assert list(plan["tiers"]) == [disk, mem] and 0.15 <= plan["ratio"] <= 1
    read = {t: n - before[t] for t, n in store.counters["hits"].items()}
    assert read == {mem: 1, disk: 1} and stats.cache_misses == 0


def test_a_block_lost_while_read_by_its_loading_plan_is_recomputed(tiny_engine, tmp_path, monkeypatch):
    """The soak's 500: a block vanished while a planned blend request read it; the request is computed again in
    its own memory, where the plan's tiers name nothing (it passed them to a store without tiers)."""
    from tiny import make_segs

    from ragkv.engine.options import FusionOptions
    from ragkv.store.errors import MissingBlockError
    from ragkv.store.memory import MemoryStore
    from ragkv.store.spec import open_store
    from ragkv.store.tiered import TieredStore

    store = open_store(f"memory:64MiB,disk:{tmp_path}:1GiB")
    engine = tiny_engine(store=store)
    segs = make_segs(prefix=0, blocks=(20, 30))
    engine.warm(segs)
    engine.profile_store()
    planned = TieredStore.iter_layers

    def vanish_once(self, keys, num_layers, *args, tiers=None, **kwargs):
        if tiers is not None and not getattr(vanish_once, "done", False):
            vanish_once.done = True
            raise MissingBlockError(f"block {keys[0].digest()} vanished from the store while its layers were read")
        return planned(self, keys, num_layers, *args, tiers=tiers, **kwargs)
    monkeypatch.setattr(TieredStore, "iter_layers", vanish_once)
    state, stats = engine.prefill(segs, FusionOptions(mode="blend"))
    assert vanish_once.done and "MissingBlockError" in stats.extra["store_fault"]
    want = tiny_engine(store=MemoryStore()).prefill(segs, FusionOptions(mode="blend"))[0].logits
    torch.testing.assert_close(state.logits, want, rtol=0, atol=1e-5)


def test_recompute_cost_is_interpolated_between_measured_lengths(tmp_path):
    p = StoreProfiles(tmp_path / "p.json", {"recompute:x": {"points": [[128, 1.0], [512, 2.0], [2048, 4.0]],
                                                            "measured_at": 0}})
    assert p.recompute("recompute:x", 320) == pytest.approx(1.5) and p.recompute("recompute:x", 3584) == 6.0
    assert p.recompute("recompute:x", 64) == 1.0 and p.recompute("nope", 100) is None  # flat below the shortest
    assert p.stale("recompute:x")  # measured at the epoch: re-measured at the next start-up


@pytest.mark.parametrize("disk_hides,expected", [(True, "disk"), (False, "memory")])
def test_new_blocks_go_to_the_cheapest_tier_whose_load_hides(tiny_engine, tmp_path, disk_hides, expected):
    """With ?cost= in the spec, a new block is placed in the cheapest tier whose loading still hides
    behind the recompute at r = 0.15, else in the fastest."""
    from tiny import make_segs

    from ragkv.engine.options import FusionOptions
    from ragkv.store.probe import profile_id
    from ragkv.store.spec import open_store

    store = open_store(f"memory:64MiB?cost=1,disk:{tmp_path}:1GiB?cost=0.01")
    engine = tiny_engine(store=store)
    engine.profile_store()
    profiles = engine.loading_planner.profiles.data  # the test sets the disk's speed instead of timing a real one
    profiles[profile_id(store.tiers[1])].update(bytes_per_s=1e15 if disk_hides else 1.0, latency_s=0.0)
    segs = make_segs(prefix=0, blocks=(30,))
    engine.prefill(segs, FusionOptions(mode="reuse"))
    key = engine.cache_keys(segs, FusionOptions(mode="reuse"))[0]
    assert [t.name for t in store.holders(key)] == [expected]


def test_costs_parse_and_are_checked():
    from ragkv.store.errors import StoreSpecError
    from ragkv.store.spec import parse_spec

    spec = parse_spec("memory:1GiB?cost=2,disk:/tmp/x:5GiB?cost=0.02,redis://127.0.0.1:6379/0?ttl=5&cost=0.3")
    assert [t.cost for t in spec.tiers] == [2.0, 0.02, 0.3] and spec.tiers[1].capacity_bytes == 5 << 30
    for bad in ("memory:1GiB?cost=-1", "disk:/tmp/x?cost=cheap", "memory?speed=3"):
        with pytest.raises(StoreSpecError):
            parse_spec(bad)


def test_profile_id_names_the_codec_not_the_capacity(tmp_path):
    """A compressed tier loads at another speed (decompression is part of a load): its own profile entry."""
    from ragkv.store.probe import profile_id

    assert profile_id(MemoryStore(1 << 20)) == profile_id(MemoryStore(1 << 30)) == "memory"
    assert profile_id(MemoryStore(1 << 20, kv="int8")) == "memory?kv=int8"
    disk = DiskStore(tmp_path / "kv", 1 << 30)
    assert profile_id(disk) == f"disk:{disk.root}"
    assert profile_id(DiskStore(tmp_path / "kv", 1 << 20, kv="int4")) == f"disk:{disk.root}?kv=int4"


def test_a_server_measures_its_load_profile_at_start_up_one_forward_at_a_time(tmp_path):
    """`ragkv serve --startup-profile` (the default; the tests' settings turn it off) measures the recompute cost in
    the background and saves it; a request sent meanwhile is answered."""
    import time

    import httpx
    from tiny import make_tiny_served

    from ragkv.bench.serve import ServerProcess
    from ragkv.engine.blocks.loading import PROFILE_FILE

    tiny = str(make_tiny_served(tmp_path))
    with ServerProcess(model=tiny, dtype="float32", device="cpu", store="memory:64MiB", startup_s=180,
                       cache_dir=tmp_path, extra=("--startup-profile",)) as s:
        r = httpx.post(s.url + "/v1/chat/completions", timeout=120, json={
            "max_tokens": 2, "messages": [{"role": "user", "content": "Who built the tower?"}]})
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 120
        points = []
        while len(points) < 3:
            assert time.monotonic() < deadline, "the start-up profile was not saved"
            time.sleep(0.2)
            saved = json.loads((tmp_path / PROFILE_FILE).read_text()) if (tmp_path / PROFILE_FILE).exists() else {}
            points = next((v["points"] for v in saved.values() if isinstance(v, dict) and "points" in v), [])
    assert sorted(p[0] for p in points) == [128, 512, 2048] and all(p[1] > 0 for p in points)
