"""The tenant's document library over HTTP: POST/GET /v1/documents, DELETE /v1/documents/{id}, the ingestion jobs
(GET /v1/documents/jobs, GET/DELETE /v1/documents/jobs/{id}) and POST /v1/retrieve. Ingestion runs on the scheduler
as a background job that yields to chat requests between short units (serve/ingest.py)."""

from __future__ import annotations

import asyncio
import unicodedata

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ragkv.serve.errors import ApiError
from ragkv.serve.http import answer_off_loop, observed, parse, server_of
from ragkv.serve.schemas import DocumentsRequest, Retrieval

router = APIRouter()


class RetrieveRequest(Retrieval):
    """POST /v1/retrieve: the library's `top_k` chunks for `query` (an empty query is a 400)."""
    query: str


@router.post("/v1/documents")
@observed("documents")
async def add_documents(request: Request):
    """Ingestion runs as a background job that yields to chat requests between short units, recorded in the
    library before it is queued (a restart resumes it). By default the call waits for it (200 with the report);
    with `"wait": false` it answers 202 with the job to poll."""
    server = server_of(request)
    req = await parse(request, DocumentsRequest)
    server.requests.check_documents(len(req.documents), [d.text for d in req.documents], "documents",
                                    [d.id for d in req.documents], need_text=True)
    tenant = request.state.tenant
    library = await asyncio.to_thread(server.library, tenant)  # the embedder loads once, off the loop
    # parsed now: ids are final (a hash of title and text where none is given), as the job's record keeps them
    docs = [{"id": d.doc_id, "title": d.title, "text": d.text}
            for d in library.parse([d.model_dump() for d in req.documents])]
    ingest = await asyncio.to_thread(server.ingest.start, tenant, library, docs)
    if not req.wait:
        return JSONResponse(await asyncio.to_thread(server.ingest.get, tenant, ingest.id), status_code=202)
    job = ingest.job
    try:
        report = await asyncio.shield(asyncio.wrap_future(job.future))
    except asyncio.CancelledError:
        job.cancel()
        raise
    return {"object": "list", "added_chunks": report.chunks_added, "unchanged": report.unchanged,
            "job": ingest.id, "data": [vars(d) for d in library.documents()]}


def not_found(job_id: str) -> ApiError:
    return ApiError(404, f"no ingestion job {job_id!r}", code="job_not_found", param="job_id")


@router.get("/v1/documents/jobs")
async def list_jobs(request: Request):
    """The tenant's ingestion jobs, newest first, this server's and those it took over after a restart."""
    jobs = await asyncio.to_thread(server_of(request).ingest.list, request.state.tenant)
    return {"object": "list", "data": jobs}


@router.get("/v1/documents/jobs/{job_id}")
async def job_status(request: Request, job_id: str):
    found = await asyncio.to_thread(server_of(request).ingest.get, request.state.tenant, job_id)
    if found is None:  # another tenant's job does not exist here
        raise not_found(job_id)
    return found


@router.delete("/v1/documents/jobs/{job_id}")
async def cancel_job(request: Request, job_id: str):
    """Cancel between two units: documents already committed stay (each is added atomically)."""
    found = await asyncio.to_thread(server_of(request).ingest.cancel, request.state.tenant, job_id)
    if found is None:
        raise not_found(job_id)
    return {**found, "cancel_requested": True}


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
    doc_id = unicodedata.normalize("NFC", doc_id)  # ids are kept in NFC: `café` typed either way is one document
    library = await asyncio.to_thread(server_of(request).library, request.state.tenant)
    removed = library.remove(doc_id)
    if not removed:
        raise ApiError(404, f"no document {doc_id!r}", code="document_not_found")
    return {"id": doc_id, "deleted": True, "chunks_removed": removed}
