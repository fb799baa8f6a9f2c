"""The `--store` option: a comma-separated list of tiers, fastest first, turned into a TieredStore.

    memory[:SIZE][?cost=C&kv=K]         in-process LRU (SIZE default 2GiB)
    disk:PATH[:SIZE][?cost=C&kv=K]      one file per block under PATH (SIZE default 20GiB)
    redis://HOST:PORT/DB[?ttl=S&prefix=P&cost=C&kv=K]   a Redis database (also rediss://, unix://)
    redis+cluster://HOST:PORT[,HOST:PORT...][?ttl=S&prefix=P&cost=C&kv=K]   a Redis Cluster, given seed nodes

`cost` is what keeping a GB in that tier costs, in any unit you like (say $ per GB-month), compared between tiers.
When any tier names one, new blocks are placed by the loading controller: in the cheapest tier whose loading still
hides behind blend's recompute (CacheBlend sec. 5.1); tiers without a cost then count as DEFAULT_COSTS. Without
costs, every tier gets every block (write-through, the slower ones in the background).

Example: `memory:2GiB,disk:~/.cache/ragkv/kv:20GiB,redis://127.0.0.1:6379/0?ttl=3600`.
Sizes take B, KB/MB/GB/TB (powers of 1000) or KiB/MiB/GiB/TiB (powers of 1024).

`kv` is how a tier keeps KV: none (default, exact), int8, int4 or fp8 (ragkv.store.compress: KIVI-style scales,
decompressed on load into the model's dtype; int8 and fp8 take ~0.51x the bytes of bf16, int4 ~0.32x). It is set
per tier, not store-wide, because compression pays where bytes are scarce (disk space, Redis memory, disk and
network bandwidth), while an exact memory tier in front costs no decode time and no accuracy. Every tier reads
entries of every codec, e.g. `memory:2GiB,disk:~/.cache/ragkv/kv:20GiB?kv=int8`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ragkv.store.errors import StoreSpecError
from ragkv.store.sizes import parse_size

if TYPE_CHECKING:  # annotations only: importing these at run time would import upward or in a circle
    from ragkv.store.tiered import TieredStore

DEFAULT_SPEC = "memory:2GiB"
DEFAULT_MEMORY = "2GiB"
DEFAULT_DISK = "20GiB"
DEFAULT_COSTS = {"memory": 1.0, "redis": 0.25, "disk": 0.02}  # relative price per GB, when some tier names one
SYNTAX = ("use a comma-separated list of memory[:SIZE], disk:PATH[:SIZE], redis://HOST:PORT/DB[?ttl=SECONDS] "
          "and redis+cluster://HOST:PORT[,HOST:PORT...], fastest first, e.g. "
          "memory:2GiB,disk:~/.cache/ragkv/kv:20GiB,redis://127.0.0.1:6379/0")
REDIS_SCHEMES = ("redis", "rediss", "unix")
KV_CHOICES = ("none", "int8", "int4", "fp8")  # = ragkv.store.compress.KV_CHOICES (parsing imports no torch)
REDIS_CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
CLUSTER_SYNTAX = "write redis+cluster://HOST:PORT[,HOST:PORT...], e.g. redis+cluster://10.0.0.1:7000,10.0.0.2:7000"


@dataclass(frozen=True)
class MemoryTierSpec:
    capacity_bytes: int
    cost: float | None = None  # ?cost=: price of keeping a GB there (any unit, compared between tiers)
    kv: str | None = None      # ?kv=: the tier's KV codec (None: uncompressed)


@dataclass(frozen=True)
class DiskTierSpec:
    path: Path
    capacity_bytes: int
    cost: float | None = None
    kv: str | None = None


@dataclass(frozen=True)
class RedisTierSpec:
    url: str                 # without ragkv's own query parameters
    ttl_s: int | None = None
    prefix: str | None = None
    cost: float | None = None
    kv: str | None = None


@dataclass(frozen=True)
class RedisClusterTierSpec(RedisTierSpec):
    """A Redis Cluster: `url` is redis+cluster://[user:password@]HOST:PORT[,HOST:PORT...] (seed nodes)."""


def _cost(value: str, where: str) -> float:
    try:
        cost = float(value)
    except ValueError:
        cost = -1.0
    if not (cost >= 0 and cost != float("inf")):
        raise StoreSpecError(f"cost {value!r} in {where!r} must be a non-negative number, e.g. ?cost=0.02")
    return cost


def _kv(value: str, where: str) -> str | None:
    kv = value.strip().lower()
    if kv not in KV_CHOICES:
        raise StoreSpecError(f"kv {value!r} in {where!r}: choose one of {', '.join(KV_CHOICES)}, e.g. ?kv=int8")
    return None if kv == "none" else kv


