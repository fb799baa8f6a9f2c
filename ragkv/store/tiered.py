"""Tiers composed fastest first: read-through with promotion, write-through, pipelined per-layer loading."""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from typing import Sequence

import torch

from ragkv.store.base import BlockKV, CacheKey, KVStore, LayerReader, check_namespace
from ragkv.store.errors import MissingBlockError, StoreError
from ragkv.store.staging import Stager

log = logging.getLogger(__name__)

MIN_BACKOFF_S, MAX_BACKOFF_S = 1.0, 60.0  # a failing tier is retried after 1, 2, 4, ... 60 s
WRITE_BACK_QUEUE = 256  # blocks waiting for the slower tiers; beyond it `put` writes them itself


class TieredStore(KVStore):
    """Several tiers behind one KVStore, fastest first (memory, disk, redis).

    Args:
        tiers: the tiers, fastest first.
        pipelined: `iter_layers` prefetches layer i+1 in a background thread while the caller computes on
            layer i (CacheBlend sec. 5); False reads each layer when asked (benchmark baseline).
        promote: a hit in a slower tier is copied into every faster tier.
        write_back: `put` writes the fastest tier now and the slower ones from a background thread (CacheBlend
            writes new KV back asynchronously), so a request never waits for a slow disk or a remote Redis. The
            queue is bounded (a full queue writes in the caller: slower, never lost); `flush()` waits for it,
            and runs at interpreter exit.
    """

    name = "tiered"

    def __init__(self, tiers: Sequence[KVStore], pipelined: bool = True, promote: bool = True,
                 write_back: bool = False):
        if not tiers:
            raise ValueError("a tiered store needs at least one tier")
        self.tiers, self.pipelined, self.promote = list(tiers), pipelined, promote
        self.write_back = write_back and len(self.tiers) > 1
        self._pending: queue.Queue | None = None  # (tier index, key, kv) for the writer thread
        self.counters = dict(misses=0, promotions=0, hits={t.describe(): 0 for t in self.tiers},
                             faults={t.describe(): 0 for t in self.tiers})
        self._down_until = [0.0] * len(self.tiers)  # a failing tier is skipped until then (backoff)
        self._backoff = [0.0] * len(self.tiers)

    # -- faults: a tier that raises is a miss for this call, then skipped with exponential backoff ----------
    def _up(self, i: int) -> bool:
        return time.monotonic() >= self._down_until[i]

    def fault(self, i: int, what: str, err: BaseException) -> None:
        """Tier i failed on `what`: counted, logged once per outage, skipped until its backoff ends."""
        t = self.tiers[i]
        self.counters["faults"][t.describe()] += 1
        first = self._backoff[i] == 0
        self._backoff[i] = min(MAX_BACKOFF_S, max(MIN_BACKOFF_S, 2 * self._backoff[i]))
        self._down_until[i] = time.monotonic() + self._backoff[i]
        if first:  # logged once per outage; the counter in /metrics keeps the count
            log.warning("store tier %s failed on %s (%s: %s); skipping it for %.0f s and retrying with backoff; "
                        "requests compute what it cannot give", t.describe(), what, type(err).__name__, err,
                        self._backoff[i])

    def _call(self, i: int, what: str, fn, default=None):
        if not self._up(i):
            return default
        tier = self.tiers[i]
        errors = _errors(tier)
        try:
            out = fn(tier)
        except Exception as e:  # noqa: BLE001 - any tier failure (OSError, Redis, a bug) degrades to a miss
            self.fault(i, what, e)
            return default
        if _errors(tier) > errors:  # a tier that turns its own failures into misses (Redis) failed all the same
            self.fault(i, what, RuntimeError(getattr(tier, "last_error", "the tier reported an error")))
            return default
        if self._backoff[i]:
            log.warning("store tier %s answers again", self.tiers[i].describe())
            self._backoff[i] = 0.0
        return out

    def describe(self) -> str:
        return ",".join(t.describe() for t in self.tiers)

    def tier(self, name: str) -> KVStore:
        """The tier whose kind (memory, disk, redis) or description is `name`."""
        for t in self.tiers:
            if name in (t.name, t.describe()):
                return t
        raise KeyError(f"no tier {name!r} in store {self.describe()}")

    def _promote(self, key: CacheKey, kv: BlockKV, found_at: int) -> None:
        # with tier costs, the loading controller places blocks; copying them up would undo its placement
        if not self.promote or any(getattr(t, "cost", None) is not None for t in self.tiers):
            return
        for i in range(found_at):
            self._call(i, "put", lambda t: t.put(key, kv))
        if found_at:
            self.counters["promotions"] += 1

    def get(self, key):
        check_namespace(key.namespace)
        for i, t in enumerate(self.tiers):
            kv = self._call(i, "get", lambda t: t.get(key))
            if kv is not None:
                self.counters["hits"][t.describe()] += 1
                self._promote(key, kv, i)
                return kv
        self.counters["misses"] += 1
        return None

    def put(self, key, kv, tiers: Sequence[int] | None = None):
        """Write to every tier (or only to the tier indices `tiers`: the loading controller's placement)."""
        check_namespace(key.namespace)
        if tiers is not None:
            first, rest = min(tiers), sorted(set(tiers) - {min(tiers)})
        else:
            first, rest = 0, range(1, len(self.tiers))
        self._call(first, "put", lambda t: t.put(key, kv))
        for i in rest:
            if not self.write_back:
                self._call(i, "put", lambda t: t.put(key, kv))
                continue
            try:
                self._writer().put_nowait((i, key, kv))
            except queue.Full:  # backpressure: write it here rather than drop it
                self._call(i, "put", lambda t: t.put(key, kv))

    def _writer(self) -> queue.Queue:
        if self._pending is None:
            self._pending = queue.Queue(maxsize=WRITE_BACK_QUEUE)
            threading.Thread(target=self._write_back, name="ragkv-write-back", daemon=True).start()
            atexit.register(self.flush)
        return self._pending

    def _write_back(self) -> None:
        while True:
            i, key, kv = self._pending.get()
            try:
                self._call(i, "put", lambda t: t.put(key, kv))
            finally:
                self._pending.task_done()

    def flush(self) -> None:
        """Wait until every queued write-back reached its tier."""
        if self._pending is not None:
            self._pending.join()

    def contains(self, key):
        return self.locate(key) is not None

    def locate(self, key: CacheKey) -> str | None:
        """Kind of the fastest tier holding `key` (memory, disk, redis), or None."""
        check_namespace(key.namespace)
        for i, t in enumerate(self.tiers):
            if self._call(i, "contains", lambda t: t.contains(key), False):
                return t.name
        return None

    def delete(self, key):
        return any([self._call(i, "delete", lambda t: t.delete(key), False) for i in range(len(self.tiers))])

    def clear(self, namespace=None):
        if namespace is not None:
            check_namespace(namespace)
        return sum(t.clear(namespace) for t in self.tiers)

    def open_layers(self, key):
        for i in range(len(self.tiers)):
            reader = self._call(i, "open", lambda t: t.open_layers(key))
            if reader is not None:
                return reader
        return None

    def holders(self, key: CacheKey) -> list[KVStore]:
        """Every tier that holds `key` now, fastest first."""
        check_namespace(key.namespace)
        return [t for i, t in enumerate(self.tiers) if self._call(i, "contains", lambda t: t.contains(key), False)]

    def iter_layers(self, keys, num_layers, tier: str | None = None,
                    tiers: Sequence[str] | None = None, device=None) -> "LayerStream":
        """Per layer, every key's (K [Hkv, T, D], V), in order. Readers open now (a missing block raises
        MissingBlockError at once); with `pipelined`, loading starts at once in a background thread.
        `tier` forces reading every block from that tier (benchmarks), `tiers` names one per block (the loading
        controller's load schedule); otherwise each block comes from its fastest tier. With `device`, each layer is
        copied there ahead of its use (ragkv.store.staging: pinned memory and a side stream on CUDA)."""
        for key in keys:
            check_namespace(key.namespace)
        if tiers is not None:
            start = [[self.tiers.index(self.tier(t))] for t in tiers]
        elif tier is not None:
            start = [[self.tiers.index(self.tier(tier))]] * len(keys)
        else:
            start = None
        fetcher = _Fetcher(self, list(keys), start, promote=self.promote and tier is None)
        short = [r.key.digest() for r in fetcher.readers if r.num_layers < num_layers]
        if short:
            fetcher.close()
            raise ValueError(f"{num_layers} layers requested but blocks {short} have fewer; their keys should "
                             "carry another model fingerprint")
        return LayerStream(fetcher, num_layers, self.pipelined and not fetcher.instant, Stager(device))

    def stats(self):
        return {"tiers": [self._tier_stats(i) for i in range(len(self.tiers))], "pipelined": self.pipelined,
                **self.counters, "write_back_pending": self.write_back_pending()}

    def _tier_stats(self, i: int) -> dict:
        """Tier i's own figures (its bytes from its real state), and whether it is in service (`up`: not skipped
        after a fault). A tier that cannot count holds nothing it could serve: 0 bytes, never a missing figure."""
        t = self.tiers[i]
        try:
            out = dict(t.stats())
        except Exception as e:  # noqa: BLE001 - a scrape must not fail with the tier
            out = {"tier": t.name, "describe": t.describe(), "error": f"{type(e).__name__}: {e}"}
        out.setdefault("bytes", 0)
        out.setdefault("entries", 0)
        out["up"] = self._up(i) and "error" not in out
        return out

    def write_back_pending(self) -> int:
        """New blocks queued for, or being written to, a slower tier."""
        return 0 if self._pending is None else self._pending.unfinished_tasks


