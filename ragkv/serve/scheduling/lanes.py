"""Who waits and who may start: one FIFO per tenant, taken round-robin, and the lane of long prefills, admitted by
when they would end."""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import deque

from ragkv.serve.scheduling.jobs import Job, LongPrefillsBusy

log = logging.getLogger("ragkv.serve.scheduling")

LONG_SHARE = 0.5  # of the worker's time that long prefills may take while answers decode
LONG_CREDIT_MAX_MS = 5000.0  # decode time banked for long units at most (no burst of them after a quiet spell)
LONG_DEADLINE_SHARE = 0.9  # a long prefill is admitted if it is expected to end within this share of its deadline


class LongLane:
    """Admission of long prefills by when they would end. Long prefills share the worker's time left by answers and
    other prefills (round-robin among them), so each one admitted beside another slows both: in the 30-minute soak
    two of them (a tenant's 29K-token `ape` request and a fuzzer's) ran side by side and one passed the server's
    300 s deadline, a 504 after 5 minutes of work. A new long prefill is refused at once (429, with when to retry)
    when, with the long prefills in flight sharing the lane equally (processor sharing), it or one in flight would
    not end within LONG_DEADLINE_SHARE of its deadline (a newcomer must not make an admitted one late). The lane's speed
    is measured, not assumed: the token-layers per worker ms of the long prefills that ended, times the share of the
    wall clock that long units have had while any long prefill was admitted (decayed over SHARE_WINDOW_S). Assuming
    LONG_SHARE, a 48-minute soak's long request, admitted as able to end in 270 s, got a 504 after 304 s: under the
    fuzzers' load, short prefills of four tenants also take turns. Alone a long prefill is always admitted; before
    any long prefill has ended there is no rate, and none is refused."""

    SHARE_WINDOW_S = 600.0  # the measured share forgets the lane's past at this time constant
    SHARE_MIN_S = 30.0      # LONG_SHARE until the lane has been busy this long

    def __init__(self):
        self.jobs: list[Job] = []   # admitted long prefills not yet ended
        self.rate: float | None = None  # token-layers per worker ms
        self._work_ms = 0.0   # decayed: the worker ms long units took
        self._busy_ms = 0.0   # decayed: the wall ms during which a long prefill was admitted and not ended
        self._tick = time.monotonic()
        self._lock = threading.Lock()

    @staticmethod
    def _is_live(job: Job) -> bool:
        return not job.future.done() and not job.prefilled

    def _live(self) -> list[Job]:
        return [j for j in self.jobs if self._is_live(j)]

    def tick(self, long_ms: float = 0.0) -> None:
        """Account the wall clock since the last tick (busy if a long prefill was admitted) and `long_ms` of long
        units; the worker calls it once per pass of its loop."""
        with self._lock:
            now = time.monotonic()
            dt, self._tick = now - self._tick, now
            decay = math.exp(-dt / self.SHARE_WINDOW_S)
            self._work_ms = self._work_ms * decay + long_ms
            busy = any(map(self._is_live, self.jobs))
            self._busy_ms = self._busy_ms * decay + (dt * 1000 if busy else 0.0)

    def share(self) -> float:
        """The share of the wall clock long units have had while the lane was busy."""
        if self._busy_ms < self.SHARE_MIN_S * 1000:
            return LONG_SHARE
        return min(1.0, max(0.05, self._work_ms / self._busy_ms))

    def _ends_s(self, jobs: list[Job]) -> list[float]:
        """When each of `jobs` would end, in seconds from now, sharing the lane equally: with the work left sorted
        w1 <= w2 <= ..., the k-th ends after w1 + ... + w(k-1) + (n - k + 1) wk at the lane's speed."""
        speed = self.rate * self.share() * 1000  # token-layers per wall second
        left = [max(0.0, j.cost - j.work_ms * self.rate) for j in jobs]
        ends, t, prev = [0.0] * len(jobs), 0.0, 0.0
        for k, i in enumerate(sorted(range(len(jobs)), key=left.__getitem__)):
            t += (left[i] - prev) * (len(jobs) - k)
            prev, ends[i] = left[i], t / speed
        return ends

    @staticmethod
    def _allowed_s(job: Job, now: float) -> float:
        """The seconds left before LONG_DEADLINE_SHARE of the job's deadline."""
        return job.deadline - now - (1 - LONG_DEADLINE_SHARE) * job.timeout_s

    def admit(self, job: Job) -> None:
        with self._lock:
            self.jobs = self._live()
            if self.jobs and self.rate:
                now = time.monotonic()
                before = self._ends_s(self.jobs)
                after = self._ends_s(self.jobs + [job])
                late = [over for over in (end - self._allowed_s(j, now) for end, j in zip(after, self.jobs + [job]))
                        if over > 0]
                if late:
                    log.info("long prefill refused: %d token-layers, would end in %.1f s beside %d in flight "
                             "(rate %.1f token-layers/ms, lane share %.2f)", job.cost, after[-1], len(self.jobs),
                             self.rate, self.share())
                    raise LongPrefillsBusy(
                        f"{len(self.jobs)} long prefills are running (about {max(before):.0f} s of work left); with "
                        f"this one's {job.cost} token-layers they would take about {max(after):.0f} s, and one would "
                        f"end beyond {LONG_DEADLINE_SHARE:.0%} of the server's {job.timeout_s:.0f} s deadline "
                        "(--timeout); retry later, or send fewer or shorter documents",
                        max(1, math.ceil(max(late))))
                job.expected_s = after[-1]
            elif self.rate:
                job.expected_s = self._ends_s([job])[0]
            log.info("long prefill admitted: %d token-layers, expected to end in %s s beside %d in flight "
                     "(rate %s token-layers/ms, lane share %.2f)", job.cost,
                     "?" if job.expected_s is None else f"{job.expected_s:.1f}", len(self.jobs),
                     "?" if self.rate is None else f"{self.rate:.1f}", self.share())
            self.jobs.append(job)

    def ended(self, job: Job, outcome: str) -> None:
        """A long prefill has ended (`outcome`: "prefilled", or why not): logged with where its time went; a
        prefilled one's rate is the lane's (an average over the last ones)."""
        with self._lock:
            if outcome == "prefilled" and job.cost and job.work_ms > 0:
                rate = job.cost / job.work_ms
                self.rate = rate if self.rate is None else 0.5 * (self.rate + rate)
            now = time.monotonic()
            started = job.started if job.started is not None else now
            log.log(logging.INFO if outcome == "prefilled" else logging.WARNING,
                    "long prefill %s: %d token-layers in %.1f s (queued %.1f s, %.1f s of it waiting for KV; "
                    "%d units, %.1f s of worker time; expected %s s at admission; lane share %.2f)", outcome, job.cost,
                    now - job.submitted, started - job.submitted, job.kv_wait_s, job.units, job.work_ms / 1000,
                    "?" if job.expected_s is None else f"{job.expected_s:.1f}", self.share())


