"""Redis tier: blocks shared by several ragkv servers on several machines.

Values are the serde bytes under `prefix + digest`, with an optional TTL refreshed on every hit. One layer is
read alone with GETRANGE. Capacity is Redis's own business (maxmemory + an eviction policy such as allkeys-lru).
A Redis outage degrades to misses with a warning; it never fails a request. With `must_reach=False` (a server's
store) that holds from the start too: a Redis down at start is a tier that fails until it answers (`start_error`
says why), the client connecting at its first use after that.
"""

from __future__ import annotations

import logging
import re
import time
from urllib.parse import urlsplit, urlunsplit

import redis

from ragkv.store import serde
from ragkv.store.base import CacheKey, KVStore, LayerReader, check_namespace, namespace_of, storage_name
from ragkv.store.compress import Codec, codec_named
from ragkv.store.errors import CorruptEntryError, StoreUnavailableError

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "ragkv:kv:"


def redact(url: str) -> str:
    """The URL without its password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    hosts = parts.netloc.rpartition("@")[2]  # kept verbatim: a cluster URL lists several host:port
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{hosts}"))


def _glob_escape(text: str) -> str:
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)


class RedisStore(KVStore):
    """Blocks in a Redis database.

    Args:
        url: redis://[[user]:password@]host:port/db (also rediss://, unix://).
        ttl_s: expire entries this many seconds after their last hit (None: never).
        prefix: prepended to every key, so several deployments can share one database.
        timeout_s: connect and socket timeout.
        must_reach: refuse to start without Redis (raise); False: start with the tier down (`start_error`).

    Raises:
        StoreUnavailableError: Redis cannot be reached or refuses the connection at construction (must_reach).
    """

    name = "redis"
    ERRORS: tuple = (redis.exceptions.RedisError,)  # what the client raises when the tier fails: a miss

    kv_codec: Codec | None = None  # write blocks compressed (int8, int4, fp8: ragkv.store.compress)

    def __init__(self, url: str, ttl_s: int | None = None, prefix: str = DEFAULT_PREFIX, timeout_s: float = 5.0,
                 kv: str | None = None, must_reach: bool = True):
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"redis ttl must be a positive number of seconds, got {ttl_s}")
        self.url, self.ttl_s, self.prefix, self.timeout_s = url, ttl_s, prefix, timeout_s
        self.kv_codec = codec_named(kv)
        self.counters = dict(hits=0, misses=0, puts=0, corrupt=0, errors=0)
        self.last_error, self._last_warning = "", -1e9
        self._client = None
        self.start_error: StoreUnavailableError | None = None
        try:
            self.client.ping()
        except self.ERRORS + (OSError, ValueError) as e:
            err = self._unreachable(e)
            if must_reach:
                raise err from e
            self.start_error = err  # down from the start: a tier failing like one failing mid-run
            self.counters["errors"] += 1
            self.last_error = str(err)

    @property
    def client(self):
        """The client, connected at first use: a cluster whose seed nodes are down at start is reached later.
        Raises one of ERRORS while it cannot be made."""
        if self._client is None:
            self._client = self._connect(self.url, self.timeout_s)
        return self._client

    @client.setter
    def client(self, client) -> None:
        self._client = client

    def _connect(self, url: str, timeout_s: float):
        return redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)

    def _unreachable(self, e: Exception) -> StoreUnavailableError:
        """What failing to reach Redis at start means, and what to do."""
        if isinstance(e, (redis.exceptions.AuthenticationError, redis.exceptions.ResponseError)):
            return StoreUnavailableError(
                f"Redis at {redact(self.url)} refused ragkv ({e}); put the password in the URL "
                "(redis://:PASSWORD@HOST:PORT/DB) or check the database number")
        return StoreUnavailableError(
            f"cannot reach Redis at {redact(self.url)} ({e}); is redis-server running? Start it, install it with "
            "scripts/install_redis.sh, or remove the redis tier from --store")

    def describe(self) -> str:
        opts = ([f"prefix={self.prefix}"] if self.prefix != DEFAULT_PREFIX else []) + (
            [f"kv={self.kv_codec.name}"] if self.kv_codec else [])
        return redact(self.url) + ("?" + "&".join(opts) if opts else "")

    def _name(self, key: CacheKey) -> str:
        return self.prefix + storage_name(key)

    def _failed(self, what: str, err: Exception) -> None:
        """A failure is a miss for the caller; a TieredStore sees `errors` grow, counts the fault and backs off."""
        self.counters["errors"] += 1
        self.last_error = f"{what} failed: {err}"
        now = time.monotonic()
        if now - self._last_warning > 60:  # once per outage (and a minute), not once per call
            self._last_warning = now
            log.warning("redis tier %s: %s failed (%s); treating it as a miss", redact(self.url), what, err)

    def _discard(self, name: str, err: CorruptEntryError) -> None:
        log.warning("redis tier: dropping entry %s: %s; it will be recomputed", name, err)
        self.counters["corrupt"] += 1
        try:
            self.client.delete(name)
        except self.ERRORS as e:
            self._failed("delete", e)

    def _header(self, name: str, key: CacheKey) -> serde.EntryHeader | None:
        """Validated header of `name` for `key`, or None (missing; corrupt entries are discarded)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.getrange(name, 0, serde.HEADER_PROBE - 1)
        pipe.strlen(name)
        try:
            head, size = pipe.execute()
        except redis.exceptions.ResponseError as e:  # WRONGTYPE: not a string, so not one of our entries
            if "WRONGTYPE" not in str(e):  # CLUSTERDOWN, READONLY, OOM...: the tier failed, the entry is fine
                raise
            self._discard(name, CorruptEntryError(f"holds a non-string value ({e})"))
            return None
        if size == 0:
            return None
        try:
            need = serde.header_length(head)
            if need > len(head):
                head = self.client.getrange(name, 0, need - 1)
            h = serde.parse_header(head)
            h.check_key(key)
            if size != h.total_nbytes:
                raise CorruptEntryError(f"value is {size} bytes, expected {h.total_nbytes} (truncated?)")
            return h
        except CorruptEntryError as e:
            self._discard(name, e)
            return None

    def get(self, key):
        name = self._name(key)
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.get(name)
            if self.ttl_s:
                pipe.expire(name, self.ttl_s)
            data = pipe.execute()[0]
        except self.ERRORS as e:
            self._failed("get", e)
            return None
        if data is None:
            self.counters["misses"] += 1
            return None
        try:
            kv = serde.decode(data, key)
        except CorruptEntryError as e:
            self._discard(name, e)
            self.counters["misses"] += 1
            return None
        self.counters["hits"] += 1
        return kv

    def contains(self, key):
        try:
            return self._header(self._name(key), key) is not None
        except self.ERRORS as e:
            self._failed("contains", e)
            return False

    def open_layers(self, key):
        name = self._name(key)
        try:
            h = self._header(name, key)
            if h is not None and self.ttl_s:
                self.client.expire(name, self.ttl_s)
        except self.ERRORS as e:
            self._failed("open", e)
            return None
        self.counters["hits" if h is not None else "misses"] += 1
        return None if h is None else RedisLayerReader(self, key, name, h)

    def get_layer(self, key, layer):
        reader = self.open_layers(key)
        return None if reader is None else reader.read(layer)

    def put(self, key, kv):
        name = self._name(key)
        data = serde.encode(key, kv, self.kv_codec)
        try:
            # same key -> same bytes, so overwriting is harmless, and it replaces whatever else sits under the
            # name (an empty value, a list written by someone else) instead of leaving the block uncacheable
            if self.ttl_s:
                self.client.set(name, memoryview(data), ex=self.ttl_s)
            else:  # keep a TTL another server set on the same entry
                self.client.set(name, memoryview(data), keepttl=True)
        except self.ERRORS as e:
            self._failed("put", e)
            return
        self.counters["puts"] += 1

    def delete(self, key):
        try:
            return bool(self.client.delete(self._name(key)))
        except self.ERRORS as e:
            self._failed("delete", e)
            return False

    def _names(self, namespace: str | None = None) -> list[str]:
        pattern = _glob_escape(self.prefix) + (check_namespace(namespace) + "-*" if namespace else "*")
        return [n.decode() for n in self.client.scan_iter(match=pattern, count=1000)]

    def clear(self, namespace=None):
        names, n = self._names(namespace), 0
        for i in range(0, len(names), 500):
            n += self.client.unlink(*names[i:i + 500])
        return n

    def entries(self) -> list[tuple[str, int]]:
        """(storage name without prefix, bytes) of every entry under this prefix."""
        names = self._names()
        pipe = self.client.pipeline(transaction=False)
        for n in names:
            pipe.strlen(n)
        sizes = pipe.execute() if names else []
        return [(n[len(self.prefix):], s) for n, s in zip(names, sizes) if s]

    def stats(self):
        try:
            listed = self.entries()
        except self.ERRORS as e:  # a /metrics scrape while Redis is down: nothing reachable is held here
            self._failed("stats", e)
            return {"tier": self.name, "describe": self.describe(), "ttl_s": self.ttl_s, "entries": 0, "bytes": 0,
                    "error": self.last_error, **self.counters}
        namespaces: dict[str, dict] = {}
        for name, size in listed:
            ns = namespaces.setdefault(namespace_of(name), {"entries": 0, "bytes": 0})
            ns["entries"] += 1
            ns["bytes"] += size
        return {"tier": self.name, "describe": self.describe(), "entries": len(listed),
                "bytes": sum(s for _, s in listed), "ttl_s": self.ttl_s, "namespaces": namespaces,
                "kv": self.kv_codec.name if self.kv_codec else "none", **self.counters}


