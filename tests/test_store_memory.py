import logging
import threading

import pytest
import torch

from ragkv.store.errors import InvalidNamespaceError
from ragkv.store.memory import MemoryStore
from store_helpers import make_key, make_kv, same

BLOCK = make_kv().nbytes  # 4096 bytes in fp32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip(dtype):
    store = MemoryStore(1 << 20)
    key, kv = make_key(), make_kv(dtype=dtype)
    assert store.get(key) is None and not store.contains(key)
    store.put(key, kv)
    assert store.contains(key) and same(store.get(key), kv)
    k, v = store.get_layer(key, 2)
    assert torch.equal(k, kv.keys[2]) and torch.equal(v, kv.values[2])
    assert store.delete(key) and store.get(key) is None and not store.delete(key)


def test_lru_is_bounded_by_bytes():
    store = MemoryStore(3 * BLOCK)
    for i in range(3):
        store.put(make_key(i), make_kv(i))
    store.get(make_key(0))                      # 0 becomes most recent; 1 is now the oldest
    store.put(make_key(3), make_kv(3))
    assert not store.contains(make_key(1))
    assert all(store.contains(make_key(i)) for i in (0, 2, 3))
    # order is now 2, 0, 3: a block twice as big evicts the two least recently used
    store.put(make_key(9, tokens=32), make_kv(9, tokens=32))
    assert [k.token_hash for k, _ in store.entries()] == ["tokens-3", "tokens-9"]
    assert store.stats()["bytes"] == 3 * BLOCK <= store.capacity_bytes


def test_restore_returns_to_the_snapshot():
    store = MemoryStore(3 * BLOCK)
    store.put(make_key(0), make_kv(0))
    snap = store.snapshot()
    store.put(make_key(1), make_kv(1))
    store.delete(make_key(0))
    store.restore(snap)
    assert store.contains(make_key(0)) and not store.contains(make_key(1)) and store.stats()["bytes"] == BLOCK


def test_bf16_blocks_take_half_the_bytes():
    store = MemoryStore(4 * BLOCK // 2)
    for i in range(4):
        store.put(make_key(i), make_kv(i, dtype=torch.bfloat16))
    assert store.stats()["entries"] == 4


def test_block_larger_than_capacity_is_refused_without_evicting(caplog):
    store = MemoryStore(2 * BLOCK)
    store.put(make_key(0), make_kv(0))
    with caplog.at_level(logging.WARNING):
        store.put(make_key(1, tokens=48), make_kv(1, tokens=48))
    assert "exceeds the tier's whole capacity" in caplog.text
    assert store.contains(make_key(0)) and not store.contains(make_key(1, tokens=48))


def test_namespaces_are_isolated_and_cleared_separately():
    store = MemoryStore(1 << 20)
    store.put(make_key(0, "alice"), make_kv(0))
    store.put(make_key(0, "bob"), make_kv(1))
    assert same(store.get(make_key(0, "alice")), make_kv(0))
    assert same(store.get(make_key(0, "bob")), make_kv(1))
    assert store.get(make_key(0)) is None
    assert store.stats()["namespaces"] == {"alice": {"entries": 1, "bytes": BLOCK}, "bob": {"entries": 1, "bytes": BLOCK}}
    assert store.clear("alice") == 1
    assert not store.contains(make_key(0, "alice")) and store.contains(make_key(0, "bob"))


def test_unsafe_namespace_is_rejected():
    with pytest.raises(InvalidNamespaceError, match="namespace"):
        MemoryStore(1 << 20).put(make_key(0, "../etc"), make_kv())


def test_threads_share_the_store_safely():
    store = MemoryStore(6 * BLOCK)
    errors = []

    def work(w):
        for r in range(200):
            i = (w + r) % 10
            store.put(make_key(i), make_kv(i))
            got = store.get(make_key(i))
            if got is not None and not same(got, make_kv(i)):
                errors.append(i)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    st = store.stats()
    assert st["bytes"] == st["entries"] * BLOCK <= store.capacity_bytes
