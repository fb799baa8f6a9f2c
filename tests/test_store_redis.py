import logging

import pytest
import redis
import torch

from ragkv.store import serde
from ragkv.store.errors import StoreUnavailableError
from ragkv.store.redis_store import DEFAULT_PREFIX, RedisStore, redact
from redis_fixture import free_port
from store_helpers import L, make_key, make_kv, same

pytestmark = pytest.mark.redis


def raw(url):
    return redis.Redis.from_url(url)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_and_single_layer_reads(redis_url, dtype):
    store = RedisStore(redis_url)
    key, kv = make_key(), make_kv(dtype=dtype)
    assert store.get(key) is None and not store.contains(key) and store.get_layer(key, 0) is None
    store.put(key, kv)
    assert raw(redis_url).exists(DEFAULT_PREFIX + key.digest())
    assert store.contains(key) and same(store.get(key), kv)
    for i in range(L):
        k, v = store.get_layer(key, i)
        assert torch.equal(k, kv.keys[i]) and torch.equal(v, kv.values[i])
    assert store.delete(key) and store.get(key) is None


def test_second_client_sees_entries(redis_url):
    """Several ragkv servers share one Redis."""
    RedisStore(redis_url).put(make_key(0), make_kv(0))
    assert same(RedisStore(redis_url).get(make_key(0)), make_kv(0))


def test_ttl_is_set_and_refreshed_on_hit(redis_url):
    store = RedisStore(redis_url, ttl_s=100)
    key = make_key()
    store.put(key, make_kv())
    r = raw(redis_url)
    name = DEFAULT_PREFIX + key.digest()
    assert 0 < r.ttl(name) <= 100
    r.expire(name, 5)
    store.get(key)
    assert r.ttl(name) > 5
    assert RedisStore(redis_url).put(key, make_kv()) is None and r.ttl(name) > 5  # no TTL: the value is kept


def test_expired_entry_is_a_miss(redis_url):
    store = RedisStore(redis_url, ttl_s=1)
    key = make_key()
    store.put(key, make_kv())
    raw(redis_url).pexpire(DEFAULT_PREFIX + key.digest(), 1)
    import time
    time.sleep(0.01)
    assert store.get(key) is None and not store.contains(key)


@pytest.mark.parametrize("damage", ["payload", "header", "truncate", "garbage"])
@pytest.mark.parametrize("read", ["get", "get_layer", "contains"])
def test_corrupt_value_is_a_logged_miss_and_deleted(redis_url, caplog, damage, read):
    store = RedisStore(redis_url)
    key = make_key()
    store.put(key, make_kv())
    r, name = raw(redis_url), DEFAULT_PREFIX + key.digest()
    data = bytearray(r.get(name))
    if damage == "payload":
        data[-3] ^= 0xFF
    elif damage == "header":
        data[30] ^= 0xFF
    elif damage == "truncate":
        data = data[:-100]
    else:
        data = bytearray(b"\x00" * len(data))
    r.set(name, bytes(data))
    with caplog.at_level(logging.WARNING):
        if read == "get":
            assert store.get(key) is None
        elif read == "get_layer":
            assert store.get_layer(key, L - 1) is None
        else:
            assert store.contains(key) is (damage == "payload")
            if damage == "payload":
                assert store.get(key) is None
    assert "dropping entry" in caplog.text
    assert not r.exists(name)


@pytest.mark.parametrize("other", [make_key(fingerprint="fp-b"), make_key(conditioning="prefix:p"),
                                   make_key(namespace="tenant-b")])
def test_entry_of_another_key_is_never_returned(redis_url, other):
    """docs/invariants.md, invariant 8, even when a value is stored under another key's name."""
    store = RedisStore(redis_url)
    store.put(make_key(), make_kv())
    r = raw(redis_url)
    r.copy(DEFAULT_PREFIX + make_key().digest(), DEFAULT_PREFIX + other.digest())
    assert store.get(other) is None and not r.exists(DEFAULT_PREFIX + other.digest())
    assert same(store.get(make_key()), make_kv())


def test_namespaces_and_prefixes_isolated(redis_url):
    a, b = RedisStore(redis_url), RedisStore(redis_url, prefix="other:")
    a.put(make_key(0, "alice"), make_kv(0))
    a.put(make_key(1, "alice"), make_kv(1))
    a.put(make_key(0, "bob"), make_kv(2))
    b.put(make_key(0, "alice"), make_kv(3))
    assert same(a.get(make_key(0, "bob")), make_kv(2)) and same(b.get(make_key(0, "alice")), make_kv(3))
    size = len(serde.encode(make_key(), make_kv()))
    assert a.stats()["namespaces"] == {"alice": {"entries": 2, "bytes": 2 * size}, "bob": {"entries": 1, "bytes": size}}
    assert b.stats()["entries"] == 1
    assert a.clear("alice") == 2
    assert not a.contains(make_key(0, "alice")) and a.contains(make_key(0, "bob"))
    assert b.contains(make_key(0, "alice"))
    assert a.clear() == 1 and b.stats()["entries"] == 1


def test_unreachable_redis_is_a_clear_error_at_start():
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(StoreUnavailableError, match="is redis-server running") as err:
        RedisStore(url, timeout_s=0.5)
    assert url in str(err.value)


def test_password_is_not_shown_in_messages():
    assert redact("redis://:s3cret@host:6379/0") == "redis://:***@host:6379/0"


def test_outage_after_start_degrades_to_misses(redis_url, caplog):
    store = RedisStore(redis_url, timeout_s=0.5)
    store.client = redis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.2)
    with caplog.at_level(logging.WARNING):
        store.put(make_key(), make_kv())
        assert store.get(make_key()) is None and not store.contains(make_key())
        assert store.open_layers(make_key()) is None
    assert "treating it as a miss" in caplog.text
