"""POST /v1/chat/completions and /v1/completions (streamed or not; n choices, log-probabilities) and GET /v1/models.

A request is parsed and prepared (retrieval, tokenization, segments: serve/requests.py) on a worker thread, then
queued on the scheduler, whose model thread only prefills and decodes it."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ragkv.engine.scheduler import JobTimeout
from ragkv.serve.choices import Chunks, TokenText, final_choice
from ragkv.serve.errors import to_api_error
from ragkv.serve.http import check_model, observed, parse, server_of
from ragkv.serve.requests import Prepared
from ragkv.serve.schemas import ChatRequest, CompletionRequest

router = APIRouter()


def usage(stats, completion_tokens: int | None = None) -> dict:
    """`completion_tokens`: of all choices (default: the one sequence's)."""
    completion = stats.completion_tokens if completion_tokens is None else completion_tokens
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": completion,
            "total_tokens": stats.prompt_tokens + completion, "reused_tokens": stats.reused_tokens,
            "recomputed_tokens": stats.recomputed_tokens,
            # the work behind the prompt: token-layers computed, and as a fraction of a full prefill's
            "recomputed_token_layers": stats.recomputed_token_layers,
            "recompute_vs_full": stats.to_dict()["recompute_vs_full"],
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},  # found in the store, as OpenAI means
            # blocks computed for this request that the store could not keep, and whether a store fault made it
            # compute everything without the cache
            "uncached_blocks": stats.extra.get("uncached_blocks", 0), "store_fault": "store_fault" in stats.extra,
            # how the prompt was computed and how close to `full` it is believed to be (the mode's own statement)
            "fidelity": stats.fidelity}


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def response_id(chat: bool) -> tuple[str, int]:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time())


async def generate(request: Request, schema, chat: bool):
    server = server_of(request)
    req = await parse(request, schema)
    check_model(server, req.model)
    build = server.requests.chat if chat else server.requests.completion
    # retrieval and tokenization on a worker thread: neither the event loop nor the model thread waits for them
    prepared = await asyncio.to_thread(build, req, request.state.tenant)
    if req.stream:
        return await stream(request, req, prepared, chat)
    return await complete(request, req, prepared, chat)


async def complete(request: Request, req, prepared: Prepared, chat: bool):
    server = server_of(request)
    timeout_s = server.scheduler.timeout_s
    job = server.start(prepared)
    fut = asyncio.wrap_future(job.future)
    deadline = time.monotonic() + timeout_s + 5
    try:
        while not fut.done():  # a client that went away frees its batch slot at the next step
            await asyncio.wait({fut}, timeout=0.25)
            if not fut.done() and (await request.is_disconnected() or time.monotonic() > deadline):
                job.cancel()
                if time.monotonic() > deadline:
                    raise JobTimeout(f"generation exceeded {timeout_s:.0f} s")
                return JSONResponse({"error": {"message": "client disconnected"}}, status_code=499)
        p, seq, finish = fut.result()
    except (asyncio.TimeoutError, asyncio.CancelledError):
        job.cancel()
        raise
    stats = seq.stats
    if finish == "timeout":
        raise JobTimeout(f"generation exceeded {timeout_s:.0f} s")
    rid, created = response_id(chat)
    text, logprobs = TokenText(server.engine.tokenizer), req.logprobs_count() is not None
    choices = [final_choice(i, s, chat, text, logprobs) for i, s in enumerate(job.seqs)]
    completion = sum(s.stats.completion_tokens for s in job.seqs)
    return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                         "created": created, "model": server.model_id, "choices": choices,
                         "usage": usage(stats, completion),
                         "ragkv": {"stats": stats.to_dict(), "sources": p.sources}})


async def stream(request: Request, req, prepared: Prepared, chat: bool):
    server = server_of(request)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    job = server.start(prepared, emit=lambda kind, payload: loop.call_soon_threadsafe(
        events.put_nowait, (kind, payload)))
    job.future.add_done_callback(lambda f: loop.call_soon_threadsafe(events.put_nowait, ("done", f)))
    kind, payload = await events.get()
    if kind == "done":  # failed before the first token: a normal error response
        job.future.result()
    rid, created = response_id(chat)
    chunks = Chunks(rid, created, server.model_id, chat, TokenText(server.engine.tokenizer),
                    req.logprobs_count() is not None)

    async def body():
        try:
            if chat:
                for i in range(req.n):
                    yield sse(chunks.role(i))
            while True:
                kind, payload = await events.get()
                if kind == "delta":
                    yield sse(chunks.delta(*payload))
                elif kind == "done":
                    try:
                        p, seq, finish = payload.result()
                        stats = seq.stats
                    except Exception as e:  # noqa: BLE001
                        err = to_api_error(e)
                        yield sse({"error": {"message": err.message, "type": err.type, "code": err.code}})
                        break
                    for i, s in enumerate(job.seqs):  # the last one carries the request's statistics
                        last = chunks.finish(i, s.out.finish_reason)
                        if i == len(job.seqs) - 1:
                            last["ragkv"] = {"stats": stats.to_dict(), "sources": p.sources}
                        yield sse(last)
                    if req.stream_options and req.stream_options.include_usage:
                        completion = sum(s.stats.completion_tokens for s in job.seqs)
                        yield sse(chunks.envelope([]) | {"usage": usage(stats, completion)})
                    yield "data: [DONE]\n\n"
                    break
        finally:
            job.cancel()  # a client that went away frees the model at the next token

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@router.post("/v1/chat/completions")
@observed("chat")
async def chat_completions(request: Request):
    return await generate(request, ChatRequest, chat=True)


@router.post("/v1/completions")
@observed("completions")
async def completions(request: Request):
    return await generate(request, CompletionRequest, chat=False)


@router.get("/v1/models")
async def models(request: Request):
    server = server_of(request)
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "ragkv",
                                        "max_model_len": server.engine.max_positions}
                                       for name in server.model_names]}
