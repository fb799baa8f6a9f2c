import gc
import os
import threading

import pytest
import torch

from ragkv.store.base import BlockKV, LayerReader
from ragkv.store.disk import DiskStore
from ragkv.store.errors import MissingBlockError
from ragkv.store.memory import MemoryStore
from ragkv.store.redis_store import RedisStore
from ragkv.store.tiered import TieredStore
from store_helpers import L, make_key, make_kv, same


@pytest.fixture
def three(tmp_path, redis_url):
    return [MemoryStore(1 << 20), DiskStore(tmp_path / "kv", 1 << 20), RedisStore(redis_url)]


def layers_of(kv):
    return [[kv.layer(i)] for i in range(kv.num_layers)]


def equal_layers(a, b):
    return len(a) == len(b) and all(len(x) == len(y) and all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1])
                                                             for p, q in zip(x, y)) for x, y in zip(a, b))


@pytest.mark.redis
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_through_and_round_trip_in_every_tier(three, dtype):
    store = TieredStore(three)
    key, kv = make_key(), make_kv(dtype=dtype)
    store.put(key, kv)
    for tier in three:
        assert tier.contains(key) and same(tier.get(key), kv), tier.name
    assert same(store.get(key), kv) and store.locate(key) == "memory"


@pytest.mark.redis
def test_read_through_promotes_to_faster_tiers(three):
    store = TieredStore(three)
    key, kv = make_key(), make_kv()
    three[2].put(key, kv)                                  # only in Redis (e.g. written by another server)
    assert store.locate(key) == "redis"
    assert same(store.get(key), kv)
    assert three[0].contains(key) and three[1].contains(key) and store.locate(key) == "memory"
    assert store.stats()["promotions"] == 1


@pytest.mark.redis
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pipelined_iter_layers_equals_unpipelined_and_promotes(tmp_path, redis_url, dtype):
    keys = [make_key(i) for i in range(4)]
    kvs = [make_kv(i, dtype=dtype) for i in range(4)]
    expected = [[kv.layer(i) for kv in kvs] for i in range(L)]
    results = []
    for pipelined in (False, True):
        tiers = [MemoryStore(1 << 20), DiskStore(tmp_path / f"kv{pipelined}", 1 << 20), RedisStore(redis_url)]
        tiers[0].put(keys[0], kvs[0])                      # blocks spread over the tiers
        tiers[1].put(keys[1], kvs[1])
        tiers[2].put(keys[2], kvs[2])
        tiers[1].put(keys[3], kvs[3])
        tiers[2].put(keys[3], kvs[3])
        store = TieredStore(tiers, pipelined=pipelined)
        stream = store.iter_layers(keys, L)
        assert stream.pipelined is pipelined
        got = [next(stream) for _ in range(L)]             # as the engine does: exactly L calls to next()
        if pipelined:
            stream._thread.join(5)
        results.append(got)
        assert all(tiers[0].contains(k) for k in keys)     # promoted into memory without a final next()
        assert all(same(tiers[0].get(k), kv) for k, kv in zip(keys, kvs))
        assert tiers[1].contains(keys[2])
        assert list(stream) == []
    assert equal_layers(results[0], expected) and equal_layers(results[1], expected)


def test_memory_only_streams_skip_the_thread():
    store = TieredStore([MemoryStore(1 << 20)])
    store.put(make_key(), make_kv())
    stream = store.iter_layers([make_key()], L)
    assert not stream.pipelined
    assert equal_layers(list(stream), layers_of(make_kv()))


def test_base_memory_store_works_as_a_tier():
    store = TieredStore([MemoryStore()])
    store.put(make_key(), make_kv())
    assert equal_layers(list(store.iter_layers([make_key()], L)), layers_of(make_kv()))


def test_asking_for_more_layers_than_stored_is_an_error():
    store = TieredStore([MemoryStore(1 << 20)])
    store.put(make_key(), make_kv())
    with pytest.raises(ValueError, match="fewer"):
        store.iter_layers([make_key()], L + 1)


def test_missing_block_raises_at_once(tmp_path):
    store = TieredStore([MemoryStore(1 << 20), DiskStore(tmp_path, 1 << 20)])
    store.put(make_key(0), make_kv(0))
    with pytest.raises(MissingBlockError, match="encode it") as err:
        store.iter_layers([make_key(0), make_key(1)], L)
    assert isinstance(err.value, KeyError)


@pytest.mark.redis
@pytest.mark.parametrize("pipelined", [False, True])
def test_file_truncated_mid_request_continues_from_slower_tier(tmp_path, redis_url, pipelined):
    disk, red = DiskStore(tmp_path, 1 << 20), RedisStore(redis_url)
    store = TieredStore([disk, red], pipelined=pipelined)
    store.put(make_key(), make_kv())
    stream = store.iter_layers([make_key()], L)
    first = next(stream)                                   # the prefetcher reads layer 3 only after next() #2
    os.truncate(disk.root / f"{make_key().digest()}.kv", 200)   # same inode as the open reader's
    rest = list(stream)
    assert equal_layers([first] + rest, layers_of(make_kv()))
    assert disk.counters["corrupt"] == 1                   # detected while reading, then served by Redis
    assert not disk.contains(make_key()) and red.contains(make_key())


