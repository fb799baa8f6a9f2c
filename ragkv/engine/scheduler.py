"""Continuous batching: one worker thread drives the model; a bounded queue (full -> 429), deadlines, cancellation.

Every running generation advances one token per step in one batched forward (Engine.step). Between two steps
the worker does one unit of other work: one unit of the current newcomer's prefill (a missed block encoded, or
`chunk` tokens of a full/prefix prefill, or a query's prefill over cached blocks: Engine.start_steps), or one
unit of a background job (adding documents). So a running answer pauses for at most one unit per token: the stall a
newcomer imposes on the others, recorded as `prefill_stall_ms_max`. With a stall budget (`prefill_stall_ms`),
further units of newcomers' prefills run until the budget is spent: under a burst of arrivals more of them join
each batched step (throughput), while the running answers wait longer between tokens. Finished, cancelled
(client gone) and timed-out generations leave the batch at once. A generation arrives prepared (retrieved,
tokenized, its segments built by the caller's thread): the worker only runs the model.

Fairness across tenants: waiting generations queue per tenant and are admitted round-robin by tenant; each tenant
may have one generation prefilling at a time, and the units of the prefills in flight go round-robin, tenant by
tenant, and within a tenant request by request (one tenant's long prefill, e.g. `ape` over 32K tokens, no longer
holds the model until it ends: another tenant's request is admitted beside it and its units interleave). Within one
tenant, generations prefill first come, first served, except that a `long` one (many units: Server.start marks
it) does not hold its tenant's place: the tenant's next requests are admitted beside it, or one hostile request of
minutes would hold every other request of its own tenant past its deadline (seen in the 40-minute soak). While
answers decode, long prefills take at most LONG_SHARE of the worker's time: one unit of a long `ape` request was
1-3 s, and one of them between every two decode steps made every answer beside it ~20x slower (the soak: 100
requests in 6 minutes where there had been 600). A long prefill that could not end by its deadline beside the long
ones in flight is refused when submitted, not timed out minutes later (LongLane).

Background jobs (document ingestion: `submit_background`) advance one short unit at a time, when no request is
waiting to be prefilled and otherwise once per round of the prefills in flight (as one more tenant: under a
steady load of prefills ingestion never ran, and every tenant's documents were refused with a full queue), so a
chat request arriving during a large ingest waits for at most one unit. They can be cancelled between two units
and obey their own deadline. An `idle_only` job (start-up profiling, shadow checks, whose unit is a forward of up
to thousands of tokens) waits until nothing decodes or prefills, so it never pauses an answer.

Memory: a generation reserves its KV bytes (engine/kv/kvbudget.py) when it is admitted. One that would not fit
beside the running ones waits first in line until enough is released; other tenants' generations that fit pass it
meanwhile, unless their tenant already holds its share of the KV limit (the limit over the tenants holding KV), its
own tenant's wait behind it; one that could never fit is refused when submitted. A generation gives
its KV back the moment it leaves the batch.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Callable

from ragkv.engine.kv.kvbudget import KVBudget
from ragkv.models.loop import Forward, resume
from ragkv.errors import RagkvError
from ragkv.settings import SERVE

log = logging.getLogger(__name__)


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


LONG_SHARE = 0.5  # of the worker's time that long prefills may take while answers decode
LONG_CREDIT_MAX_MS = 5000.0  # decode time banked for long units at most (no burst of them after a quiet spell)
LONG_DEADLINE_SHARE = 0.9  # a long prefill is admitted if it is expected to end within this share of its deadline


class LongPrefillsBusy(Exception):
    """A 429: the long prefills already admitted would keep this one from ending before its deadline."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


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


