"""In-process tier: least-recently-used eviction bounded by bytes, safe to share between threads."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

from ragkv.store.base import BlockKV, BlockLayerReader, CacheKey, KVStore, LayerReader, check_namespace
from ragkv.store.compress import Codec, CompressedKV, codec_named
from ragkv.store.sizes import format_size

log = logging.getLogger(__name__)


class MemoryStore(KVStore):
    """Holds BlockKV objects (no serialization) up to `capacity_bytes` of tensor data (None: unbounded, for
    tests and short-lived tools).

    An entry larger than the whole capacity is refused with a warning instead of evicting everything. With `kv`
    (int8, int4, fp8: ragkv.store.compress), blocks are kept compressed on their own device and decompressed when
    read; capacity counts the compressed bytes.
    """

    name = "memory"
    kv_codec: Codec | None = None

    def __init__(self, capacity_bytes: int | None = None, kv: str | None = None):
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError(f"memory tier capacity must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes if capacity_bytes is not None else float("inf")
        self.kv_codec = codec_named(kv)
        self._data: OrderedDict[CacheKey, BlockKV | CompressedKV] = OrderedDict()
        self._bytes = 0
        self._lock = threading.RLock()
        self.counters = dict(hits=0, misses=0, puts=0, evictions=0, refused=0)

    def snapshot(self) -> tuple:
        """What the store holds now (the entries are shared, not copied), for `restore`: a benchmark repeats a
        request from the same cache state."""
        with self._lock:
            return OrderedDict(self._data), self._bytes

    def restore(self, snap: tuple) -> None:
        with self._lock:
            data, self._bytes = snap
            self._data = OrderedDict(data)

    def describe(self) -> str:
        size = "memory" if self.capacity_bytes == float("inf") else f"memory:{format_size(self.capacity_bytes)}"
        return size + (f"?kv={self.kv_codec.name}" if self.kv_codec else "")

    def _lookup(self, key) -> BlockKV | CompressedKV | None:
        with self._lock:
            kv = self._data.get(key)
            if kv is None:
                self.counters["misses"] += 1
                return None
            self._data.move_to_end(key)
            self.counters["hits"] += 1
            return kv

    def get(self, key):
        kv = self._lookup(key)
        return kv.decompress() if isinstance(kv, CompressedKV) else kv

    def open_layers(self, key):
        kv = self._lookup(key)
        if isinstance(kv, CompressedKV):
            return CompressedLayerReader(key, kv)
        return None if kv is None else BlockLayerReader(key, kv)

    def put(self, key, kv):
        check_namespace(key.namespace)
        if self.kv_codec is not None:
            kv = self.kv_codec.compress(kv)
        size = kv.nbytes
        if size > self.capacity_bytes:
            log.warning("memory tier: block %s (%s) exceeds the tier's whole capacity (%s); not cached in memory. "
                        "Raise the memory size in --store.", key.digest(), format_size(size),
                        format_size(self.capacity_bytes))
            self.counters["refused"] += 1
            return
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            while self._data and self._bytes + size > self.capacity_bytes:
                _, evicted = self._data.popitem(last=False)
                self._bytes -= evicted.nbytes
                self.counters["evictions"] += 1
            self._data[key] = kv
            self._bytes += size
            self.counters["puts"] += 1

    def contains(self, key):
        with self._lock:
            return key in self._data

    def delete(self, key):
        with self._lock:
            kv = self._data.pop(key, None)
            if kv is None:
                return False
            self._bytes -= kv.nbytes
            return True

    def clear(self, namespace=None):
        with self._lock:
            doomed = [k for k in self._data if namespace is None or k.namespace == namespace]
            for k in doomed:
                self._bytes -= self._data.pop(k).nbytes
            return len(doomed)

    def entries(self) -> list[tuple[CacheKey, int]]:
        """(key, bytes) from least to most recently used."""
        with self._lock:
            return [(k, kv.nbytes) for k, kv in self._data.items()]

    def stats(self):
        namespaces: dict[str, dict] = {}
        for key, size in self.entries():
            ns = namespaces.setdefault(key.namespace, {"entries": 0, "bytes": 0})
            ns["entries"] += 1
            ns["bytes"] += size
        with self._lock:
            return {"tier": self.name, "describe": self.describe(), "entries": len(self._data),
                    "bytes": self._bytes, "kv": self.kv_codec.name if self.kv_codec else "none",
                    "capacity_bytes": None if self.capacity_bytes == float("inf") else self.capacity_bytes, "namespaces": namespaces,
                    **self.counters}


class CompressedLayerReader(LayerReader):
    """Decompresses one layer at a time where the block is kept (work a prefetch thread can overlap)."""

    def __init__(self, key: CacheKey, kv: CompressedKV):
        super().__init__(key, kv.num_layers)
        self.kv = kv

    def read(self, layer):
        return self.kv.layer(layer)
