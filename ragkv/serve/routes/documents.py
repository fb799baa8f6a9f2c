"""The tenant's document library over HTTP: POST/GET /v1/documents, DELETE /v1/documents/{id}, the ingestion jobs
(GET/DELETE /v1/documents/jobs/{id}) and POST /v1/retrieve. Ingestion runs on the scheduler as a background job
that yields to chat requests between short units."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ragkv.engine.scheduler import Cancelled
from ragkv.serve.errors import ApiError
from ragkv.serve.http import answer_off_loop, observed, parse, server_of
from ragkv.serve.schemas import DocumentsRequest, Retrieval

router = APIRouter()


class RetrieveRequest(Retrieval):
    """POST /v1/retrieve: the library's `top_k` chunks for `query` (an empty query is a 400)."""
    query: str


@dataclass
class IngestJob:
    id: str
    tenant: str
    job: object
    status: dict

    def as_dict(self) -> dict:
        f = self.job.future
        state = "running" if not f.done() else "cancelled" if isinstance(f.exception(), Cancelled) else \
            "failed" if f.exception() is not None else "succeeded"
        out = {"id": self.id, "object": "ingest.job", "status": state, **self.status}
        if state == "failed":
            out["error"] = str(f.exception())
        if state == "succeeded":
            r = f.result()
            out.update(chunks_added=r.chunks_added, chunks_removed=r.chunks_removed, unchanged=r.unchanged)
        return out


@router.post("/v1/documents")
@observed("documents")
async def add_documents(request: Request):
    """Ingestion runs as a background job that yields to chat requests between short units. By default the
    call waits for it (200 with the report); with `"wait": false` it answers 202 with the job to poll."""
    server = server_of(request)
    req = await parse(request, DocumentsRequest)
    server.requests.check_documents(len(req.documents), (d.text for d in req.documents), "documents")
    tenant = request.state.tenant
    library = await asyncio.to_thread(server.library, tenant)  # the embedder loads once, off the loop
    docs = [d.model_dump() for d in req.documents]
    library.parse(docs)  # an empty text is a 400 now, not a failed job later
    status: dict = {"documents_total": len(docs), "documents_done": 0, "chunks_total": None, "chunks_done": 0}
    job = server.scheduler.submit_background(lambda: library.add_steps(docs, status), server.limits.ingest_timeout_s)
    ingest = IngestJob(f"ingest-{uuid.uuid4().hex[:16]}", tenant, job, status)
    server.ingest_jobs[ingest.id] = ingest
    if not req.wait:
        return JSONResponse(ingest.as_dict(), status_code=202)
    try:
        report = await asyncio.shield(asyncio.wrap_future(job.future))
    except asyncio.CancelledError:
        job.cancel()
        raise
    return {"object": "list", "added_chunks": report.chunks_added, "unchanged": report.unchanged,
            "job": ingest.id, "data": [vars(d) for d in library.documents()]}


def own_job(request: Request, job_id: str) -> IngestJob:
    ingest = server_of(request).ingest_jobs.get(job_id)
    if ingest is None or ingest.tenant != request.state.tenant:  # another tenant's job does not exist here
        raise ApiError(404, f"no ingestion job {job_id!r}", code="job_not_found", param="job_id")
    return ingest


@router.get("/v1/documents/jobs/{job_id}")
async def job_status(request: Request, job_id: str):
    return own_job(request, job_id).as_dict()


@router.delete("/v1/documents/jobs/{job_id}")
async def cancel_job(request: Request, job_id: str):
    """Cancel between two units: documents already committed stay (each is added atomically)."""
    ingest = own_job(request, job_id)
    ingest.job.cancel()
    return {**ingest.as_dict(), "cancel_requested": True}


@router.get("/v1/documents")
async def list_documents(request: Request):
    library = await asyncio.to_thread(server_of(request).library, request.state.tenant)
    return {"object": "list", "data": [vars(d) for d in library.documents()]}


@router.post("/v1/retrieve")
@observed("retrieve")
async def retrieve(request: Request):
    """The chunks `ragkv.retrieval` would answer from, with their text: clients (ragkv.integrations) send
    them back as `ragkv.documents`, whose KV the library precomputed."""
    def chunks(req: RetrieveRequest) -> dict:
        found = server_of(request).library(request.state.tenant).retrieve(req.query, req.top_k)
        return {"object": "list", "data": [{"text": r.passage.text, "title": r.passage.title, "doc_id": r.doc_id,
                                            "chunk_id": r.chunk_id, "score": round(r.score, 4)} for r in found]}
    return await answer_off_loop(request, RetrieveRequest, chunks)


@router.delete("/v1/documents/{doc_id:path}")
async def delete_document(request: Request, doc_id: str):
    library = await asyncio.to_thread(server_of(request).library, request.state.tenant)
    removed = library.remove(doc_id)
    if not removed:
        raise ApiError(404, f"no document {doc_id!r}", code="document_not_found")
    return {"id": doc_id, "deleted": True, "chunks_removed": removed}