class TenantQueues:
    """Waiting generations, one FIFO per tenant, taken round-robin by tenant (the drop-in for a queue.Queue the
    scheduler used: put_nowait raises queue.Full at `maxsize` in all, get raises queue.Empty)."""

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self._queues: dict[str, deque] = {}  # tenant -> its waiting jobs; insertion order is the rotation
        self._cond = threading.Condition()

    def qsize(self) -> int:
        with self._cond:
            return sum(len(q) for q in self._queues.values())

    def empty(self) -> bool:
        return self.qsize() == 0

    def put_nowait(self, job: "Job") -> None:
        with self._cond:
            if sum(len(q) for q in self._queues.values()) >= self.maxsize:
                raise queue.Full
            self._queues.setdefault(job.tenant, deque()).append(job)
            self._cond.notify()

    def get(self, block: bool = True, timeout: float | None = None, skip=frozenset()) -> "Job":
        """The first job of the next tenant in the rotation that is not in `skip` (that tenant goes to the end)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                for tenant in list(self._queues):
                    q = self._queues[tenant]
                    if q and tenant not in skip:
                        job = q.popleft()
                        del self._queues[tenant]  # to the end of the rotation (dropped when empty)
                        if q:
                            self._queues[tenant] = q
                        return job
                left = None if deadline is None else deadline - time.monotonic()
                if not block or (left is not None and left <= 0):
                    raise queue.Empty
                self._cond.wait(left)

    def get_nowait(self) -> "Job":
        return self.get(block=False)

    def put_back(self, job: "Job") -> None:
        """A job taken that could not start yet, first in its tenant's line again (it was counted already)."""
        with self._cond:
            self._queues.setdefault(job.tenant, deque()).appendleft(job)
            self._cond.notify()
