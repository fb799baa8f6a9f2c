"""The Redis Cluster tier against a real local cluster of 3 masters + 3 replicas that the tests start
(redis_cluster_fixture): hash-tagged keys keep a block on one node, two engines share blocks through the cluster,
a migrating slot is followed, and a master killed mid-run degrades requests to recompute (never an error) until
its replica is promoted and hits return."""

import time

import pytest
import redis
import torch

from ragkv.engine.options import FusionOptions
from ragkv.store.errors import StoreSpecError, StoreUnavailableError
from ragkv.store.memory import MemoryStore
from ragkv.store.redis_cluster import RedisClusterStore
from ragkv.store.redis_store import DEFAULT_PREFIX
from ragkv.store.spec import RedisClusterTierSpec, open_store, parse_spec
from redis_cluster_fixture import empty, redis_cluster  # noqa: F401
from redis_fixture import free_port
from store_helpers import L, make_key, make_kv, same
from tiny import make_segs

pytestmark = pytest.mark.redis


@pytest.fixture
def cluster(redis_cluster):  # noqa: F811
    return redis_cluster


@pytest.fixture
def cluster_url(cluster):
    """The session's cluster, emptied before the test."""
    return empty(cluster)


def reference(tiny_engine, segs):
    return tiny_engine(store=MemoryStore()).prefill(segs, FusionOptions(mode="reuse"))[0].logits


def answer(engine, segs, want):
    """Answer a request and check its logits against the cache-free reference: a fault may cost time, never
    an error or another answer."""
    state, stats = engine.prefill(segs, FusionOptions(mode="reuse"))
    torch.testing.assert_close(state.logits, want, rtol=0, atol=1e-5)
    return stats


def test_spec_parses_seed_nodes_and_options():
    spec = parse_spec("memory:1GiB,redis+cluster://:pw@10.0.0.1:7000,10.0.0.2:7000?ttl=60&prefix=p:,disk:/tmp/kv")
    tier = spec.tiers[1]
    assert isinstance(tier, RedisClusterTierSpec)
    assert (tier.url, tier.ttl_s, tier.prefix) == ("redis+cluster://:pw@10.0.0.1:7000,10.0.0.2:7000", 60, "p:")
    assert len(spec.tiers) == 3
    for bad, field in [("redis+cluster://10.0.0.1", "HOST:PORT"), ("redis+cluster://h:1/2", "database 0"),
                       ("redis+cluster://h:1?ttl=0", "ttl")]:
        with pytest.raises(StoreSpecError, match=field):
            parse_spec(bad)


def test_unreachable_cluster_is_a_clear_error_at_start():
    with pytest.raises(StoreUnavailableError, match="Redis Cluster") as err:
        RedisClusterStore(f"redis+cluster://:s3cret@127.0.0.1:{free_port()},127.0.0.1:{free_port()}", timeout_s=0.5)
    assert "s3cret" not in str(err.value) and ":***@127.0.0.1" in str(err.value)


def test_round_trip_and_a_block_lives_on_one_node(cluster, cluster_url):
    store = open_store(cluster_url)
    tier = store.tiers[0]
    keys = [make_key(i, namespace=("alice", "bob")[i % 2]) for i in range(12)]
    for i, key in enumerate(keys):
        store.put(key, make_kv(i))
    owners = set()
    for i, key in enumerate(keys):
        assert same(store.get(key), make_kv(i))
        for layer in range(L):  # each layer read alone, from the node the hash tag chose
            k, v = tier.get_layer(key, layer)
            assert torch.equal(k, make_kv(i).keys[layer]) and torch.equal(v, make_kv(i).values[layer])
        name = f"{DEFAULT_PREFIX}{{{key.digest()}}}"
        port = cluster.master_port(name)
        with cluster.node(port).client() as master:
            # the hash tag: the whole key hashes as the block's digest alone, and that node holds it
            assert master.execute_command("CLUSTER KEYSLOT", name) == master.execute_command("CLUSTER KEYSLOT",
                                                                                            key.digest())
            assert master.exists(name)
        owners.add(port)
    assert len(owners) > 1  # blocks spread over the masters
    stats = tier.stats()
    assert stats["entries"] == 12 and set(stats["namespaces"]) == {"alice", "bob"}
    assert tier.clear("alice") == 6 and tier.stats()["entries"] == 6
    assert not store.contains(keys[0]) and store.contains(keys[1])
    assert store.delete(keys[1]) and store.get(keys[1]) is None


