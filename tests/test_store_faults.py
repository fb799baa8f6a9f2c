"""Store faults degrade, never fail: whatever the store does, a request is answered with the same
logits as with a healthy store, and its stats say what was not cached. Real tiers (memory, disk, a real Redis)."""

import errno
import os
import tempfile

import pytest
import redis
import torch

from ragkv.engine.options import FusionOptions
from ragkv.store.base import storage_name
from ragkv.store.disk import SUFFIX, DiskStore
from ragkv.store.memory import MemoryStore
from ragkv.store.redis_server import private_redis
from ragkv.store.redis_store import DEFAULT_PREFIX
from ragkv.store.spec import open_store
from tiny import make_segs

MODES = ("reuse", "blend", "ape")


def reference(tiny_engine, segs, mode):
    return tiny_engine(store=MemoryStore()).prefill(segs, FusionOptions(mode=mode))[0].logits


def same_answer(engine, tiny_engine, segs, mode="reuse"):
    state, stats = engine.prefill(segs, FusionOptions(mode=mode))
    torch.testing.assert_close(state.logits, reference(tiny_engine, segs, mode), rtol=0, atol=1e-5)
    return stats


@pytest.mark.parametrize("mode", MODES)
def test_a_store_smaller_than_one_block_still_answers(tiny_engine, mode):
    engine = tiny_engine(store=open_store("memory:1KiB"))
    stats = same_answer(engine, tiny_engine, make_segs(), mode)
    assert stats.extra["uncached_blocks"] == stats.cache_misses > 0
    stats = same_answer(engine, tiny_engine, make_segs(), mode)  # and again: nothing was kept
    assert stats.cache_hits == 0


def test_a_memory_tier_that_evicts_within_one_request_still_answers(tiny_engine):
    probe = MemoryStore()
    tiny_engine(store=probe).warm(make_segs(blocks=(25,), prefix=0))
    kv_bytes = probe.stats()["bytes"]
    engine = tiny_engine(store=open_store(f"memory:{int(kv_bytes * 1.5)}B"))  # holds one block of the three
    stats = same_answer(engine, tiny_engine, make_segs())
    # each block put evicts the one before: none is found when its layers are read, so all are computed here
    assert stats.extra["uncached_blocks"] == stats.cache_misses == 4 and stats.cache_hits == 0
    assert stats.extra["store_fault"].startswith("MissingBlockError: ") and "is in no tier" in stats.extra["store_fault"]


def test_a_disk_tier_below_one_request_still_answers(tiny_engine, tmp_path):
    engine = tiny_engine(store=open_store(f"memory:1KiB,disk:{tmp_path}:2KiB"))
    stats = same_answer(engine, tiny_engine, make_segs())
    assert stats.extra["uncached_blocks"] == stats.cache_misses


def test_a_disk_that_refuses_writes_still_answers(tiny_engine, tmp_path, monkeypatch):
    store = open_store(f"disk:{tmp_path}:1GiB")

    def read_only(*a, **k):
        raise OSError(30, "Read-only file system")
    monkeypatch.setattr(os, "replace", read_only)  # what a directory remounted read-only does to a put
    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    stats = same_answer(tiny_engine(store=store), tiny_engine, make_segs())
    assert stats.extra["uncached_blocks"] == stats.cache_misses == 4


def test_a_tier_that_raises_is_skipped_with_backoff_and_counted(tiny_engine, tmp_path, monkeypatch):
    monkeypatch.setattr("ragkv.store.tiered.MIN_BACKOFF_S", 600.0)  # stays down for the whole test
    store = open_store(f"memory:64MiB,disk:{tmp_path}:1GiB")
    disk = store.tiers[1]
    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise RuntimeError("disk controller on fire")
    monkeypatch.setattr(disk, "contains", broken)
    monkeypatch.setattr(disk, "put", broken)
    engine = tiny_engine(store=store)
    same_answer(engine, tiny_engine, make_segs())
    assert store.counters["faults"][disk.describe()] == 1 and len(calls) == 1  # then skipped while down
    same_answer(engine, tiny_engine, make_segs(seed=3))
    assert len(calls) == 1


def test_a_flipped_bit_on_disk_is_recomputed(tiny_engine, tmp_path):
    segs = make_segs()
    tiny_engine(store=DiskStore(tmp_path, 1 << 30)).warm(segs)
    for f in tmp_path.rglob(f"*{SUFFIX}"):
        data = bytearray(f.read_bytes())
        data[-100] ^= 0x10
        f.write_bytes(bytes(data))
    stats = same_answer(tiny_engine(store=open_store(f"disk:{tmp_path}:1GiB")), tiny_engine, segs)
    # the entries pass `contains`; the flipped layer fails its check when read, and every block is computed again
    assert stats.cache_hits == 0 and stats.cache_misses == 4
    assert stats.extra["store_fault"].startswith("MissingBlockError: ") and "while its layers were read" in \
        stats.extra["store_fault"]


def test_a_disk_entry_corrupted_between_check_and_read_is_recomputed(tiny_engine, tmp_path, monkeypatch):
    """The entry passes `contains`, then fails while its layers are read: the request computes it instead."""
    segs = make_segs()
    store = open_store(f"disk:{tmp_path}:1GiB")
    engine = tiny_engine(store=store)
    engine.warm(segs)
    monkeypatch.setattr(store.tiers[0], "open_layers", lambda key: None)  # vanished after `contains`
    stats = same_answer(engine, tiny_engine, segs)
    assert "store_fault" in stats.extra


