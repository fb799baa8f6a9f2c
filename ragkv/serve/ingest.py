"""The server's document ingestion jobs: started by POST /v1/documents, run on the scheduler as background jobs
(units that yield to answers), and recorded in the library (ragkv.rag.jobs), so that a job outlives the process:
at start, the jobs a previous server left unfinished are taken over and their uncommitted documents resumed.

It knows no HTTP: routes/documents.py turns its answers into responses."""

from __future__ import annotations

import logging
import threading
import time
import uuid

from ragkv.serve.scheduling import Cancelled, QueueFull, ShuttingDown
from ragkv.rag.catalog import library_exists
from ragkv.rag.jobs import CANCELLED, ENDED, FAILED, INTERRUPTED, RUNNING, SUCCEEDED, JobBook
from ragkv.settings import DEFAULT_TENANT

log = logging.getLogger(__name__)

RECOVER_RETRY_S = (1.0, 60.0)  # a library unreachable at start (Redis down): retried after 1, 2, 4 ... 60 s


class IngestJob:
    """A job this server runs now: the scheduler's job, its live progress (`status`) and its durable record."""

    def __init__(self, record: dict, job, status: dict, earlier: int = 0):
        self.record, self.job, self.status = record, job, status
        # a resumed job's chunks committed before the restart: this run's counts cover only the rest
        self.earlier = earlier

    def chunks_total(self) -> int | None:
        total = self.status.get("chunks_total")
        return None if total is None else self.earlier + total

    @property
    def id(self) -> str:
        return self.record["id"]

    @property
    def tenant(self) -> str:
        return self.record["tenant"]

    def state(self) -> str:
        f = self.job.future
        if not f.done():
            return RUNNING
        e = f.exception()
        return CANCELLED if isinstance(e, Cancelled) else INTERRUPTED if isinstance(e, ShuttingDown) else \
            FAILED if e is not None else SUCCEEDED


def view(record: dict, live: IngestJob | None = None) -> dict:
    """A job as GET /v1/documents/jobs/{id} answers it: state, what is committed and what is not, and for an
    interrupted one whether it resumes or its documents must be resent."""
    state = live.state() if live is not None else record["state"]
    uncommitted = JobBook.uncommitted(record)
    out = {"id": record["id"], "object": "ingest.job", "status": state,
           "documents_total": record["documents_total"], "documents_done": len(record["committed"]),
           "chunks_total": live.chunks_total() if live else record.get("chunks_total"),
           "chunks_done": live.earlier + live.status.get("chunks_done", 0) if live else
           record.get("chunks_added", record.get("chunks_committed", 0)),
           "restarts": record.get("restarts", 0), "created_at": record["created_at"],
           "documents_committed": list(record["committed"])}
    if state != SUCCEEDED:
        out["documents_uncommitted"] = uncommitted
    if live is not None and state == FAILED:
        out["error"] = str(live.job.future.exception())
    elif record.get("error"):
        out["error"] = record["error"]
    if state == SUCCEEDED:
        r = live.job.future.result() if live is not None else None
        out.update(chunks_added=r.chunks_added + live.earlier if r else record.get("chunks_added", 0),
                   chunks_removed=r.chunks_removed if r else record.get("chunks_removed", 0),
                   unchanged=r.unchanged if r else record.get("unchanged", 0))
    if state == INTERRUPTED:
        out["message"] = (f"the server stopped while this job ran; {len(uncommitted)} document(s) not yet committed "
                          + ("must be sent again (listed in documents_uncommitted)" if record.get("given_up")
                             else "are resumed by the server"))
    return out