def test_two_engines_share_blocks_through_the_cluster(tiny_engine, cluster_url):
    segs = make_segs(seed=1)
    want = reference(tiny_engine, segs)
    a = tiny_engine(store=open_store(f"memory:64MiB,{cluster_url}"))
    b = tiny_engine(store=open_store(f"memory:64MiB,{cluster_url}"))  # another server's store
    first = answer(a, segs, want)
    assert first.cache_hits == 0 and first.cache_misses > 0
    second = answer(b, segs, want)
    assert second.cache_hits == first.cache_misses and second.cache_misses == 0
    assert b.store.counters["hits"][b.store.tiers[1].describe()] > 0  # found in the cluster, not computed


def test_a_slot_migrating_mid_run_is_followed_through_ask_and_moved(tiny_engine, cluster, cluster_url):
    segs = make_segs(seed=3)
    want = reference(tiny_engine, segs)
    store = open_store(cluster_url)
    engine = tiny_engine(store=store)
    answer(engine, segs, want)
    name = f"{DEFAULT_PREFIX}{{{engine.cache_keys(segs)[0].digest()}}}"
    src = cluster.node(cluster.master_port(name))
    masters = cluster.masters()
    dst = next(n for n in masters if n is not src)
    with src.client() as s, dst.client() as d:
        slot = s.execute_command("CLUSTER KEYSLOT", name)
        src_id, dst_id = s.execute_command("CLUSTER MYID").decode(), d.execute_command("CLUSTER MYID").decode()
        d.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
        s.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
        assert answer(engine, segs, want).cache_misses == 0  # the key still on the source
        s.execute_command("MIGRATE", "127.0.0.1", dst.port, "", 0, 5000, "KEYS", name)
        assert answer(engine, segs, want).cache_misses == 0  # the source answers ASK: the client follows it
        for n in masters:
            with n.client() as c:
                c.execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
    cluster.wait_ok(timeout_s=10)
    assert answer(engine, segs, want).cache_misses == 0  # MOVED from the old owner: the client follows it
    assert cluster.master_port(name) == dst.port
    assert store.counters["faults"][store.tiers[0].describe()] == 0


def test_a_master_killed_mid_run_degrades_to_recompute_until_its_replica_takes_over(tiny_engine, cluster,
                                                                                   cluster_url):
    segs = make_segs(seed=2)
    want = reference(tiny_engine, segs)
    store = open_store(cluster_url)  # the cluster alone: a hit can only come from it
    engine = tiny_engine(store=store)
    answer(engine, segs, want)
    assert answer(engine, segs, want).cache_misses == 0
    cluster.wait_synced()  # replication is asynchronous: the replica must hold the blocks before the crash
    victim = cluster.master_port(f"{DEFAULT_PREFIX}{{{engine.cache_keys(segs)[0].digest()}}}")
    with cluster.node(victim).client() as c:
        replica_ports = {int(v["port"]) for k, v in c.info("replication").items() if k.startswith("slave")}
    cluster.kill(victim)
    killed_at, degraded, deadline = time.monotonic(), 0, time.monotonic() + 40
    while True:  # requests keep coming while the slot moves: every one is answered, with the same logits
        stats = answer(engine, segs, want)
        if stats.cache_misses == 0:
            break
        degraded += 1
        assert time.monotonic() < deadline, "hits did not return after the failover"
        time.sleep(0.1)
    assert degraded > 0  # the first request after the crash could not read the dead master's block
    assert store.counters["faults"][store.tiers[0].describe()] >= 1
    cluster.wait_ok(timeout_s=10)
    assert cluster.master_port(f"{DEFAULT_PREFIX}{{{engine.cache_keys(segs)[0].digest()}}}") in replica_ports
    assert time.monotonic() - killed_at < 40
    with pytest.raises(redis.exceptions.ConnectionError), cluster.node(victim).client(timeout_s=0.2) as dead:
        dead.ping()