class RedisLayerReader(LayerReader):
    """GETRANGE per layer; `read_many` fetches one layer of several blocks in a single round trip."""

    def __init__(self, store: RedisStore, key: CacheKey, name: str, header: serde.EntryHeader):
        super().__init__(key, header.num_layers)
        self.store, self.name, self.header = store, name, header

    def read(self, layer):
        return self.read_many([self], layer)[0]

    def batch_group(self):
        return id(self.store)

    @staticmethod
    def read_many(readers: list["RedisLayerReader"], layer: int) -> list:
        if not readers:
            return []
        store = readers[0].store
        try:
            pipe = store.client.pipeline(transaction=False)
            for r in readers:
                start, stop = r.header.layer_span(layer)
                pipe.getrange(r.name, start, stop - 1)
            chunks = pipe.execute()
        except store.ERRORS as e:
            store._failed("layer read", e)
            return [None] * len(readers)
        return [r._decode(layer, chunk) for r, chunk in zip(readers, chunks)]

    def _decode(self, layer, chunk):
        try:
            if len(chunk) != self.header.layer_nbytes and not self.store.client.exists(self.name):
                return None  # expired or evicted since it was opened: a plain miss
            return serde.decode_layer(self.header, layer, chunk)
        except CorruptEntryError as e:
            self.store._discard(self.name, e)
            return None
        except self.store.ERRORS as e:
            self.store._failed("layer read", e)
            return None