class IngestJobs:
    """The jobs of one server (ragkv.serve.server.Server) over its library (`server.library(tenant)`,
    `server.index_dir`), run on `server.scheduler` within `server.limits.ingest_timeout_s`."""

    def __init__(self, server):
        self.server = server
        self.live: dict[str, IngestJob] = {}
        self._book: JobBook | None = None
        self._lock = threading.Lock()

    def book(self) -> JobBook:
        """The library's job records (opening the library the first time)."""
        with self._lock:
            if self._book is None:
                self._book = JobBook(self.server.library(DEFAULT_TENANT).retriever.catalog)
            return self._book

    def has_library(self) -> bool:
        return self.server.index_dir is not None and library_exists(self.server.index_dir)

    # -- running ------------------------------------------------------------------------------------------
    def start(self, tenant: str, library, documents: list[dict], record: dict | None = None) -> IngestJob:
        """Record and queue a job over `documents` ({id, title, text}, parsed: ids are final). `record`: a
        recovered job's, whose remaining documents these are. Blocking (the record is written first): call it off
        the event loop."""
        book, resumed = self.book(), record is not None
        release = self.admit(tenant, library, documents) if not resumed else (lambda: None)
        if record is None:  # written before the job can run (and before the 202): a restart finds it
            record = book.open(f"ingest-{uuid.uuid4().hex[:16]}", tenant, documents)
        status: dict = {"documents_total": len(documents), "documents_done": 0, "chunks_total": None,
                        "chunks_done": 0}
        earlier = record.get("chunks_committed", 0) if resumed else 0

        def committed(doc_id: str) -> None:
            book.committed(record, doc_id, earlier + status.get("chunks_committed", 0))

        try:
            job = self.server.scheduler.submit_background(
                lambda: library.add_steps(documents, status, on_commit=committed),
                self.server.limits.ingest_timeout_s, tenant=tenant)
        except QueueFull as e:
            release()
            if not resumed:  # never accepted: the record says so, and the caller answers 429
                book.end(record, FAILED, str(e))
            raise
        if resumed:
            book.resumed(record)
        ingest = IngestJob(record, job, status, earlier)
        self.live[ingest.id] = ingest
        job.future.add_done_callback(lambda f: self._ended(ingest))
        job.future.add_done_callback(lambda f: release())
        return ingest

    def admit(self, tenant: str, library, documents: list[dict]):
        """Charge the precompute's token-layers to the tenant's budget and in-flight cost as a prefill's are (a
        TenantOverBudget, a 429, when they do not fit); returns what gives the in-flight cost back."""
        cost = library.precompute_cost(documents)
        if not cost:  # every chunk is in the library already: nothing to compute
            return lambda: None
        release = self.server.in_flight.admit(tenant, cost)
        try:
            self.server.requests.budget.charge(tenant, cost)  # a refused job is charged nothing
        except BaseException:
            release()
            raise
        return release

    def _ended(self, ingest: IngestJob) -> None:
        """Record how the job ended (on the scheduler's thread, right after its last unit)."""
        state, f = ingest.state(), ingest.job.future
        try:
            if state == SUCCEEDED:
                r = f.result()
                self.book().end(ingest.record, state, chunks_added=r.chunks_added + ingest.earlier,
                                chunks_removed=r.chunks_removed, unchanged=r.unchanged,
                                chunks_total=ingest.chunks_total())
            else:  # a shutdown keeps its documents, for the next server to resume
                self.book().end(ingest.record, state, None if state == INTERRUPTED else str(f.exception()))
        except Exception:  # noqa: BLE001 - the library is down: the next server finds the job interrupted
            log.exception("could not record the end of ingestion job %s", ingest.id)

    # -- reading --------------------------------------------------------------------------------------------
    def get(self, tenant: str, job_id: str) -> dict | None:
        """The tenant's job as the API shows it (None: unknown here, or another tenant's). Blocking."""
        live = self.live.get(job_id)
        if live is not None:
            return view(live.record, live) if live.tenant == tenant else None
        if not self.has_library():
            return None
        record = self.book().get(tenant, job_id)
        return None if record is None else view(record)

    def list(self, tenant: str) -> list[dict]:
        if not self.has_library():
            return []
        return [view(self.live[r["id"]].record, self.live[r["id"]]) if r["id"] in self.live else view(r)
                for r in self.book().list(tenant)]

    def cancel(self, tenant: str, job_id: str) -> dict | None:
        """Cancel between two units: documents already committed stay (each is added atomically)."""
        live = self.live.get(job_id)
        if live is not None and live.tenant == tenant:
            live.job.cancel()
            return view(live.record, live)
        record = self.book().get(tenant, job_id) if self.has_library() else None
        if record is not None and record["state"] not in ENDED:  # interrupted, not resumed here
            self.book().end(record, CANCELLED, "cancelled while interrupted")
        return None if record is None else view(record)

    # -- after a restart ----------------------------------------------------------------------------------------
    def recover_in_background(self) -> None:
        """Take over and resume, off the start-up path, the jobs a previous server left unfinished."""
        if self.has_library():
            threading.Thread(target=self._recover, name="ragkv-recover-jobs", daemon=True).start()

    def _recover(self) -> None:
        wait = RECOVER_RETRY_S[0]
        while not self.server.scheduler.stopping.is_set():
            try:
                records = self.book().recover()
                break
            except Exception as e:  # noqa: BLE001 - a library that cannot be read yet: retried, never fatal
                log.warning("cannot read the ingestion jobs of the library yet (%s: %s); retrying in %.0f s",
                            type(e).__name__, e, wait)
                time.sleep(wait)
                wait = min(RECOVER_RETRY_S[1], 2 * wait)
        else:
            return
        for record in records:
            remaining = self.book().remaining(record)
            log.warning("ingestion job %s was interrupted by a restart with %d of %d documents committed; resuming "
                        "the other %d", record["id"], len(record["committed"]), record["documents_total"],
                        len(remaining))
            library = self.server.library(record["tenant"])
            while not self.server.scheduler.stopping.is_set():
                try:
                    self.start(record["tenant"], library, remaining, record)
                    break
                except QueueFull:  # other jobs first; this one waits its turn
                    time.sleep(1.0)
