"""GET /health (open without a key) and GET /metrics (Prometheus; open unless --metrics-need-key)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ragkv.serve.http import server_of

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    server = server_of(request)
    return {"status": "ok", "model": server.model_id, "dtype": server.engine.dtype_name,
            "decode_weights": server.engine.decode_weights,
            "write_back_pending": server.engine.write_back_pending(),
            # blocks read in place by kv_layout=shared sequences (besides the caches' kv_bytes_in_use)
            "block_pool_bytes": server.engine.pool_stats()["bytes"],
            **server.scheduler.stats()}


@router.get("/metrics")
async def metrics(request: Request):
    body, content_type = server_of(request).metrics.render(request.headers.get("accept"))
    return Response(body, media_type=content_type)