@pytest.mark.parametrize("pipelined", [False, True])
def test_block_vanishing_everywhere_mid_request_raises(tmp_path, pipelined):
    disk = DiskStore(tmp_path, 1 << 20)
    store = TieredStore([disk], pipelined=pipelined)
    store.put(make_key(), make_kv())
    stream = store.iter_layers([make_key()], L)
    next(stream)                                           # the prefetcher reads layer 3 only after next() #2
    os.truncate(disk.root / f"{make_key().digest()}.kv", 200)
    with pytest.raises(MissingBlockError, match="vanished"):
        for _ in range(L):
            next(stream)


class SlowTier(MemoryStore):
    """A tier whose layer reads are observable, to check prefetching without timing anything."""
    name = "slow"

    def __init__(self):
        super().__init__()
        self.started = [threading.Event() for _ in range(L)]

    def open_layers(self, key):
        kv = self.get(key)
        tier = self

        class Reader(LayerReader):
            def read(self, layer):
                tier.started[layer].set()
                return kv.layer(layer)
        return None if kv is None else Reader(key, kv.num_layers)


def test_pipelining_reads_next_layer_while_caller_computes():
    """CacheBlend sec. 5: layer i+1 is being loaded while the caller still holds layer i."""
    tier = SlowTier()
    tier.put(make_key(), make_kv())
    stream = TieredStore([tier], pipelined=True).iter_layers([make_key()], L)
    for i in range(L - 1):
        next(stream)
        assert tier.started[i + 1].wait(5), f"layer {i + 1} was not prefetched during layer {i}"
    next(stream)


def test_unpipelined_reads_on_demand():
    tier = SlowTier()
    tier.put(make_key(), make_kv())
    stream = TieredStore([tier], pipelined=False).iter_layers([make_key()], L)
    next(stream)
    assert not tier.started[1].wait(0.2)


def test_abandoned_stream_stops_its_thread():
    tier = SlowTier()
    tier.put(make_key(), make_kv())
    stream = TieredStore([tier]).iter_layers([make_key()], L)
    next(stream)
    thread = stream._thread
    del stream
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()


@pytest.mark.redis
def test_namespaces_never_see_each_other(three):
    store = TieredStore(three)
    store.put(make_key(0, "alice"), make_kv(0))
    store.put(make_key(0, "bob"), make_kv(1))
    assert same(store.get(make_key(0, "alice")), make_kv(0)) and same(store.get(make_key(0, "bob")), make_kv(1))
    assert store.get(make_key(0, "carol")) is None and not store.contains(make_key(0, "carol"))
    with pytest.raises(MissingBlockError):
        store.iter_layers([make_key(0, "carol")], L)
    for tier in store.stats()["tiers"]:
        assert set(tier["namespaces"]) == {"alice", "bob"}
    assert store.clear(namespace="alice") == 3
    assert not store.contains(make_key(0, "alice")) and same(store.get(make_key(0, "bob")), make_kv(1))
    for tier in store.stats()["tiers"]:
        assert set(tier["namespaces"]) == {"bob"}


@pytest.mark.redis
@pytest.mark.parametrize("other", [make_key(fingerprint="fp-other-model"), make_key(fingerprint="fp-a-bf16"),
                                   make_key(conditioning="prefix:abc")])
def test_other_fingerprint_or_conditioning_never_hits(three, other):
    """docs/invariants.md, invariant 8, through the whole tiered store (dtype and RoPE are part of the fingerprint)."""
    store = TieredStore(three)
    store.put(make_key(), make_kv())
    assert store.get(other) is None and store.locate(other) is None and store.get_layer(other, 0) is None


@pytest.mark.redis
def test_forced_tier_reads_from_that_tier(three):
    store = TieredStore(three)
    store.put(make_key(), make_kv())
    stream = store.iter_layers([make_key()], L, tier="disk")
    assert stream.pipelined and equal_layers(list(stream), layers_of(make_kv()))
    assert store.stats()["hits"][three[1].describe()] == 1


def test_write_back_returns_before_the_slow_tier_and_flush_lands_it(tmp_path):
    """CacheBlend writes new KV back in the background: `put` returns once the fastest tier holds the block."""
    gate = threading.Event()

    class Slow(DiskStore):
        def put(self, key, kv):
            assert gate.wait(30)
            super().put(key, kv)

    slow = Slow(tmp_path / "kv", 1 << 20)
    store = TieredStore([MemoryStore(1 << 20), slow], write_back=True)
    store.put(make_key(), make_kv())  # would block forever if it waited for the slow tier
    assert store.tiers[0].contains(make_key()) and not slow.contains(make_key())
    gate.set()
    store.flush()
    assert same(slow.get(make_key()), make_kv())


@pytest.mark.parametrize("pipelined", [True, False])
def test_layers_are_staged_for_the_compute_device(tmp_path, pipelined):
    """The CUDA staging path (pinned memory, side stream, events) is the same code on CPU, where it passes
    tensors through unchanged; on a GPU the same call returns device tensors (exercised on the lent GPU)."""
    store = TieredStore([MemoryStore(1 << 20), DiskStore(tmp_path / "kv", 1 << 20)], pipelined=pipelined)
    keys = [make_key(), make_key(1)]
    for i, k in enumerate(keys):
        store.tiers[1].put(k, make_kv(seed=i))
    layers = list(store.iter_layers(keys, L, device="cpu"))
    assert len(layers) == L and all(k.device.type == "cpu" for layer in layers for k, _ in layer)
    for i, key in enumerate(keys):
        assert same(BlockKV(torch.stack([layer[i][0] for layer in layers]),
                            torch.stack([layer[i][1] for layer in layers])), make_kv(seed=i))
