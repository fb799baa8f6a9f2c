import logging
import multiprocessing as mp
import os
import shutil
import threading
import time

import pytest
import torch

from ragkv.store import serde
from ragkv.store.disk import DiskStore
from ragkv.store.errors import StoreUnavailableError
from store_helpers import L, disk_work, disk_worker, make_key, make_kv, same

FILE = len(serde.encode(make_key(), make_kv()))  # bytes of one fp32 test block on disk


def path_of(store, key):
    return store.root / f"{key.digest()}.kv"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_and_single_layer_reads(tmp_path, dtype):
    store = DiskStore(tmp_path, 1 << 20)
    key, kv = make_key(), make_kv(dtype=dtype)
    assert store.get(key) is None and not store.contains(key) and store.get_layer(key, 0) is None
    store.put(key, kv)
    assert store.contains(key) and same(store.get(key), kv)
    for i in range(L):
        k, v = store.get_layer(key, i)
        assert k.dtype == dtype and torch.equal(k, kv.keys[i]) and torch.equal(v, kv.values[i])
    with store.open_layers(key) as reader:
        assert [torch.equal(reader.read(i)[1], kv.values[i]) for i in (3, 0, 2)] == [True] * 3
    assert store.delete(key) and not store.contains(key) and not store.delete(key)


def test_entries_persist_across_instances(tmp_path):
    DiskStore(tmp_path, 1 << 20).put(make_key(0), make_kv(0))
    again = DiskStore(tmp_path, 1 << 20)
    assert same(again.get(make_key(0)), make_kv(0))
    assert again.stats()["entries"] == 1 and again.stats()["bytes"] == FILE


def test_no_temp_files_left_and_stale_ones_removed_at_start(tmp_path):
    store = DiskStore(tmp_path, 1 << 20)
    store.put(make_key(0), make_kv(0))
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{make_key(0).digest()}.kv"]
    stale, fresh = tmp_path / ".tmp-crashed.part", tmp_path / ".tmp-writing.part"
    stale.write_bytes(b"half")
    fresh.write_bytes(b"half")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    DiskStore(tmp_path, 1 << 20)
    assert not stale.exists() and fresh.exists()


def test_lru_eviction_by_bytes(tmp_path):
    store = DiskStore(tmp_path, 3 * FILE)
    for i in range(3):
        store.put(make_key(i), make_kv(i))
    assert store.get(make_key(0)) is not None       # 1 is now the least recently used
    store.put(make_key(3), make_kv(3))
    assert not store.contains(make_key(1))
    assert all(store.contains(make_key(i)) for i in (0, 2, 3))
    big = make_key(9, tokens=32)                     # about two blocks: evicts the two oldest (2, 0)
    store.put(big, make_kv(9, tokens=32))
    assert store.contains(big) and store.contains(make_key(3))
    assert not store.contains(make_key(2)) and not store.contains(make_key(0))
    assert store.stats()["bytes"] <= 3 * FILE


def test_lru_order_survives_a_restart(tmp_path):
    store = DiskStore(tmp_path, 3 * FILE)
    for i in range(3):
        store.put(make_key(i), make_kv(i))
    store.get(make_key(0))
    store.get_layer(make_key(1), 0)                  # per-layer reads count as use too: 2 is the oldest
    restarted = DiskStore(tmp_path, 3 * FILE)
    restarted.put(make_key(3), make_kv(3))
    assert not restarted.contains(make_key(2))
    assert all(restarted.contains(make_key(i)) for i in (0, 1, 3))


def test_block_larger_than_capacity_is_refused(tmp_path, caplog):
    store = DiskStore(tmp_path, 2 * FILE)
    store.put(make_key(0), make_kv(0))
    with caplog.at_level(logging.WARNING):
        store.put(make_key(1, tokens=64), make_kv(1, tokens=64))
    assert "exceeds the tier's whole capacity" in caplog.text
    assert store.contains(make_key(0)) and not store.contains(make_key(1, tokens=64))


def _flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(data)


