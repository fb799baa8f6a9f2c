"""A scheduler's unit of work (a generation or a background job) and the errors that end one early."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Callable

from ragkv.errors import RagkvError
from ragkv.models.loop import Forward


class QueueFull(Exception):
    retry_after_s = 1  # what a 429 tells the client to wait


class JobTimeout(Exception):
    pass


class Cancelled(Exception):
    pass


class ShuttingDown(Exception):
    pass


class KVTooLarge(RagkvError):
    """A generation whose KV could never fit in the server's KV memory limit."""

    param, code = "max_tokens", "kv_memory_exceeded"


class LongPrefillsBusy(Exception):
    """A 429: the long prefills already admitted would keep this one from ending before its deadline."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Job:
    """A background job (`start()` gives a generator doing the work in units and returning the result) or a
    generation (`start()` gives a generator that prefills in units and returns (sequence, info), or (sequences,
    info) for several choices of one prompt; then the worker decodes them in the batch; `emit(kind, payload)`
    streams "start" and "delta" events, a delta's payload being (choice index, Delta))."""

    def __init__(self, timeout_s: float, start: Callable, emit: Callable | None = None, kv_bytes: int = 0,
                 settle: Callable | None = None, tenant: str = "default", long: bool = False, cost: int = 0):
        self.start, self.emit, self.tenant = start, emit, tenant
        self.long = long  # a prefill of many units: it does not keep its tenant's other requests waiting
        self.cost = cost  # its prefill's token-layers at most (0: not known)
        self.work_ms = 0.0  # the worker's time its prefill units have taken so far
        self.units = 0  # prefill units run so far
        self.submitted = time.monotonic()
        self.started: float | None = None  # its first prefill unit
        self.kv_wait_s = 0.0  # time spent first in line waiting for KV memory
        self.expected_s: float | None = None  # when LongLane expected it to end, at admission
        self.prefilled = False
        self.kv_bytes = kv_bytes  # the most KV its sequences can hold (reserved while admitted)
        # (sequences) -> the most KV they can hold now that the prefill is done (what it kept is known), or None
        self.settle = settle
        self.reserved = 0
        self.future: Future = Future()
        self.cancelled = threading.Event()
        self.deadline = self.submitted + timeout_s
        self.timeout_s = timeout_s
        self.seqs: list = []
        self.info = self.steps = None
        self.idle_only = False  # a background job that runs only while no generation decodes
        self.pending: Forward | None = None  # its prefill's next forward, waiting to run with the next decode step

    @property
    def seq(self):
        """The first (usually only) sequence."""
        return self.seqs[0] if self.seqs else None

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    def cancel(self) -> None:
        self.cancelled.set()

    def expired(self) -> bool:
        return time.monotonic() > self.deadline

    def should_stop(self) -> bool:
        return self.cancelled.is_set() or self.expired()

    def send(self, kind: str, payload=None) -> None:
        if self.emit is not None:
            self.emit(kind, payload)
