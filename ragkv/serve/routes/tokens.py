"""vLLM's POST /tokenize and /detokenize (serve/tokens.py) and OpenAI's POST /v1/embeddings (serve/embeddings.py):
requests that do not generate, answered on a worker thread."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ragkv.serve.embeddings import EMBEDDING_NAMES, embed
from ragkv.serve.errors import ApiError
from ragkv.serve.http import answer_off_loop, check_model, observed, server_of
from ragkv.serve.schemas import DetokenizeRequest, EmbeddingsRequest, TokenizeRequest
from ragkv.serve.tokens import detokenize, tokenize

router = APIRouter()


def with_model(request: Request, fn):
    """`fn(engine, req)` once `req.model` is checked against the served names."""
    server = server_of(request)

    def run(req):
        check_model(server, req.model)
        return fn(server.engine, req)
    return run


@router.post("/tokenize")
@observed("tokenize")
async def tokenize_route(request: Request):
    return await answer_off_loop(request, TokenizeRequest, with_model(request, tokenize))


@router.post("/detokenize")
@observed("detokenize")
async def detokenize_route(request: Request):
    return await answer_off_loop(request, DetokenizeRequest, with_model(request, detokenize))


def embeddings(req: EmbeddingsRequest) -> dict:
    if req.model is not None and req.model not in EMBEDDING_NAMES:
        raise ApiError(404, f"model {req.model!r} does not embed here; embeddings come from "
                            f"{' or '.join(map(repr, EMBEDDING_NAMES))}", code="model_not_found", param="model")
    from ragkv.rag.embedding import get_embedder  # the library's embedder: loaded once, on first use
    return embed(get_embedder(), req)


@router.post("/v1/embeddings")
@observed("embeddings")
async def embeddings_route(request: Request):
    return await answer_off_loop(request, EmbeddingsRequest, embeddings)
