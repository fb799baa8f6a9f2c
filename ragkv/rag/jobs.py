"""Ingestion jobs that outlive the process running them: each job's record and the documents it accepted are kept
in the document library (ragkv.rag.catalog's SQLite file, or the Redis library), written when the job is accepted
and again as each document is committed.

Why: a 202 means "accepted". If the server dies (kill -9, OOM, a deploy) before the job ends, the next server over
the same library finds the job, reports it `interrupted` with what was committed, and resumes the documents not yet
committed from the texts kept with it, so an accepted document is never silently dropped. A job that was resumed
MAX_RESUMES times and was interrupted again (a document that kills the process?) is not resumed any more: it stays
`interrupted` and lists the documents to send again.

A job belongs to the server that runs it (`owner`: host, process id and a per-server nonce). Another server takes
it over only once that owner is gone: on the same host, when its process no longer exists (or it is an earlier
server of this very process); elsewhere, when the job has not moved for LEASE_S. Several servers may share one
library; a claim is a compare-and-set on the owner, so only one of them resumes a job.
"""

from __future__ import annotations

import os
import socket
import time
import uuid

RUNNING, SUCCEEDED, FAILED, CANCELLED, INTERRUPTED = "running", "succeeded", "failed", "cancelled", "interrupted"
ENDED = (SUCCEEDED, FAILED, CANCELLED)
MAX_RESUMES = 3                 # resumes of one job after interruptions; then its documents must be resent
LEASE_S = 600.0                 # a job of another host that has not moved for this long is taken as abandoned
RETENTION_S = 7 * 24 * 3600.0   # ended jobs' records are kept this long, then pruned


def new_owner() -> str:
    """This server's identity on its jobs: host, process id, and a nonce telling two servers of one process apart."""
    return f"{socket.gethostname()}|{os.getpid()}|{uuid.uuid4().hex[:8]}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # it exists (another user's), or we cannot tell: assume alive
    return True


def owner_gone(owner: str, me: str, updated_at: float, now: float | None = None) -> bool:
    """Whether the server that owns a running job is gone (so the job was interrupted)."""
    if owner == me:
        return False
    host, pid, _ = (owner.split("|") + ["", "", ""])[:3]
    my_host, my_pid, _ = me.split("|")
    if host == my_host and pid.isdigit():
        # an earlier server of this very process (restarted in place), or a process that no longer exists
        if pid == my_pid or not _pid_alive(int(pid)):
            return True
    return (now if now is not None else time.time()) - updated_at > LEASE_S


class JobBook:
    """The durable records of ingestion jobs in one library (`catalog`: ragkv.rag.catalog.Catalog or
    ragkv.rag.redis_catalog.RedisCatalog), as seen by the server `owner`.

    A record: id, tenant, state (running, succeeded, failed, cancelled, interrupted), documents_total,
    committed (ids of the documents in the library), chunks_committed (their new chunks), restarts, error, the last report figures, timestamps; while the
    job has not ended, its accepted documents ({id, title, text}) are kept beside it."""

    def __init__(self, catalog, owner: str | None = None):
        self.catalog, self.owner = catalog, owner or new_owner()

    def open(self, job_id: str, tenant: str, documents: list[dict]) -> dict:
        """Record a job as it is accepted, with its documents (written before the 202 answers)."""
        now = time.time()
        record = {"id": job_id, "tenant": tenant, "state": RUNNING, "owner": self.owner, "created_at": now,
                  "updated_at": now, "documents_total": len(documents), "accepted": [d["id"] for d in documents],
                  "committed": [], "restarts": 0, "error": None}
        self.catalog.put_job(record, documents)
        return record

    def save(self, record: dict) -> None:
        record.update(updated_at=time.time(), owner=self.owner)
        self.catalog.put_job(record)

    def committed(self, record: dict, doc_id: str, chunks: int | None = None) -> None:
        """One more document is in the library (saved at once: what a restart resumes from); `chunks`: the new
        chunks of the job's committed documents so far, which a resumed run counts as done."""
        if doc_id not in record["committed"]:
            record["committed"].append(doc_id)
            if chunks is not None:
                record["chunks_committed"] = chunks
            self.save(record)

    def end(self, record: dict, state: str, error: str | None = None, **figures) -> None:
        """The job ended: succeeded, failed or cancelled (its documents are dropped; the uncommitted ones are listed
        in the record), or interrupted by a shutdown (kept, to be resumed by the next server)."""
        record.update(state=state, error=error, **figures)
        if state in ENDED:
            record["uncommitted"] = self.uncommitted(record)
        self.save(record)
        if state in ENDED:
            self.catalog.drop_job_documents(record["id"])

    def documents(self, record: dict) -> list[dict]:
        return self.catalog.job_documents(record["id"])

    @staticmethod
    def uncommitted(record: dict) -> list[str]:
        """Ids of the accepted documents not (yet) in the library."""
        done = set(record["committed"])
        return [i for i in dict.fromkeys(record["accepted"]) if i not in done]

    def remaining(self, record: dict) -> list[dict]:
        """The accepted documents not yet in the library ({id, title, text}), what a resumed job ingests."""
        done = set(record["committed"])
        return [d for d in self.documents(record) if d["id"] not in done]

    def list(self, tenant: str) -> list[dict]:
        """The tenant's jobs, newest first (states as `get` reads them)."""
        records = [r for r in self.catalog.jobs((RUNNING, INTERRUPTED) + ENDED) if r["tenant"] == tenant]
        return [self._seen(r) for r in sorted(records, key=lambda r: -r["created_at"])]

    def get(self, tenant: str, job_id: str) -> dict | None:
        """The tenant's job as it stands (None: no such job, or another tenant's). A running job whose server is
        gone reads `interrupted`, even before a server has taken it over."""
        record = self.catalog.get_job(job_id)
        if record is None or record["tenant"] != tenant:
            return None
        return self._seen(record)

    def _seen(self, record: dict) -> dict:
        if record["state"] == RUNNING and owner_gone(record["owner"], self.owner, record["updated_at"]):
            record["state"] = INTERRUPTED
        return record

    def recover(self) -> list[dict]:
        """Take over the jobs whose server is gone (running ones) or stopped them (interrupted ones): each is
        recorded `interrupted`. Returns those to resume (fewer than MAX_RESUMES restarts, documents kept); the
        others keep their documents listed in `uncommitted`, to be resent. Also prunes old ended records."""
        self.catalog.prune_jobs(ENDED, time.time() - RETENTION_S)
        resume = []
        for record in self.catalog.jobs((RUNNING, INTERRUPTED)):
            if record.get("given_up") or record["owner"] == self.owner:
                continue
            if record["state"] == RUNNING and not owner_gone(record["owner"], self.owner, record["updated_at"]):
                continue  # another live server's job
            was = record["owner"]
            now = time.time()
            record.update(state=INTERRUPTED, owner=self.owner, updated_at=now, interrupted_at=now)
            if record.get("restarts", 0) >= MAX_RESUMES:
                record.update(given_up=True, uncommitted=self.uncommitted(record),
                              error=f"interrupted {record['restarts'] + 1} times; send the documents listed in "
                                    "`uncommitted` again")
            if not self.catalog.claim_job(record, was):
                continue  # another server took it first
            if record.get("given_up"):
                self.catalog.drop_job_documents(record["id"])
            else:
                resume.append(record)
        return resume

    def resumed(self, record: dict) -> None:
        """A recovered job runs again (its remaining documents)."""
        record["restarts"] = record.get("restarts", 0) + 1
        record["state"] = RUNNING
        self.save(record)