def _errors(tier) -> int:
    counters = getattr(tier, "counters", None)
    return counters.get("errors", 0) if isinstance(counters, dict) else 0


class _Fetcher:
    """Reads one layer of every block, falling back to slower tiers when a reader fails part-way, and
    collects the layers of blocks found in slower tiers to promote them at the end."""

    def __init__(self, store: TieredStore, keys: list[CacheKey], only: list[list[int]] | None, promote: bool):
        self.store, self.keys = store, keys
        self.load_ms = 0.0
        self.readers: list[LayerReader] = []
        self.found_at: list[int] = []
        try:
            for j, key in enumerate(keys):
                reader, at = self._open(key, only[j] if only else range(len(store.tiers)))
                if reader is None:
                    raise MissingBlockError(f"block {key.digest()} is in no tier of {store.describe()}; "
                                            "encode it (store.put) before reading its layers")
                self.readers.append(reader)
                self.found_at.append(at)
                store.counters["hits"][store.tiers[at].describe()] += 1
        except BaseException:
            self.close()
            raise
        collect = promote
        self.layers = [[] if collect and at > 0 else None for at in self.found_at]
        self.instant = all(r.instant for r in self.readers)

    def _open(self, key, tier_ids) -> tuple[LayerReader | None, int]:
        for i in tier_ids:
            reader = self.store._call(i, "open", lambda t: t.open_layers(key))
            if reader is not None:
                return reader, i
        return None, -1

    def read(self, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        t0 = time.perf_counter()
        try:
            return self._read(layer)
        except StoreError:
            raise
        except Exception as e:  # noqa: BLE001 - a tier failing mid-read: the engine computes the blocks instead
            raise MissingBlockError(f"reading layer {layer} failed ({type(e).__name__}: {e})") from e
        finally:
            self.load_ms += (time.perf_counter() - t0) * 1000

    def _read(self, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        groups: dict[object, list[int]] = {}
        for j, r in enumerate(self.readers):
            groups.setdefault(r.batch_group(), []).append(j)
        out: list = [None] * len(self.readers)
        tiers = self.store.tiers
        errors = {at: _errors(tiers[at]) for at in set(self.found_at)}
        for idx in groups.values():
            rs = [self.readers[j] for j in idx]
            for j, kv in zip(idx, type(rs[0]).read_many(rs, layer)):
                out[j] = kv
        for at, before in errors.items():  # a layer read the tier failed (I/O error, Redis down): a fault too
            if _errors(tiers[at]) > before:
                self.store.fault(at, "layer read", RuntimeError(getattr(tiers[at], "last_error", "read failed")))
        for j, kv in enumerate(out):
            if kv is None:
                out[j] = self._fallback(j, layer)
            if self.layers[j] is not None:
                self.layers[j].append(out[j])
        return out

    def _fallback(self, j: int, layer: int):
        """Reader j failed at `layer` (evicted, expired, corrupt): continue from a slower tier."""
        key = self.keys[j]
        self.readers[j].close()
        reader, at = self._open(key, range(self.found_at[j] + 1, len(self.store.tiers)))
        kv = reader.read(layer) if reader is not None else None
        if kv is None:
            if reader is not None:
                reader.close()
            raise MissingBlockError(f"block {key.digest()} vanished from the store while its layers were read "
                                    f"(layer {layer}); encode it again")
        log.info("block %s: continuing from the %s tier at layer %d", key.digest(), self.store.tiers[at].name, layer)
        self.readers[j], self.found_at[j] = reader, at
        return kv

    def promote(self) -> None:
        for key, at, layers in zip(self.keys, self.found_at, self.layers):
            if layers:
                kv = BlockKV(torch.stack([k for k, _ in layers]), torch.stack([v for _, v in layers]))
                self.store._promote(key, kv, at)

    def close(self) -> None:
        for r in self.readers:
            r.close()


class LayerStream:
    """Iterator over layers returned by TieredStore.iter_layers.

    Pipelined (CacheBlend sec. 5): a background thread reads layer i+1 for every block while the caller
    computes on layer i, at most one finished layer ahead. `wait_ms` is the time the caller spent blocked on
    loading (near 0 when compute hides it); `load_ms` the time spent reading.
    """

    def __init__(self, fetcher: _Fetcher, num_layers: int, pipelined: bool, stager: Stager | None = None):
        self.fetcher, self.num_layers, self.pipelined = fetcher, num_layers, pipelined
        self.stager = stager or Stager(None)
        self.wait_ms = 0.0
        self._next = 0
        self._closed = False
        if pipelined:
            self._queue: queue.Queue = queue.Queue(maxsize=1)
            self._stop = threading.Event()
            # the thread must not reference the stream, so that dropping the stream stops the thread
            self._thread = threading.Thread(target=_produce, args=(fetcher, num_layers, self._queue, self._stop,
                                                                   self.stager),
                                            name="ragkv-layer-prefetch", daemon=True)
            self._thread.start()

    @property
    def load_ms(self) -> float:
        return self.fetcher.load_ms

    def __iter__(self):
        return self

    def __next__(self):
        if self._next >= self.num_layers or self._closed:
            raise StopIteration
        t0 = time.perf_counter()
        if self.pipelined:
            kind, value = self._queue.get()
            self.wait_ms += (time.perf_counter() - t0) * 1000
            if kind == "error":
                self.close()
                raise value
            value = self.stager.ready(value)
        else:
            try:
                value = self.stager.ready(self.stager.stage(self.fetcher.read(self._next)))
            except BaseException:
                self.close()
                raise
            self.wait_ms += (time.perf_counter() - t0) * 1000
            if self._next == self.num_layers - 1:
                self.fetcher.close()
                self.fetcher.promote()
        self._next += 1
        return value

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.pipelined:
            self._stop.set()
        else:
            self.fetcher.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _produce(fetcher: _Fetcher, num_layers: int, q: queue.Queue, stop: threading.Event, stager: Stager) -> None:
    """Prefetch thread: read every layer in order, hand each to the caller, then promote off its critical path."""

    def offer(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    try:
        for i in range(num_layers):
            item = ("layer", stager.stage(fetcher.read(i)))
            if i == num_layers - 1:
                fetcher.close()
            if not offer(item):
                return
        fetcher.promote()
    except BaseException as e:  # re-raised in the caller's thread
        offer(("error", e))
    finally:
        fetcher.close()
