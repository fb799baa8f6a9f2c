"""The KV memory budget of a server: before its prefill, a generation reserves the most KV its sequences can hold
(the prompt's rows once, shared by its n choices, plus each choice's own rows up to its token budget); one that
cannot fit now waits, one that could never fit is refused. What the caches really hold is `kvcache.live_bytes()`.

Freed KV goes back to the system, not only to the allocator: glibc keeps freed heap pages for reuse (measured: a
server that had served abandoned n=8 streams kept 1.4 GB more RSS than at start until `malloc_trim` ran), so after
large releases the process trims its heap (`give_back`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import threading
import time

from ragkv.engine.kv.kvcache import live_bytes

TRIM_AFTER_BYTES = 64 << 20  # freed KV since the last trim worth trimming for while busy
TRIM_EVERY_S = 2.0           # at most this often while busy (a trim walks the heap: milliseconds)
# after a trim, a few more while idle: what is freed after the requests end (their responses, a cancelled stream's
# cycle, a finished ingest) stayed in the heap until the next request (the soak's RSS sat 14% over its level for 30 s)
IDLE_RETRIMS, IDLE_RETRIM_S = 3, 5.0


def kv_need(bytes_per_token: int, prompt_rows: int, max_new_tokens: int, n: int = 1) -> int:
    """Bytes a generation may hold at most: the prompt's rows once (shared by its choices) plus, per choice, one
    row per token it may generate."""
    return bytes_per_token * (prompt_rows + max(n, 1) * max(max_new_tokens, 0))


def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


_TRIM = _malloc_trim()


def freeze_long_lived() -> None:
    """Exclude what exists now (the model, the tokenizer, imported modules) from every later garbage collection.
    A full collection walked those ~340K objects for ~150 ms holding the GIL (Qwen 0.5B server, Zen 4): the idle
    collection in `give_back` then delayed the next request's parsing by that much (about 40% of a `reuse` TTFT),
    and the automatic ones paused decode steps. After this a full collection takes ~0 ms; objects made later are
    still collected."""
    gc.collect()
    gc.freeze()


def give_back(collect: bool = False) -> None:
    """Return freed heap pages to the system (glibc `malloc_trim`); `collect`: first free what only reference
    cycles still hold (an abandoned stream's objects sit in one until a full collection)."""
    if collect:
        gc.collect()
    if _TRIM is not None:
        _TRIM(0)


class KVBudget:
    """Reservations against a byte limit (None: no limit). Thread-safe: the model thread reserves and releases,
    the HTTP threads read the figures."""

    def __init__(self, limit_bytes: int | None = None):
        self.limit = limit_bytes
        self.reserved = 0
        self._lock = threading.Lock()
        self._freed = 0  # released since the last trim
        self._last_trim = time.monotonic()
        self._retrims = 0  # idle trims still to come after the last one

    def fits_ever(self, nbytes: int) -> bool:
        return self.limit is None or nbytes <= self.limit

    def try_reserve(self, nbytes: int) -> bool:
        """Reserve `nbytes` if they fit beside the current reservations (always, when nothing is reserved)."""
        with self._lock:
            if self.limit is not None and self.reserved and self.reserved + nbytes > self.limit:
                return False
            self.reserved += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.reserved = max(0, self.reserved - nbytes)
            self._freed += nbytes

    def maybe_give_back(self, idle: bool) -> bool:
        """Trim the heap after a release: at once when the server went idle (with a full garbage collection, which
        nobody waits for then), else once enough was freed and not too recently; then IDLE_RETRIMS more times, every
        IDLE_RETRIM_S, while it stays idle. Returns whether it trimmed."""
        with self._lock:
            now = time.monotonic()
            if not self._freed:
                if not (idle and self._retrims and now - self._last_trim >= IDLE_RETRIM_S):
                    return False
                self._retrims -= 1
            elif not idle and (self._freed < TRIM_AFTER_BYTES or now - self._last_trim < TRIM_EVERY_S):
                return False
            else:
                self._retrims = IDLE_RETRIMS
            self._freed, self._last_trim = 0, now
        give_back(collect=idle)
        return True

    def stats(self) -> dict:
        return {"kv_bytes_limit": self.limit, "kv_bytes_reserved": self.reserved, "kv_bytes_in_use": live_bytes()}
