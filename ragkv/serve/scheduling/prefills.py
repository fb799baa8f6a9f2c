"""The prefills in flight: whose unit runs next (round-robin by tenant, long ones within their share), one unit
run up to its next forward, the forwards staged for the next step within the token budget, and the worker's time
each took. A mixin of Scheduler."""

from __future__ import annotations

import time

from ragkv.models.loop import Forward, resume
from ragkv.serve.scheduling.jobs import Job, JobTimeout
from ragkv.serve.scheduling.lanes import LONG_CREDIT_MAX_MS, LONG_SHARE


class PrefillUnits:
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
            self.prefill_units += 1
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
        """The prefills whose pending forwards run in this step, within the token budget beside the decode rows (at
        least one): round-robin by tenant, each tenant's first admitted first (one tenant's several prefills do not
        keep another's out of the step); those whose client left or whose deadline passed end here."""
        taken, rows, rank = [], self.batch_size, {}
        staged = []
        for j in self.prefilling:
            if j.pending is not None:
                rank[j.tenant] = rank.get(j.tenant, -1) + 1
                staged.append((rank[j.tenant], len(staged), j))
        for *_, job in sorted(staged, key=lambda s: s[:2]):
            if job.should_stop():
                self._stop_prefill(job)
            elif not taken or rows + job.pending.rows <= self.max_num_batched_tokens:
                taken.append(job)
                rows += job.pending.rows
        return taken
