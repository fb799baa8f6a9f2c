import argparse
import io
import json
from pathlib import Path

import pytest

from ragkv.errors import RagkvError
from ragkv.cli.store import register
from ragkv.store.disk import DiskStore
from ragkv.store.errors import StoreSpecError, StoreUnavailableError
from ragkv.store.memory import MemoryStore
from ragkv.store.redis_store import RedisStore
from ragkv.store.sizes import format_size, parse_size
from ragkv.store.spec import (DEFAULT_SPEC, DiskTierSpec, MemoryTierSpec, RedisTierSpec, open_store, parse_spec)
from redis_fixture import free_port
from store_helpers import make_key, make_kv, same


@pytest.mark.parametrize("text,size", [("2GiB", 2 << 30), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000),
                                       ("20gb", 20 * 10**9), ("4096", 4096), ("8 KiB", 8192), ("10KB", 10_000),
                                       ("1TiB", 1 << 40), ("100B", 100)])
def test_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "2XB", "-1GiB", "0MiB", "two GiB", "1.2.3GB"])
def test_bad_sizes_say_what_to_write(text):
    with pytest.raises(StoreSpecError, match="512MiB"):
        parse_size(text)


def test_format_size():
    assert [format_size(n) for n in (2 << 30, 1536 << 20, 1000)] == ["2GiB", "1536MiB", "1000B"]


def test_full_spec():
    spec = parse_spec("memory:2GiB,disk:~/.cache/ragkv/kv:20GiB,redis://127.0.0.1:6379/0?ttl=3600")
    assert spec.tiers == (MemoryTierSpec(2 << 30), DiskTierSpec(Path("~/.cache/ragkv/kv").expanduser(), 20 << 30),
                          RedisTierSpec("redis://127.0.0.1:6379/0", 3600, None))


def test_defaults():
    assert parse_spec(None) == parse_spec("") == parse_spec(DEFAULT_SPEC)
    assert parse_spec(None).tiers == (MemoryTierSpec(2 << 30),)
    assert parse_spec("memory").tiers == (MemoryTierSpec(2 << 30),)
    assert parse_spec("disk:/tmp/kv").tiers == (DiskTierSpec(Path("/tmp/kv"), 20 << 30),)
    assert parse_spec("disk:/tmp/a:b").tiers[0].path == Path("/tmp/a:b")  # a ':' inside the path is kept
    # options without a size: the default size with the options
    assert parse_spec("memory?kv=int8&cost=2").tiers == (MemoryTierSpec(2 << 30, 2.0, "int8"),)
    with pytest.raises(StoreSpecError, match="needs a directory"):
        parse_spec("disk?kv=int8")


def test_redis_query_parameters():
    t = parse_spec("redis://:pw@h:6380/2?ttl=60&prefix=team1:&health_check_interval=5").tiers[0]
    assert t == RedisTierSpec("redis://:pw@h:6380/2?health_check_interval=5", 60, "team1:")


@pytest.mark.parametrize("text,match", [
    ("ssd:/tmp:1GiB", "unknown store tier 'ssd'"),
    ("memory:lots", "cannot read size"),
    ("memory:0GiB", "zero"),
    ("disk:", "needs a directory"),
    ("disk::1GiB", "needs a directory"),
    ("disk:/tmp/kv:2QB", "cannot read size"),
    ("redis://", "no host"),
    ("redis://h:99999/0", "redis://HOST:PORT/DB"),
    ("redis://h:6379/0?ttl=soon", "ttl"),
    ("redis://h:6379/0?ttl=0", "ttl"),
    ("memory:1GiB,,disk:/tmp/kv", "empty tier"),
    ("memory:1GiB,memory:2GiB", "several memory tiers"),
    ("disk:/tmp/kv,memory:1GiB", "memory tier first"),
    ("disk:/tmp/kv,disk:/tmp/kv:2GiB", "twice"),
])
def test_bad_specs_say_what_to_do(text, match):
    with pytest.raises(StoreSpecError, match=match) as err:
        parse_spec(text)
    assert isinstance(err.value, RagkvError)