def test_redis_down_with_a_redis_only_store_still_answers(tiny_engine, tmp_path):
    with private_redis(tmp_path) as url:
        store = open_store(url)
        engine = tiny_engine(store=store)
        same_answer(engine, tiny_engine, make_segs())
    for seed in range(3):  # redis-server is gone now
        stats = same_answer(engine, tiny_engine, make_segs(seed=seed))
        assert stats.cache_hits == 0
    # counted in /metrics' tier faults, and skipped with backoff rather than reconnecting on every call
    assert store.counters["faults"][store.tiers[0].describe()] >= 1 and not store._up(0)


@pytest.mark.parametrize("bad", ["list", "empty", "garbage"])
def test_a_redis_key_of_the_wrong_type_or_value_is_overwritten(tiny_engine, redis_url, bad):  # noqa: F811
    segs = make_segs(prefix=0, blocks=(20,))
    key = tiny_engine().cache_keys(segs, FusionOptions(mode="reuse"))[0]
    name = DEFAULT_PREFIX + storage_name(key)
    client = redis.Redis.from_url(redis_url)
    if bad == "list":
        client.rpush(name, "a", "b")
    else:
        client.set(name, b"" if bad == "empty" else b"not a kv entry at all")
    engine = tiny_engine(store=open_store(redis_url))
    same_answer(engine, tiny_engine, segs)
    assert client.type(name) == b"string" and client.strlen(name) > 100  # our entry replaced it
    stats = same_answer(engine, tiny_engine, segs)
    assert stats.cache_hits == 1 and stats.cache_misses == 0


def test_failed_reads_and_writes_are_tier_faults(tmp_path, monkeypatch):
    """A write refused (ENOSPC, EROFS) and a read failing (EIO), whole or per layer, each count as a fault of the
    tier in ragkv_store_tier_faults_total, not only in a log line."""
    from store_helpers import L, make_key, make_kv

    from ragkv.store.disk import DiskLayerReader

    store = open_store(f"disk:{tmp_path}/kv:1GiB", pipelined=False)
    disk = store.tiers[0].describe()
    monkeypatch.setattr("ragkv.store.tiered.MIN_BACKOFF_S", 0.0)  # retried at once: every failure is seen
    monkeypatch.setattr("ragkv.store.tiered.MAX_BACKOFF_S", 0.0)

    def refuse(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    with monkeypatch.context() as m:
        m.setattr(tempfile, "mkstemp", refuse)
        store.put(make_key(1), make_kv(1))
    assert store.counters["faults"][disk] == 1 and not store.contains(make_key(1))
    store.put(make_key(2), make_kv(2))
    assert store.counters["faults"][disk] == 1  # a write that works is no fault

    class Failing:  # a file whose reads fail like a dying device
        def __init__(self, f):
            self.f = f

        def seek(self, *a):
            return self.f.seek(*a)

        def readinto(self, buf):
            raise OSError(errno.EIO, "Input/output error")

        def close(self):
            self.f.close()

    real_init = DiskLayerReader.__init__
    with monkeypatch.context() as m:
        m.setattr(DiskLayerReader, "__init__", lambda self, s, k, f, h, i: real_init(self, s, k, Failing(f), h, i))
        with pytest.raises(KeyError):  # MissingBlockError: the engine computes the block instead
            list(store.iter_layers([make_key(2)], L))
    assert store.counters["faults"][disk] == 2

    def eio(*a, **k):
        raise OSError(errno.EIO, "Input/output error")
    with monkeypatch.context() as m:
        m.setattr("ragkv.store.disk.open", eio, raising=False)
        assert store.get(make_key(2)) is None
    assert store.counters["faults"][disk] == 3


@pytest.mark.parametrize("keep_stored", [True, False])
def test_a_request_whose_store_fails_starts_over_without_encoding_its_blocks_again(tiny_engine, tmp_path,
                                                                                 monkeypatch, keep_stored):
    """48-minute soak: a 27K-token `ape` request read a block the fault injector had just truncated, started over
    without the cache, encoded its 8 blocks a second time and passed its 300 s deadline. Now it starts over with
    the blocks it encoded still in hand (those no tier kept always; those a tier kept up to KEEP_STORED_BYTES, else
    read from the store again): nothing is encoded twice, and the answer is the healthy store's."""
    import ragkv.engine.blocks.encode as encode

    if not keep_stored:
        monkeypatch.setattr(encode, "KEEP_STORED_BYTES", 0)
    encodes = []
    real_encode = encode.encode_block_steps
    monkeypatch.setattr(encode, "encode_block_steps", lambda *a, **k: (encodes.append(1), real_encode(*a, **k))[1])
    store = open_store(f"disk:{tmp_path}:1GiB")
    disk = store.tiers[0]
    real_put, real_open = disk.put, disk.open_layers
    # the 25-token block is kept by no tier (as the soak's 162 MB blocks were); the first read of a stored one fails
    monkeypatch.setattr(disk, "put", lambda key, kv, **k: None if kv.num_tokens == 25 else real_put(key, kv, **k))
    failed = []
    monkeypatch.setattr(disk, "open_layers", lambda key: failed.append(key) if not failed else real_open(key))
    segs = make_segs()  # a prefix and blocks of 20, 17 and 25 tokens
    for mode in ("reuse", "ape"):
        encodes.clear(), failed.clear()
        for f in tmp_path.glob(f"*{SUFFIX}"):
            f.unlink()
        disk._rescan()
        state, stats = tiny_engine(store=store).prefill(segs, FusionOptions(mode=mode))
        assert failed and "MissingBlockError" in stats.extra["store_fault"]
        assert len(encodes) == 1 + len(segs.blocks)  # each once: the prefix and the three blocks
        torch.testing.assert_close(state.logits, reference(tiny_engine, segs, mode), rtol=0, atol=1e-5)