def _options(rest: str, where: str) -> tuple[str, float | None, str | None]:
    """`PATH:SIZE?cost=X&kv=K` -> (`PATH:SIZE`, X, K); memory and disk tiers take only `cost` and `kv`."""
    rest, _, query = rest.partition("?")
    cost = kv = None
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name == "cost":
            cost = _cost(value, where)
        elif name == "kv":
            kv = _kv(value, where)
        else:
            raise StoreSpecError(f"unknown option {name!r} in {where!r}; memory and disk tiers take ?cost=X and "
                                 "?kv=none|int8|int4|fp8")
    return rest, cost, kv


@dataclass(frozen=True)
class StoreSpec:
    tiers: tuple
    text: str

    def __post_init__(self):
        if not self.tiers:
            raise StoreSpecError(f"store spec {self.text!r} names no tier; {SYNTAX}")
        kinds = [type(t) for t in self.tiers]
        if kinds.count(MemoryTierSpec) > 1:
            raise StoreSpecError(f"store spec {self.text!r} has several memory tiers; keep one")
        if MemoryTierSpec in kinds and kinds[0] is not MemoryTierSpec:
            raise StoreSpecError(f"store spec {self.text!r}: put the memory tier first (tiers are read fastest "
                                 "first)")
        seen = set()
        for t in self.tiers:
            ident = t.path if isinstance(t, DiskTierSpec) else t.url if isinstance(t, RedisTierSpec) else None
            if ident is not None and ident in seen:
                raise StoreSpecError(f"store spec {self.text!r} lists {ident} twice")
            seen.add(ident)


def _parse_memory(rest: str, text: str) -> MemoryTierSpec:
    rest, cost, kv = _options(rest, text)
    return MemoryTierSpec(parse_size(rest or DEFAULT_MEMORY), cost, kv)


def _parse_disk(rest: str, text: str) -> DiskTierSpec:
    rest, cost, kv = _options(rest, text)
    if not rest:
        raise StoreSpecError(f"disk tier in {text!r} needs a directory: disk:PATH[:SIZE], e.g. "
                             "disk:~/.cache/ragkv/kv:20GiB")
    path, size = rest, DEFAULT_DISK
    parts = rest.split(":")
    # a size is the first field after the path that starts like a number (directories rarely do after a ':')
    sized = [i for i, part in enumerate(parts) if i > 0 and part[:1] in "0123456789-+."]
    if sized:
        i = sized[0]
        if i != len(parts) - 1:
            raise StoreSpecError(f"disk tier in {text!r} has {':'.join(parts[i + 1:])!r} after its size; write "
                                 "disk:PATH[:SIZE]")
        path, size = ":".join(parts[:i]), parts[i]
    if not path:
        raise StoreSpecError(f"disk tier in {text!r} needs a directory before the size: disk:PATH:SIZE")
    return DiskTierSpec(Path(path).expanduser(), parse_size(size), cost, kv)


def _parse_redis(part: str, text: str) -> RedisTierSpec:
    u = urlsplit(part)
    if u.scheme != "unix" and not u.hostname:
        raise StoreSpecError(f"redis tier {part!r} has no host; write redis://HOST:PORT/DB, e.g. "
                             "redis://127.0.0.1:6379/0")
    try:
        u.port
    except ValueError as e:
        raise StoreSpecError(f"redis tier {part!r}: {e}; write redis://HOST:PORT/DB") from e
    ttl, prefix, cost, kv, others = None, None, None, None, []
    for name, value in parse_qsl(u.query, keep_blank_values=True):
        if name == "ttl":
            try:
                ttl = int(value)
            except ValueError:
                ttl = 0
            if ttl <= 0:
                raise StoreSpecError(f"redis ttl {value!r} in {part!r} must be a positive whole number of seconds, "
                                     "e.g. ?ttl=3600")
        elif name == "prefix":
            prefix = value
        elif name == "cost":
            cost = _cost(value, part)
        elif name == "kv":
            kv = _kv(value, part)
        else:
            others.append((name, value))  # left to redis-py (e.g. socket options)
    return RedisTierSpec(urlunsplit(u._replace(query=urlencode(others))), ttl, prefix, cost, kv)


def _parse_redis_cluster(part: str, text: str) -> RedisClusterTierSpec:
    """The seed nodes checked here; ragkv's options parsed as a single node's, so both take the same ones."""
    scheme, _, rest = part.partition("://")
    netloc, _, query = rest.partition("?")
    netloc, _, db = netloc.partition("/")
    if db not in ("", "0"):
        raise StoreSpecError(f"redis cluster tier {part!r}: a cluster has only database 0, so no /DB; "
                             f"{CLUSTER_SYNTAX}")
    auth, at, hosts = netloc.rpartition("@")
    nodes = []
    for node in hosts.split(","):
        host, _, port = node.strip().rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise StoreSpecError(f"redis cluster tier {part!r}: seed node {node!r} is not HOST:PORT; "
                                 f"{CLUSTER_SYNTAX}")
        nodes.append(f"{host}:{port}")
    plain = scheme.lower().split("+")[0]
    single_text = f"{plain}://{auth}{at}{nodes[0]}/0" + (f"?{query}" if query else "")
    try:
        single = _parse_redis(single_text, text)
    except StoreSpecError as e:
        raise StoreSpecError(str(e).replace(single_text, part)) from None
    others = urlsplit(single.url).query  # left to redis-py, as for a single node
    url = f"{scheme.lower()}://{auth}{at}{','.join(nodes)}" + (f"?{others}" if others else "")
    return RedisClusterTierSpec(**{**{f.name: getattr(single, f.name) for f in fields(single)}, "url": url})


