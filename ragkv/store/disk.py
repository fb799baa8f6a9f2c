"""Disk tier: one file per block, written atomically, least-recently-used by bytes across restarts.

Files are `<digest>.kv` in one directory, in the serde format. A writer fills a temp file in the same directory
and renames it over the target (os.replace), so readers in any thread or process see either no entry or a whole
one. Recency is the file's mtime, refreshed on every hit, so the LRU order survives restarts and is shared by
all processes using the directory. A corrupt or truncated file is logged, deleted and reported as a miss.

A write or read the file system refuses (disk full, read-only, I/O error) is a miss too, counted in
`counters["errors"]`, which a TieredStore turns into a fault of the tier (counted, skipped with backoff). A
directory deleted under the tier holds nothing (its bytes read 0) and is made again by the next write.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
import threading
import time
from pathlib import Path

from ragkv.store import serde
from ragkv.store.base import CacheKey, KVStore, LayerReader, namespace_of, storage_name
from ragkv.store.compress import Codec, codec_named
from ragkv.store.errors import CorruptEntryError, StoreUnavailableError
from ragkv.store.sizes import format_size

log = logging.getLogger(__name__)

SUFFIX = ".kv"
ENTRY_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*-[0-9a-f]{40}\.kv")  # storage_name(key) + SUFFIX
TEMP_PREFIX = ".tmp-"
STALE_TEMP_S = 3600  # temp files older than this are leftovers of a crashed writer


class DiskStore(KVStore):
    """Blocks as files under `path`, at most `capacity_bytes` in total (file sizes).

    Args:
        path: directory (created if missing; `~` expanded).
        capacity_bytes: evict least recently used files beyond this.
        fsync: flush each file to the device before renaming it (durable across power loss; slower).
        kv: write blocks compressed with this codec (int8, int4, fp8: ragkv.store.compress); None: as they are.
        must_reach: refuse to start on a directory that cannot be written (raise); False: start with the tier
            failing (`start_error` says why) until it can be written.

    Raises:
        StoreUnavailableError: the directory cannot be created or written (with must_reach).
    """

    name = "disk"
    kv_codec: Codec | None = None

    def __init__(self, path: str | os.PathLike, capacity_bytes: int, fsync: bool = False, kv: str | None = None,
                 must_reach: bool = True):
        if capacity_bytes <= 0:
            raise ValueError(f"disk tier capacity must be positive, got {capacity_bytes}")
        self.root = Path(path).expanduser()
        self.capacity_bytes, self.fsync = capacity_bytes, fsync
        self.kv_codec = codec_named(kv)
        self.counters = dict(hits=0, misses=0, puts=0, evictions=0, refused=0, corrupt=0, errors=0)
        self.last_error = ""
        self.start_error: StoreUnavailableError | None = None
        try:
            self._check_writable()
        except StoreUnavailableError as e:
            if must_reach:
                raise
            self.start_error = e
            self._error(str(e))
        self._lock = threading.Lock()
        self._index: dict[str, tuple[int, int]] = {}  # storage name -> (bytes, mtime_ns)
        self._bytes = 0
        self._last_ns = 0
        try:
            self._rescan(remove_stale_temps=True)
        except OSError as e:  # an unreadable directory (must_reach=False): nothing held yet
            self._error(f"cannot list {self.root}: {e}")

    def _error(self, message: str) -> None:
        """A failed write or read: a miss for the caller, a fault for the TieredStore that watches `errors`."""
        self.counters["errors"] += 1
        self.last_error = message

    def describe(self) -> str:
        return f"disk:{self.root}:{format_size(self.capacity_bytes)}" + (
            f"?kv={self.kv_codec.name}" if self.kv_codec else "")

    def _check_writable(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=self.root, prefix=TEMP_PREFIX, suffix=".probe")
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise StoreUnavailableError(
                f"KV store directory {self.root} is not usable ({e.strerror or e}); fix its permissions or "
                "choose another directory in --store disk:PATH:SIZE") from e

    def _path(self, name: str) -> Path:
        return self.root / (name + SUFFIX)

    # --- index and eviction -------------------------------------------------------------------------------

    def _rescan(self, remove_stale_temps: bool = False) -> None:
        """Rebuild the index from the directory (other processes add and evict files too)."""
        index, now = {}, time.time()
        try:
            it = os.scandir(self.root)
        except FileNotFoundError:  # the directory was deleted: it holds nothing (a write makes it again)
            it = None
        with it if it is not None else contextlib.nullcontext(()) as it:
            for entry in it:
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                if ENTRY_RE.fullmatch(entry.name):  # never touch files ragkv did not write
                    index[entry.name[:-len(SUFFIX)]] = (st.st_size, st.st_mtime_ns)
                elif remove_stale_temps and entry.name.startswith(TEMP_PREFIX) and now - st.st_mtime > STALE_TEMP_S:
                    _unlink(entry.path)
        with self._lock:
            self._index = index
            self._bytes = sum(size for size, _ in index.values())

    def _make_room(self, incoming: int) -> None:
        if self._bytes + incoming <= self.capacity_bytes:
            return
        self._rescan()
        with self._lock:
            for name, (size, _) in sorted(self._index.items(), key=lambda kv: kv[1][1]):
                if self._bytes + incoming <= self.capacity_bytes:
                    break
                _unlink(self._path(name))
                del self._index[name]
                self._bytes -= size
                self.counters["evictions"] += 1

    def _remember(self, name: str, size: int, mtime_ns: int) -> None:
        with self._lock:
            old = self._index.get(name)
            self._bytes += size - (old[0] if old else 0)
            self._index[name] = (size, mtime_ns)

    def _forget(self, name: str) -> None:
        with self._lock:
            old = self._index.pop(name, None)
            if old:
                self._bytes -= old[0]

    def _now_ns(self) -> int:
        # explicit, strictly increasing stamps: the kernel's own file times are coarse (ms ticks), which
        # would leave blocks written in quick succession unordered
        with self._lock:
            self._last_ns = max(time.time_ns(), self._last_ns + 1)
            return self._last_ns

    def _touch(self, name: str, size: int) -> None:
        now = self._now_ns()
        try:
            os.utime(self._path(name), ns=(now, now))
        except OSError:
            return  # evicted meanwhile: the read already succeeded
        self._remember(name, size, now)

    def _discard(self, name: str, ino: int, err: CorruptEntryError) -> None:
        """Delete a bad file, unless another writer already replaced it with a new one."""
        log.warning("disk tier: dropping entry %s in %s: %s; it will be recomputed", name, self.root, err)
        self.counters["corrupt"] += 1
        path = self._path(name)
        try:
            if os.stat(path).st_ino == ino:
                _unlink(path)
        except FileNotFoundError:
            pass
        self._forget(name)

    # --- reads --------------------------------------------------------------------------------------------

    def _read_failed(self, name: str, e: OSError) -> None:
        log.warning("disk tier: cannot read %s: %s; treating it as a miss", self._path(name), e)
        self._error(f"read of {name} failed: {e}")

    def _open(self, key: CacheKey):
        """(file, header, size) for a valid entry of `key`, or None (corrupt files are discarded)."""
        name = storage_name(key)
        try:
            f = open(self._path(name), "rb", buffering=0)
        except OSError as e:
            if not isinstance(e, FileNotFoundError):
                self._read_failed(name, e)
            return None
        try:
            st = os.fstat(f.fileno())
            head = f.read(serde.HEADER_PROBE)
            need = serde.header_length(head)
            if need > len(head):
                head += f.read(need - len(head))
            h = serde.parse_header(head)
            h.check_key(key)
            if st.st_size != h.total_nbytes:
                raise CorruptEntryError(f"file is {st.st_size} bytes, expected {h.total_nbytes} (truncated?)")
            return f, h, st
        except CorruptEntryError as e:
            f.close()
            self._discard(name, st.st_ino, e)
            return None

    def get(self, key):
        name = storage_name(key)
        try:
            with open(self._path(name), "rb", buffering=0) as f:
                st = os.fstat(f.fileno())
                data = bytearray(st.st_size)
                n = f.readinto(data)
                if n != len(data):
                    data = data[:n]
        except OSError as e:
            if not isinstance(e, FileNotFoundError):
                self._read_failed(name, e)
            self.counters["misses"] += 1
            return None
        try:
            kv = serde.decode(data, key)
        except CorruptEntryError as e:
            self._discard(name, st.st_ino, e)
            self.counters["misses"] += 1
            return None
        self._touch(name, st.st_size)
        self.counters["hits"] += 1
        return kv

    def contains(self, key):
        opened = self._open(key)
        if opened is None:
            return False
        opened[0].close()
        return True

    def open_layers(self, key):
        opened = self._open(key)
        if opened is None:
            self.counters["misses"] += 1
            return None
        f, h, st = opened
        self._touch(storage_name(key), st.st_size)
        self.counters["hits"] += 1
        return DiskLayerReader(self, key, f, h, st.st_ino)

    # --- writes -------------------------------------------------------------------------------------------

    def put(self, key, kv):
        name = storage_name(key)
        opened = self._open(key)
        if opened is not None:  # same key -> same bytes: refresh recency only
            opened[0].close()
            self._touch(name, opened[2].st_size)
            return
        data = serde.encode(key, kv, self.kv_codec)
        if len(data) > self.capacity_bytes:
            log.warning("disk tier: block %s (%s) exceeds the tier's whole capacity (%s); not written. Raise the "
                        "disk size in --store.", name, format_size(len(data)), format_size(self.capacity_bytes))
            self.counters["refused"] += 1
            return
        self._make_room(len(data))
        tmp = None
        try:
            try:
                fd, tmp = tempfile.mkstemp(dir=self.root, prefix=TEMP_PREFIX, suffix=".part")
            except FileNotFoundError:  # the directory was deleted under the tier: made again
                self.root.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=self.root, prefix=TEMP_PREFIX, suffix=".part")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            now = self._now_ns()
            os.utime(tmp, ns=(now, now))
            os.replace(tmp, self._path(name))
        except OSError as e:  # disk full, read-only...: the block stays uncached here, and the tier failed
            log.warning("disk tier: could not write %s to %s: %s", name, self.root, e)
            self._error(f"write of {name} failed: {e}")
            if tmp is not None:
                _unlink(tmp)
            return
        self._remember(name, len(data), now)
        self.counters["puts"] += 1

    def delete(self, key):
        name = storage_name(key)
        self._forget(name)
        return _unlink(self._path(name))

    def clear(self, namespace=None):
        self._rescan()
        n = 0
        for name in list(self._index):
            if namespace is None or namespace_of(name) == namespace:
                n += _unlink(self._path(name))
                self._forget(name)
        return n

    def drop_page_cache(self, key: CacheKey) -> None:
        """Ask the OS to forget the file's cached pages (best effort), so a timed read hits the device."""
        path = self._path(storage_name(key))
        if not hasattr(os, "posix_fadvise"):
            return
        try:
            with open(path, "rb") as f:
                os.fsync(f.fileno())
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass

    def entries(self) -> list[tuple[str, int]]:
        """(storage name, bytes) from least to most recently used, as found on disk now."""
        self._rescan()
        with self._lock:
            return [(n, s) for n, (s, _) in sorted(self._index.items(), key=lambda kv: kv[1][1])]

    def stats(self):
        namespaces: dict[str, dict] = {}
        error = {}
        try:
            listed = self.entries()  # what the directory holds now, whoever wrote or deleted its files
        except OSError as e:  # unreadable: nothing this tier can serve
            self._error(f"cannot list {self.root}: {e}")
            listed, error = [], {"error": self.last_error}
        for name, size in listed:
            ns = namespaces.setdefault(namespace_of(name), {"entries": 0, "bytes": 0})
            ns["entries"] += 1
            ns["bytes"] += size
        return {"tier": self.name, "describe": self.describe(), "path": str(self.root), "entries": len(listed),
                "kv": self.kv_codec.name if self.kv_codec else "none",
                "bytes": sum(s for _, s in listed), "capacity_bytes": self.capacity_bytes,
                "namespaces": namespaces, **self.counters, **error}


class DiskLayerReader(LayerReader):
    """Reads single layers of one open file with seek + readinto (the file stays valid even if it is replaced
    or evicted meanwhile: the open handle keeps its inode)."""

    def __init__(self, store: DiskStore, key: CacheKey, f, header: serde.EntryHeader, ino: int):
        super().__init__(key, header.num_layers)
        self.store, self.f, self.header, self.ino = store, f, header, ino

    def read(self, layer):
        start, stop = self.header.layer_span(layer)
        buf = bytearray(stop - start)
        try:
            self.f.seek(start)
            n = self.f.readinto(buf)
            return serde.decode_layer(self.header, layer, buf if n == len(buf) else buf[:n])
        except CorruptEntryError as e:
            self.store._discard(storage_name(self.key), self.ino, e)
            return None
        except OSError as e:  # an I/O error mid-read: the block comes from a slower tier or is computed
            self.store._read_failed(storage_name(self.key), e)
            return None

    def close(self):
        self.f.close()


def _unlink(path) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
