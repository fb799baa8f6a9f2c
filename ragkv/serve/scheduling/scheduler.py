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
may have one generation prefilling at a time, or (mixed steps) several while each of them has its forward staged
for the next step and the step's rows have room (their forwards then share one pass; the next starts only once the
earlier ones wait for the step, so it delays none of them), and the units of the prefills in flight go round-robin, tenant by
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
import queue
import threading
import time
from collections import deque
from typing import Callable

from ragkv.engine.kv.kvbudget import KVBudget
from ragkv.serve.scheduling.admission import Admission
from ragkv.serve.scheduling.jobs import Cancelled, Job, JobTimeout, KVTooLarge, QueueFull, ShuttingDown
from ragkv.serve.scheduling.lanes import LongLane, TenantQueues
from ragkv.serve.scheduling.prefills import PrefillUnits
from ragkv.settings import SERVE

log = logging.getLogger("ragkv.serve.scheduling")


class Scheduler(Admission, PrefillUnits):
    """The worker: admission (Admission), the prefills in flight (PrefillUnits), and the decode step they share."""

    def __init__(self, step: Callable[[list], None], max_queue: int = SERVE.max_queue,
                 timeout_s: float = SERVE.timeout_s, max_batch: int = SERVE.max_batch,
                 on_finish: Callable | None = None, lock=None, thread: bool = True,
                 kv_budget: KVBudget | None = None, prefill_stall_ms: float = SERVE.prefill_stall_ms,
                 mixed: bool = False, max_num_batched_tokens: int = SERVE.max_num_batched_tokens,
                 max_prefills_per_tenant: int = SERVE.max_prefills_per_tenant):
        """`thread=False`: the caller runs `serve_forever()` itself, on the main thread (`ragkv serve` does:
        OpenMP kernels launched from a non-main thread ran 40% slower on CPU, measured on a decode step).
        `kv_budget`: the KV memory generations reserve (default: no limit). `prefill_stall_ms`: newcomers'
        prefill units run between two decode steps until this much time is spent (at least one unit).
        `mixed`: `step(seqs, forwards)` also runs prefill forwards (a prefill's units yield them) in the decode
        step's pass over the layers and returns their outputs; each step's rows, decode and prefill, stay within
        `max_num_batched_tokens` (vLLM's knob: one forward per step) except that one forward always goes.
        `max_prefills_per_tenant` (mixed only): how many of one tenant's prefills may share the steps (0: as many
        as the budget holds)."""
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if prefill_stall_ms < 0:
            raise ValueError("prefill_stall_ms must be >= 0")
        if max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if max_prefills_per_tenant < 0:
            raise ValueError("max_prefills_per_tenant must be >= 0")
        self.max_prefills_per_tenant = max_prefills_per_tenant
        self.mixed, self.max_num_batched_tokens = mixed, max_num_batched_tokens
        self._staged = False  # the last unit left its forward for the next step (it took the model no time)
        self.prefill_stall_ms = prefill_stall_ms
        self.step_fn, self.timeout_s, self.max_batch, self.on_finish = step, timeout_s, max_batch, on_finish
        self.lock = lock if lock is not None else threading.RLock()  # held while a prefill unit runs
        self.prefilling: list[Job] = []  # admitted, mid-prefill (per tenant: see Admission._busy_tenants), units
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
        self.prefill_units = self.background_units = 0  # units run: generations' prefills, background jobs'
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

    def unit_tokens(self, chunk: int) -> int:
        """Tokens of a prefill's next unit: `chunk`, or the step's whole budget while that prefill is the only work
        (nothing decodes, waits or prefills beside it), as vLLM's chunked prefill fills its budget: a 1,329-token
        `full` prefill in one forward took 0.87x the time of its 512-token units (AMX Xeon, Qwen 0.5B bf16)."""
        alone = not self.running and len(self.prefilling) <= 1 and not self.depth and not self.background
        return max(chunk, self.max_num_batched_tokens) if alone else chunk

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
            self.background_units += 1
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
                "prefill_units": self.prefill_units, "background_units": self.background_units,
                "mean_batch": round(self.batched_tokens / self.steps, 3) if self.steps else 0.0,
                "prefill_stall_ms_max": round(self.stall_ms_max, 3),
                "prefill_stall_ms_total": round(self.stall_ms_total, 3)}
