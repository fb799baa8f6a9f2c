"""The queue side of the scheduler: which waiting generation starts prefilling next, its KV reserved, and
that KV given back. A mixin of Scheduler (it reads the scheduler's queues, batch and KV budget)."""

from __future__ import annotations

import queue
import time

from ragkv.serve.scheduling.jobs import Job, JobTimeout


class Admission:
    def _admit(self) -> Job | None:
        """The next generation to start prefilling, its KV reserved; None: none may start now. One that does not
        fit beside the running ones waits first in line (`waiting`) until enough is released; meanwhile other
        tenants' generations that fit pass it (a long request's KV blocked every tenant for minutes in the soak),
        its own tenant's wait behind it, unless it is long (a long `ape` request waiting minutes for KV held its
        tenant's every chat request past the client's 180 s in the next soak: a long one never holds its tenant's
        place, waiting or prefilling)."""
        if (self.running or self.prefilling) and self.batch_size + len(self.prefilling) >= self.max_batch:
            return None
        busy = self._busy_tenants()
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

    def _busy_tenants(self) -> frozenset:
        """Tenants whose next request waits: one with a prefill in flight waits for it (its own requests prefill
        in order) unless that one is long, or (mixed steps) unless every one of its prefills has its forward
        staged for the next step, within the tenant's cap: the newcomer's forward then joins theirs in one pass
        and delays none of them (the step's room is checked before a unit runs: `_room_to_stage`)."""
        mine: dict[str, list[Job]] = {}
        for j in self.prefilling:
            if not j.long:
                mine.setdefault(j.tenant, []).append(j)
        cap = self.max_prefills_per_tenant
        return frozenset(t for t, js in mine.items()
                         if not self.mixed or any(j.pending is None for j in js) or (cap and len(js) >= cap))

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