@pytest.mark.redis
def test_open_store_builds_each_tier(tmp_path, redis_url):
    store = open_store(f"memory:1MiB,disk:{tmp_path}/kv:4MiB,{redis_url}?ttl=30&prefix=t:", pipelined=False)
    mem, disk, red = store.tiers
    assert isinstance(mem, MemoryStore) and mem.capacity_bytes == 1 << 20
    assert isinstance(disk, DiskStore) and disk.root == tmp_path / "kv" and disk.capacity_bytes == 4 << 20
    assert isinstance(red, RedisStore) and red.ttl_s == 30 and red.prefix == "t:"
    assert not store.pipelined
    store.put(make_key(), make_kv())
    assert same(open_store(f"disk:{tmp_path}/kv").get(make_key()), make_kv())


def test_unreachable_redis_in_spec_fails_at_start(tmp_path):
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(StoreUnavailableError, match=f"{url}.*is redis-server running"):
        open_store(f"memory:1MiB,{url}")


def test_unwritable_disk_in_spec_fails_at_start(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(StoreUnavailableError, match=str(tmp_path / "f")):
        open_store(f"disk:{tmp_path}/f/kv:1GiB")


def test_a_server_store_starts_degraded_with_a_tier_down(tmp_path, caplog):
    """must_reach=False (ragkv serve): an unreachable Redis or an unwritable disk starts as a tier failing mid-run
    does (a fault counted, logged once, skipped with backoff); the other tiers serve. A bad spec still stops it."""
    (tmp_path / "f").write_text("x")
    url = f"redis://127.0.0.1:{free_port()}/0"
    store = open_store(f"memory:1MiB,disk:{tmp_path}/f/kv:1GiB,{url}", must_reach=False)
    mem, disk, red = store.tiers
    assert store.counters["faults"] == {mem.describe(): 0, disk.describe(): 1, red.describe(): 1}
    assert "cannot reach Redis" in str(red.start_error) and str(tmp_path / "f") in str(disk.start_error)
    assert sum("failed on start" in r.getMessage() for r in caplog.records) == 2  # once per tier
    store.put(make_key(), make_kv())  # the memory tier serves; the others are skipped while down
    assert same(store.get(make_key()), make_kv())
    tiers = {t["describe"]: t for t in store.stats()["tiers"]}
    assert tiers[red.describe()]["up"] is False and tiers[red.describe()]["bytes"] == 0
    assert tiers[disk.describe()]["up"] is False and tiers[mem.describe()]["up"] is True
    with pytest.raises(StoreSpecError):
        open_store(f"memory:1MiB,redis://127.0.0.1:{free_port()}/0?ttl=-1", must_reach=False)


def run_cli(*argv):
    parser = argparse.ArgumentParser(prog="ragkv")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(list(argv))
    out = io.StringIO()
    assert args.func(args, out=out) == 0
    return out.getvalue()


@pytest.mark.redis
def test_store_stats_and_clear_commands(tmp_path, redis_url):
    spec = f"disk:{tmp_path}/kv:1GiB,{redis_url}"
    store = open_store(spec)
    store.put(make_key(0, "alice"), make_kv(0))
    store.put(make_key(1, "alice"), make_kv(1))
    store.put(make_key(0, "bob"), make_kv(2))
    stats = json.loads(run_cli("store", "stats", "--store", spec, "--json"))
    for tier in stats["tiers"]:
        assert tier["entries"] == 3
        assert {ns: s["entries"] for ns, s in tier["namespaces"].items()} == {"alice": 2, "bob": 1}
    table = run_cli("store", "stats", "--store", spec)
    assert "alice" in table and "bob" in table and str(tmp_path) in table
    assert "cleared 4 entries (namespace 'alice')" in run_cli("store", "clear", "--store", spec, "--namespace", "alice")
    assert not store.contains(make_key(0, "alice")) and store.contains(make_key(0, "bob"))
    assert "cleared 2 entries (all namespaces)" in run_cli("store", "clear", "--store", spec)
    assert not store.contains(make_key(0, "bob"))


def test_clear_rejects_bad_namespace(tmp_path):
    with pytest.raises(RagkvError, match="invalid namespace"):
        run_cli("store", "clear", "--store", f"disk:{tmp_path}", "--namespace", "a/b")


def test_store_command_requires_a_subcommand():
    parser = argparse.ArgumentParser(prog="ragkv")
    register(parser.add_subparsers(dest="command"))
    with pytest.raises(SystemExit):
        parser.parse_args(["store"])