class Scheduler:
    def __init__(self, step: Callable[[list], None], max_queue: int = SERVE.max_queue,
                 timeout_s: float = SERVE.timeout_s, max_batch: int = SERVE.max_batch,
                 on_finish: Callable | None = None, lock=None, thread: bool = True,
                 kv_budget: KVBudget | None = None, prefill_stall_ms: float = SERVE.prefill_stall_ms,
                 mixed: bool = False, max_num_batched_tokens: int = SERVE.max_num_batched_tokens):
        """`thread=False`: the caller runs `serve_forever()` itself, on the main thread (`ragkv serve` does:
        OpenMP kernels launched from a non-main thread ran 40% slower on CPU, measured on a decode step).
        `kv_budget`: the KV memory generations reserve (default: no limit). `prefill_stall_ms`: newcomers'
        prefill units run between two decode steps until this much time is spent (at least one unit).
        `mixed`: `step(seqs, forwards)` also runs prefill forwards (a prefill's units yield them) in the decode
        step's pass over the layers and returns their outputs; each step's rows, decode and prefill, stay within
        `max_num_batched_tokens` (vLLM's knob: one forward per step) except that one forward always goes."""
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if prefill_stall_ms < 0:
            raise ValueError("prefill_stall_ms must be >= 0")
        if max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        self.mixed, self.max_num_batched_tokens = mixed, max_num_batched_tokens
        self._staged = False  # the last unit left its forward for the next step (it took the model no time)
        self.prefill_stall_ms = prefill_stall_ms
        self.step_fn, self.timeout_s, self.max_batch, self.on_finish = step, timeout_s, max_batch, on_finish
        self.lock = lock if lock is not None else threading.RLock()  # held while a prefill unit runs
        self.prefilling: list[Job] = []  # admitted, mid-prefill: one per tenant (besides long ones), units
        self._turn = 0                    # round-robin by tenant, then by request within the tenant
        self._inner: dict[str, int] = {}
        self._long_credit_ms = 0.0  # earned by decode steps and short units, spent by long units (LONG_SHARE)
        self.long_lane = LongLane()
        self._long_ms = 0.0  # long units' worker ms since the lane's last tick
        self._units_since_background = 0  # prefill units since a background job last had one
        self.kv = kv_budget if kv_budget is not None else KVBudget()
        self.waiting: Job | None = None  # the queue's head, taken out, waiting for KV memory to be released
        self._waiting_since = 0.0
        self.jobs = TenantQueues(max_queue)
        self.background: deque[Job] = deque()  # ingestion jobs, one unit at a time when nothing else waits
        self.max_background = max(1, max_queue // 4)
        self.max_background_per_tenant = max(1, self.max_background // 4)
        self.running: list[Job] = []
        self.stall_ms_max = self.stall_ms_total = 0.0
        self.steps = self.batched_tokens = 0
        self.mixed_steps = self.mixed_rows = 0  # steps that ran prefill rows beside the decode rows; those rows
        self.stopping = threading.Event()
        self._thread = None
        if thread:
            self._thread = threading.Thread(target=self.serve_forever, name="ragkv-scheduler", daemon=True)
            self._thread.start()

    def alive(self) -> bool:
        """Whether the worker still serves (its own thread alive, when it has one, and not stopped)."""
        return not self.stopping.is_set() and (self._thread is None or self._thread.is_alive())

    @property
    def depth(self) -> int:
        return self.jobs.qsize() + (self.waiting is not None)

    @property
    def batch_size(self) -> int:
        """Sequences decoding now (a request with n choices counts n)."""
        return sum(len(job.seqs) for job in self.running)

    def _put(self, job: Job) -> Job:
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"the server queue is full ({self.jobs.maxsize} requests waiting); retry later")
        return job

    def submit_background(self, start: Callable, timeout_s: float, idle_only: bool = False,
                          tenant: str | None = None) -> Job:
        """`start()` gives a generator doing the work in short units and returning the result. `idle_only`: its
        units run only while no generation is decoding (for work whose unit is long and that nobody waits for).
        `tenant`: whose job it is; a tenant may hold at most a quarter of the queue (one tenant's uploads filled
        it in the soak, and every other tenant's documents were refused). Idle-only jobs (shadow checks, warming
        chat turns) have a queue of their own: under load they never run, and they filled the one ingestion
        shared."""
        pending = [j for j in self.background if not j.future.done() and j.idle_only == idle_only]
        if len(pending) >= self.max_background:
            raise QueueFull(f"{self.max_background} background jobs are already queued; retry later")
        if tenant is not None and sum(j.tenant == tenant for j in pending) >= self.max_background_per_tenant:
            raise QueueFull(f"this tenant already has {self.max_background_per_tenant} background jobs queued (the "
                            "most one tenant may hold); retry when one has finished")
        job = Job(timeout_s, start=start, tenant=tenant)
        job.idle_only = idle_only
        self.background.append(job)
        return job

    def submit_generation(self, start: Callable, emit: Callable | None = None, kv_bytes: int = 0,
                          settle: Callable | None = None, tenant: str = "default", long: bool = False,
                          cost: int = 0) -> Job:
        """`start()` gives a generator that prefills in units and returns (sequence, info); the future resolves
        to (info, sequence, finish). `kv_bytes`: the most KV it can hold (engine/kvbudget.kv_need). `tenant`:
        whose turn it takes (tenants are served round-robin). `long`: a prefill of many units, which its tenant's
        later requests need not wait for; `cost` its token-layers (LongLane's admission)."""
        if not self.kv.fits_ever(kv_bytes):
            raise KVTooLarge(f"the generation needs {kv_bytes} bytes of KV memory; the limit is {self.kv.limit}")
        job = Job(self.timeout_s, start=start, emit=emit, kv_bytes=kv_bytes, settle=settle, tenant=tenant,
                  long=long, cost=cost)
        if long:
            self.long_lane.admit(job)
        try:
            return self._put(job)
        except QueueFull:
            job.future.cancel()  # never queued: the long lane no longer counts it
            raise

    # -- the worker ---------------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        """The worker loop; returns once `stop()` was called."""
        while not self.stopping.is_set():
            try:
                t0 = time.perf_counter()
                self._unit()
                while self.running and self._more_prefill() and \
                        ((time.perf_counter() - t0) * 1000 < self.prefill_stall_ms or self._room_to_stage()):
                    if not self._unit():
                        break
                if self.running or any(j.pending is not None for j in self.prefilling):
                    self._step()
                elif self.waiting is not None and not self.prefilling:
                    time.sleep(0.01)  # a guard: with nothing running every reservation is back, so it fits
                self.long_lane.tick(self._long_ms)
                self._long_ms = 0.0
                idle = not self.running and not self.prefilling and self.waiting is None and not self.depth
                self.kv.maybe_give_back(idle)
            except BaseException:  # the worker must survive anything
                log.exception("scheduler iteration failed")
        self._abort_all()

    def _abort_all(self) -> None:
        """On shutdown: every running, prefilling, queued and background job ends now with ShuttingDown."""
        jobs = list(self.running) + list(self.prefilling) + list(self.background)
        jobs += [self.waiting] if self.waiting else []
        while True:
            try:
                jobs.append(self.jobs.get_nowait())
            except queue.Empty:
                break
        for job in jobs:
            if job.steps is not None:
                job.steps.close()
            self._release(job, "shutdown")
            if not job.future.done():
                job.future.set_exception(ShuttingDown("the server is shutting down; retry on another instance"))
        self.running, self.prefilling, self.waiting = [], [], None
        self.background.clear()

    def _more_prefill(self) -> bool:
        """Whether a newcomer's prefill unit could run now (not a background job's: those wait for a step)."""
        if any(j.pending is None for j in self.prefilling):
            return True
        return self.waiting is None and not self.jobs.empty() and self.batch_size < self.max_batch

    def _next_prefill(self) -> Job | None:
        """The prefill whose unit runs next: a newly admitted one (of a tenant with none in flight but long ones)
        joins those in flight, and their units go round-robin, one tenant after another, and within a tenant one
        request after another."""
        job = self._admit()
        if job is not None:
            self.prefilling.append(job)
        ready = [j for j in self.prefilling if j.pending is None]  # the others wait for the next step
        if self.running and self._long_credit_ms < 0:  # long units have had their share for now
            ready = [j for j in ready if not j.long]
        if not ready:
            return None
        tenants = list(dict.fromkeys(j.tenant for j in ready))
        self._turn = (self._turn + 1) % len(tenants)
        tenant = tenants[self._turn]
        self._inner = {t: self._inner.get(t, 0) for t in tenants}  # tenants gone are forgotten
        self._inner[tenant] += 1
        mine = [j for j in ready if j.tenant == tenant]
        return mine[self._inner[tenant] % len(mine)]

    def _credit(self, ms: float, long: bool) -> None:
        """Account the worker's time: a long prefill's unit spends credit, anything else done for running or
        waiting requests while a long prefill waits earns it (at LONG_SHARE's ratio, up to LONG_CREDIT_MAX_MS)."""
        if long:
            self._long_credit_ms -= ms
        elif not any(j.long for j in self.prefilling):
            self._long_credit_ms = min(self._long_credit_ms, 0.0)  # nothing banked while no long prefill waits
        else:
            self._long_credit_ms = min(LONG_CREDIT_MAX_MS,
                                       self._long_credit_ms + ms * LONG_SHARE / (1 - LONG_SHARE))

    def _unit(self) -> bool:
        """One unit of work besides decoding: a unit of a prefill in flight (or of a newly admitted one), else of a
        background job. False: there was none to do."""
        self._staged = False
        if self.prefilling and self._units_since_background >= len({j.tenant for j in self.prefilling}) \
                and self._background_unit(turn=True):  # background work takes a turn as one more tenant
            self._units_since_background = 0
            return True
        job = self._next_prefill()
        if job is None:
            return self._background_unit()
        self._units_since_background += 1
        t0, stalled = time.perf_counter(), bool(self.running)
        if job.should_stop():
            self._stop_prefill(job)
        else:
            if job.steps is None:
                job.started = time.monotonic()
                job.steps = job.start()
            job.units += 1
            self._resume(job, None)
            self._staged = job.pending is not None
        self._account(job, (time.perf_counter() - t0) * 1000, stalled)
        return True

    def _resume(self, job: Job, value) -> None:
        """Advance a prefill from `value` (its pending forward's output, or None) to its next unit boundary. A forward
        it yields waits for the next step while answers decode (steps `mixed`), else runs here alone. Its end is
        handled here: prefilled (its first token, then it decodes with the batch) or failed (it ends alone)."""
        try:
            with self.lock:
                while True:
                    item = resume(job.steps, value)
                    if not isinstance(item, Forward):
                        return
                    if self.mixed and self.running:
                        job.pending = item
                        return
                    try:
                        value = item.run()
                    except Exception as e:  # noqa: BLE001 - into the prefill, which may start over (a store fault)
                        value = e
        except StopIteration as done:  # prefilled: its first token now, then it decodes with the batch
            self.prefilling.remove(job)
            job.prefilled = True
            seqs, job.info = done.value
            job.seqs = list(seqs) if isinstance(seqs, (list, tuple)) else [seqs]
            self._settle(job)
            job.send("start")
            if self._advance(job):  # else it failed and has ended
                if job.finished:
                    self._finish(job, job.seq.out.finish_reason)
                else:
                    self.running.append(job)
        except BaseException as e:  # noqa: BLE001 - a failed request must not take the worker down
            self._fail_prefill(job, e)

    def _fail_prefill(self, job: Job, e: BaseException) -> None:
        job.pending = None
        if job in self.prefilling:
            self.prefilling.remove(job)
        self._release(job, "error")
        if not job.future.done():
            job.future.set_exception(e)
        if job.long:
            self.long_lane.ended(job, f"failed ({type(e).__name__})")

    def _stop_prefill(self, job: Job) -> None:
        """A prefill whose client left or whose deadline passed ends now, its KV given back."""
        self.prefilling.remove(job)
        job.pending = None
        if job.steps is not None:
            job.steps.close()
        self._release(job, "cancelled")
        job.future.set_exception(JobTimeout("request timed out before its first token")
                                 if not job.cancelled.is_set() else RuntimeError("cancelled"))
        if job.long:
            self.long_lane.ended(job, "cancelled" if job.cancelled.is_set() else "timed out")

    def _account(self, job: Job, ms: float, stalled: bool) -> None:
        """The worker's `ms` spent on `job`'s prefill: its own time (the long lane's rate), the long prefills' share,
        and the stall it imposed on answers decoding (`stalled`)."""
        job.work_ms += ms
        if job.long:
            self._long_ms += ms
            if job.prefilled:  # its last unit: the long lane learns its rate (a prefilled job runs no more)
                self.long_lane.ended(job, "prefilled")
        if stalled or not job.long:
            self._credit(ms, job.long)
        if stalled:
            self.stall_ms_max = max(self.stall_ms_max, ms)
            self.stall_ms_total += ms

    def _room_to_stage(self) -> bool:
        """Whether another prefill may leave a forward for this step: the last unit did (it took no time), and the
        step's rows are still within the token budget."""
        return self._staged and self.batch_size + self._pending_rows() < self.max_num_batched_tokens

    def _pending_rows(self) -> int:
        return sum(j.pending.rows for j in self.prefilling if j.pending is not None)

    def _take_forwards(self) -> list[Job]:
        """The prefills whose pending forwards run in this step, first admitted first, within the token budget beside
        the decode rows (at least one); those whose client left or whose deadline passed end here."""
        taken, rows = [], self.batch_size
        for job in [j for j in self.prefilling if j.pending is not None]:
            if job.should_stop():
                self._stop_prefill(job)
            elif not taken or rows + job.pending.rows <= self.max_num_batched_tokens:
                taken.append(job)
                rows += job.pending.rows
        return taken

    def _background_unit(self, turn: bool = False) -> bool:
        """One unit of the oldest background job that may run now (nothing else is waiting for the model, or
        `turn`: its turn among prefills in flight, which idle-only jobs never take)."""
        job = next((j for j in self.background if not (j.idle_only and (self.running or turn))), None)
        if job is None:
            return False
        t0, stalled = time.perf_counter(), bool(self.running)
        try:
            if job.should_stop():
                raise JobTimeout(f"the job exceeded its {job.timeout_s:.0f} s deadline") if not \
                    job.cancelled.is_set() else Cancelled("cancelled")
            if job.steps is None:
                job.steps = job.start()
            with self.lock:
                next(job.steps)
            return True
        except StopIteration as done:
            job.future.set_result(done.value)
        except BaseException as e:  # noqa: BLE001 - a failed job must not take the worker down
            if job.steps is not None:
                job.steps.close()
            job.future.set_exception(e)
        finally:
            if stalled:
                self.stall_ms_max = max(self.stall_ms_max, (time.perf_counter() - t0) * 1000)
        self.background.remove(job)
        return True

    def stop(self) -> None:
        self.stopping.set()

    def _admit(self) -> Job | None:
        """The next generation to start prefilling, its KV reserved; None: none may start now. One that does not
        fit beside the running ones waits first in line (`waiting`) until enough is released; meanwhile other
        tenants' generations that fit pass it (a long request's KV blocked every tenant for minutes in the soak),
        its own tenant's wait behind it, unless it is long (a long `ape` request waiting minutes for KV held its
        tenant's every chat request past the client's 180 s in the next soak: a long one never holds its tenant's
        place, waiting or prefilling)."""
        if (self.running or self.prefilling) and self.batch_size + len(self.prefilling) >= self.max_batch:
            return None
        # a tenant with a prefill in flight waits for it (its own requests prefill in order) unless that one is
        # long; another tenant's joins it
        busy = frozenset(j.tenant for j in self.prefilling if not j.long)
        head = self.waiting  # stays set until it leaves the line: stats() (other threads) never sees it vanish
        if head is not None and self._gone(head):
            self.waiting = head = None
        if head is not None:
            if self._reserve(head):
                head.kv_wait_s += time.monotonic() - self._waiting_since
                self.waiting = None
                return head
            skip = busy | self._over_share(head.tenant) | (frozenset() if head.long else {head.tenant})
            try:
                job = self.jobs.get(block=False, skip=skip)
            except queue.Empty:
                return None
            if self._gone(job):
                return None
            if self._reserve(job):
                return job
            self.jobs.put_back(job)  # does not fit either: it keeps its place, behind the one waiting
            return None
        try:
            # wakes up to notice stop(); never waits while anything else could run
            job = self.jobs.get(block=not self.running and not self.background and not self.prefilling,
                                timeout=0.5, skip=busy)
        except queue.Empty:
            return None
        if self._gone(job):
            return None
        if not self._reserve(job):
            self.waiting, self._waiting_since = job, time.monotonic()  # first in line until enough is released
            return None
        return job

    def _over_share(self, waiting_tenant: str) -> frozenset:
        """While a generation waits for KV: the other tenants already holding their share of the limit (the limit over
        the tenants holding KV and the waiting one). They may not pass it: in the soak the fuzzer's n x max_tokens
        reservations, renewed as they ended, kept another tenant's long request waiting past its deadline."""
        if self.kv.limit is None:
            return frozenset()
        held: dict[str, int] = {waiting_tenant: 0}
        for job in (*self.running, *self.prefilling):
            held[job.tenant] = held.get(job.tenant, 0) + job.reserved
        share = self.kv.limit / len(held)
        return frozenset(t for t, b in held.items() if t != waiting_tenant and b >= share)

    def _gone(self, job: Job) -> bool:
        """A queued job its client left or whose deadline passed: ended here (it never started)."""
        if job.cancelled.is_set():
            job.future.cancel()
            return True
        if job.expired():
            job.future.set_exception(JobTimeout(f"request waited longer than {job.timeout_s:.0f} s in the queue"))
            if job.long:
                if job is self.waiting:
                    job.kv_wait_s += time.monotonic() - self._waiting_since
                self.long_lane.ended(job, "timed out in the queue")
            return True
        return False

    def _reserve(self, job: Job) -> bool:
        if not self.kv.try_reserve(job.kv_bytes):
            return False
        job.reserved = job.kv_bytes
        return True

    def _settle(self, job: Job) -> None:
        """After the prefill: give back the part of the reservation the sequences will never hold (blend over
        pooled blocks keeps only the rows it recomputed, a number known only now)."""
        need = job.settle(job.seqs) if job.settle is not None else None
        if need is not None and need < job.reserved:
            self.kv.release(job.reserved - need)
            job.reserved = need

    def _release(self, job: Job, reason: str) -> None:
        """The job's KV back now: its unfinished sequences end (their caches dropped), its reservation returns."""
        for seq in job.seqs:
            if not seq.finished:
                seq.cancel(reason)
        if job.reserved:
            self.kv.release(job.reserved)
            job.reserved = 0

    def _step(self) -> None:
        """One forward: a token for every running answer, and (mixed) the prefill forwards staged for it."""
        for job in list(self.running):
            if job.should_stop():
                reason = "cancelled" if job.cancelled.is_set() else "timeout"
                for seq in job.seqs:
                    seq.cancel(reason)
                self._finish(job, reason)
        jobs = self._take_forwards()
        if not self.running and not jobs:
            return
        seqs = [seq for job in self.running for seq in job.seqs if not seq.finished]
        forwards = [job.pending for job in jobs]
        t0 = time.perf_counter()
        try:
            outs = self.step_fn(seqs, forwards) if self.mixed else (self.step_fn(seqs), [])[1]
        except BaseException as e:  # noqa: BLE001
            log.exception("decode step failed")
            for job in self.running:
                self._release(job, "error")
                job.future.set_exception(e)
            self.running = []
            for job in jobs:
                self._fail_prefill(job, e)
            return
        ms = (time.perf_counter() - t0) * 1000
        rows = len(seqs) + sum(f.rows for f in forwards)
        if seqs:
            self._credit(ms * len(seqs) / rows, long=False)
            self.steps += 1
            self.batched_tokens += len(seqs)
            self.mixed_steps += bool(forwards)
            self.mixed_rows += rows - len(seqs)
        for job in list(self.running):
            if self._advance(job) and job.finished:
                self._finish(job, job.seq.out.finish_reason)
        for job, fwd, out in zip(jobs, forwards, outs):  # after the answers advanced: a prefilled one joins them
            job.pending = None
            t1 = time.perf_counter()
            self._resume(job, out)
            self._account(job, ms * fwd.rows / rows + (time.perf_counter() - t1) * 1000, stalled=False)

    def _advance(self, job: Job) -> bool:
        """Each unfinished choice of `job` takes its next token and streams it. False: choosing one failed, and the
        job ended with that error, alone (a request whose sampling failed never answered, nor freed its place, and
        a failure in the batch's loop took every other request's next token with it)."""
        try:
            for i, seq in enumerate(job.seqs):
                if not seq.finished:
                    self._emit(job, i, seq.advance())
            return True
        except BaseException as e:  # noqa: BLE001 - one request's failure is its own
            log.exception("choosing a token failed")
            if job in self.running:
                self.running.remove(job)
            self._release(job, "error")
            if not job.future.done():
                job.future.set_exception(e)
            return False

    def _emit(self, job: Job, index: int, deltas) -> None:
        for d in deltas:
            job.send("delta", (index, d))

    def _finish(self, job: Job, reason: str) -> None:
        if job in self.running:
            self.running.remove(job)
        self._release(job, reason)
        if self.on_finish is not None:  # one prefill's figures; the tokens of every choice (n > 1)
            self.on_finish(job.seq.stats, sum(s.stats.completion_tokens for s in job.seqs))
        if not job.future.done():
            job.future.set_result((job.info, job.seq, reason))

    def stats(self) -> dict:
        return {"queue_depth": self.depth, "background_jobs": len(self.background), "batch_size": self.batch_size,
                "prefilling": len(self.prefilling),
                "max_batch": self.max_batch, **self.kv.stats(), "kv_waiting": int(self.waiting is not None),
                "decode_steps": self.steps, "batched_tokens": self.batched_tokens,
                "mixed_steps": self.mixed_steps, "mixed_prefill_rows": self.mixed_rows,
                "mean_batch": round(self.batched_tokens / self.steps, 3) if self.steps else 0.0,
                "prefill_stall_ms_max": round(self.stall_ms_max, 3),
                "prefill_stall_ms_total": round(self.stall_ms_total, 3)}