@pytest.mark.parametrize("damage", ["payload", "header", "truncate", "truncate-header", "empty", "garbage"])
@pytest.mark.parametrize("read", ["get", "get_layer", "contains", "iter"])
def test_corrupt_or_truncated_file_is_a_logged_miss_and_deleted(tmp_path, caplog, damage, read):
    store = DiskStore(tmp_path, 1 << 20)
    key = make_key()
    store.put(key, make_kv())
    path = path_of(store, key)
    if damage == "payload":
        _flip(path, FILE - 5)                         # last layer
    elif damage == "header":
        _flip(path, 30)
    elif damage == "truncate":
        os.truncate(path, FILE - 100)
    elif damage == "truncate-header":
        os.truncate(path, 40)
    elif damage == "empty":
        os.truncate(path, 0)
    else:
        path.write_bytes(os.urandom(FILE))
    with caplog.at_level(logging.WARNING):
        if read == "get":
            assert store.get(key) is None
        elif read == "get_layer":
            assert store.get_layer(key, L - 1) is None
        elif read == "contains":
            assert store.contains(key) is (damage == "payload")  # contains checks header and length only
            if damage == "payload":
                assert store.get(key) is None
        else:
            reader = store.open_layers(key)
            assert reader is None or any(reader.read(i) is None for i in range(L))
    assert "dropping entry" in caplog.text and "recomputed" in caplog.text
    assert not path.exists()
    store.put(key, make_kv())                         # recomputed and stored again
    assert same(store.get(key), make_kv())


@pytest.mark.parametrize("other", [make_key(fingerprint="fp-b"), make_key(conditioning="prefix:p"),
                                   make_key(namespace="tenant-b")])
def test_entry_of_another_key_is_never_returned(tmp_path, other):
    """docs/invariants.md, invariant 8, even when a file lands under another key's name (copy, bug, collision)."""
    store = DiskStore(tmp_path, 1 << 20)
    store.put(make_key(), make_kv())
    assert store.get(other) is None
    shutil.copy(path_of(store, make_key()), path_of(store, other))
    assert store.get(other) is None and store.get_layer(other, 0) is None and not store.contains(other)
    shutil.copy(path_of(store, make_key()), path_of(store, other))
    assert store.get_layer(other, 0) is None and not path_of(store, other).exists()
    assert same(store.get(make_key()), make_kv())


def test_namespaces_isolated_in_stats_and_clear(tmp_path):
    store = DiskStore(tmp_path, 1 << 20)
    for ns in ("alice", "bob"):
        for i in range(2 if ns == "alice" else 1):
            store.put(make_key(i, ns), make_kv(i))
    assert store.get(make_key(1, "bob")) is None
    assert store.stats()["namespaces"] == {"alice": {"entries": 2, "bytes": 2 * FILE},
                                           "bob": {"entries": 1, "bytes": FILE}}
    assert store.clear("alice") == 2
    assert store.contains(make_key(0, "bob")) and not store.contains(make_key(0, "alice"))


def test_foreign_files_are_never_counted_or_deleted(tmp_path):
    (tmp_path / "notes.kv").write_text("mine")
    (tmp_path / "readme.txt").write_text("mine")
    store = DiskStore(tmp_path, 2 * FILE)
    for i in range(4):
        store.put(make_key(i), make_kv(i))
    assert store.clear() == 2 and store.stats()["entries"] == 0
    assert (tmp_path / "notes.kv").exists() and (tmp_path / "readme.txt").exists()


def test_unusable_directory_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StoreUnavailableError, match=str(blocker / "kv")):
        DiskStore(blocker / "kv", 1 << 20)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_directory_is_a_clear_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(StoreUnavailableError, match="not usable"):
            DiskStore(ro, 1 << 20)
    finally:
        ro.chmod(0o700)


def test_threads_reading_and_writing(tmp_path):
    store = DiskStore(tmp_path, 1 << 30)
    problems = []
    threads = [threading.Thread(target=lambda w=w: problems.extend(disk_work(store, w, 6, 10))) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not problems
    assert all(same(store.get(make_key(j)), make_kv(j)) for j in range(6))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp files left


def test_two_processes_reading_and_writing(tmp_path):
    """This process and a spawned one hammer the same keys at the same time."""
    ctx = mp.get_context("spawn")
    queue, ready = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=disk_worker, args=(str(tmp_path), 1, 8, 20, ready, queue))
    child.start()
    try:
        assert ready.wait(120), "child process did not start"
        mine = disk_work(DiskStore(tmp_path, 1 << 30), 0, 8, 20)
        theirs = queue.get(timeout=120)
        child.join(timeout=30)
    finally:
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    assert mine == [] and theirs == []                # no torn or wrong reads
    store = DiskStore(tmp_path, 1 << 30)
    assert all(same(store.get(make_key(j)), make_kv(j)) for j in range(8))  # no lost entries
    assert store.stats()["entries"] == 8