def _split_tiers(text: str) -> list[str]:
    """The spec's comma-separated tiers, keeping together the comma-separated seed nodes of a cluster URL (the
    parts after it that read HOST:PORT, up to its query string)."""
    parts: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        prev = parts[-1] if parts else ""
        host, _, port = part.partition("?")[0].partition("/")[0].rpartition(":")
        if (prev.lower().startswith(tuple(s + "://" for s in REDIS_CLUSTER_SCHEMES)) and "?" not in prev
                and port.isdigit() and host and host.lower() not in ("memory", "disk")):
            parts[-1] = f"{prev},{part}"
        else:
            parts.append(part)
    return parts


def parse_spec(text: str | None) -> StoreSpec:
    """Parse a store spec (None or "" -> DEFAULT_SPEC) without touching any tier.

    Raises:
        StoreSpecError: unknown tier, bad size, missing path/host, memory tier not first, duplicates.
    """
    text = (text or DEFAULT_SPEC).strip()
    tiers = []
    for part in _split_tiers(text):
        if not part:
            raise StoreSpecError(f"empty tier in store spec {text!r}; {SYNTAX}")
        scheme, _, rest = part.partition(":")
        scheme = scheme.lower()
        if scheme.partition("?")[0] in ("memory", "disk") and "?" in scheme:  # memory?kv=int8: options, no size
            scheme, rest = scheme.partition("?")[0], "?" + part.partition("?")[2]
        if scheme == "memory":
            tiers.append(_parse_memory(rest, text))
        elif scheme == "disk":
            tiers.append(_parse_disk(rest, text))
        elif scheme in REDIS_SCHEMES:
            tiers.append(_parse_redis(part, text))
        elif scheme in REDIS_CLUSTER_SCHEMES:
            tiers.append(_parse_redis_cluster(part, text))
        else:
            raise StoreSpecError(f"unknown store tier {scheme!r} in {text!r}; {SYNTAX}")
    return StoreSpec(tuple(tiers), text)


def build_tier(t, must_reach: bool = True):
    """Construct one tier; raises StoreUnavailableError when it cannot be used (see each tier), or, without
    `must_reach`, gives it down (its `start_error` says why; it is retried as a tier failing mid-run is)."""
    if isinstance(t, MemoryTierSpec):
        from ragkv.store.memory import MemoryStore
        tier = MemoryStore(t.capacity_bytes)
    elif isinstance(t, DiskTierSpec):
        from ragkv.store.disk import DiskStore
        tier = DiskStore(t.path, t.capacity_bytes, must_reach=must_reach)
    elif isinstance(t, RedisTierSpec):
        from ragkv.store.redis_cluster import RedisClusterStore
        from ragkv.store.redis_store import DEFAULT_PREFIX, RedisStore
        # a cluster: the same store through the cluster client, with hash-tagged keys
        store_class = RedisClusterStore if isinstance(t, RedisClusterTierSpec) else RedisStore
        tier = store_class(t.url, ttl_s=t.ttl_s, prefix=t.prefix if t.prefix is not None else DEFAULT_PREFIX,
                           must_reach=must_reach)
    else:
        raise TypeError(f"not a tier spec: {t!r}")
    from ragkv.store.compress import codec_named

    tier.cost = t.cost
    tier.kv_codec = codec_named(t.kv)
    return tier


def open_store(spec: str | StoreSpec | None = None, pipelined: bool = True, promote: bool = True,
               write_back: bool = False, must_reach: bool = True) -> "TieredStore":
    """A TieredStore from a spec string (None -> DEFAULT_SPEC).

    `must_reach=False` (a server: start degraded, not down): a tier that cannot be used now (Redis down, a disk
    not writable) starts as a tier that fails mid-run does: counted as a fault, logged once, skipped with backoff
    and retried; the other tiers serve meanwhile. Only a malformed spec stops the start.

    Raises:
        StoreSpecError: the spec does not parse.
        StoreUnavailableError: a tier cannot be used (unwritable directory, unreachable Redis), with must_reach.
    """
    parsed = spec if isinstance(spec, StoreSpec) else parse_spec(spec)
    from ragkv.store.tiered import TieredStore  # torch: only when a store is opened

    store = TieredStore([build_tier(t, must_reach) for t in parsed.tiers], pipelined=pipelined, promote=promote,
                        write_back=write_back)
    for i, tier in enumerate(store.tiers):
        if getattr(tier, "start_error", None) is not None:
            store.fault(i, "start", tier.start_error)
    return store
