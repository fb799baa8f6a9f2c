"""POST /v1/chat/completions and /v1/completions (streamed or not; n choices, log-probabilities) and GET /v1/models.

A request is parsed and prepared (retrieval, tokenization, segments: serve/requests.py) on a worker thread, then
queued on the scheduler, whose model thread only prefills and decodes it."""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ragkv.serve.scheduling import JobTimeout
from ragkv.serve.choices import Chunks, TokenText, final_choice, with_tool_calls
from ragkv.serve.errors import to_api_error
from ragkv.serve.http import check_model, observed, parse, server_of
from ragkv.serve.requests import Prepared
from ragkv.serve.schemas import ChatRequest, CompletionRequest
from ragkv.serve.tools import ToolCallError

router = APIRouter()
# how often a waiting handler asks whether its client is still there: a prefill unit on a fast 2-core CPU can be
# shorter than a quarter second, and each poll missed is a unit of work for nobody
DISCONNECT_POLL_S = 0.1


def usage(stats, completion_tokens: int | None = None) -> dict:
    """`completion_tokens`: of all choices (default: the one sequence's). `stats`: one prompt's RequestStats, or
    a list of them (several prompts: their counts add up)."""
    all_stats = stats if isinstance(stats, list) else [stats]
    total = lambda name: sum(getattr(s, name) for s in all_stats)  # noqa: E731
    completion = total("completion_tokens") if completion_tokens is None else completion_tokens
    full = total("full_token_layers")
    return {"prompt_tokens": total("prompt_tokens"), "completion_tokens": completion,
            "total_tokens": total("prompt_tokens") + completion, "reused_tokens": total("reused_tokens"),
            "recomputed_tokens": total("recomputed_tokens"),
            # the work behind the prompt: token-layers computed, and as a fraction of a full prefill's
            "recomputed_token_layers": total("recomputed_token_layers"),
            "recompute_vs_full": round(total("recomputed_token_layers") / full, 4) if full else None,
            "prompt_tokens_details": {"cached_tokens": total("cached_tokens")},  # found in the store, as OpenAI means
            # blocks computed for this request that the store could not keep, and whether a store fault made it
            # compute everything without the cache
            "uncached_blocks": sum(s.extra.get("uncached_blocks", 0) for s in all_stats),
            "store_fault": any("store_fault" in s.extra for s in all_stats),
            # a chat's earlier turns as blocks: how many were computed exactly (prefix cache) and how many fused
            "history": all_stats[0].extra.get("history"),
            # how the prompt was computed and how close to `full` it is believed to be (the mode's own statement)
            "fidelity": all_stats[0].fidelity}


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
    prepared = prepared if isinstance(prepared, list) else [prepared]  # completions: one per prompt
    if req.stream:
        return await stream(request, req, prepared, chat)
    return await complete(request, req, prepared, chat)


def start_all(server, prepared: list[Prepared], emit=None) -> list:
    """Queue every prompt's generation (they decode batched together); a full queue part-way cancels the ones
    already queued, so a refused request leaves no work behind."""
    jobs = []
    try:
        for k, p in enumerate(prepared):
            jobs.append(server.start(p, emit=None if emit is None else functools.partial(emit, k)))
    except BaseException:
        for job in jobs:
            job.cancel()
        raise
    return jobs


def ragkv_extras(results: list) -> dict:
    """The response's `ragkv` object: the (first) prompt's statistics and sources, each prompt's when the
    request had several, and `stopped: "deadline"` when the server's deadline ended a generation early."""
    (p, seq, _), *more = results
    out = {"stats": seq.stats.to_dict(), "sources": p.sources}
    if any(finish == "timeout" for _, _, finish in results):
        out["stopped"] = "deadline"
    if more:
        out["prompts"] = [{"stats": s.stats.to_dict(), "sources": q.sources} for q, s, _ in results]
    return out


def _retrieved(fut: asyncio.Future) -> None:
    """Mark an abandoned job's outcome as seen, so asyncio does not log "Future exception was never retrieved"."""
    if not fut.cancelled():
        fut.exception()


def generation_timeout(timeout_s: float) -> JobTimeout:
    return JobTimeout(f"generation exceeded {timeout_s:.0f} s")


async def complete(request: Request, req, prepared: list[Prepared], chat: bool):
    server = server_of(request)
    timeout_s = server.scheduler.timeout_s
    jobs = start_all(server, prepared)
    futs = [asyncio.wrap_future(job.future) for job in jobs]
    deadline = time.monotonic() + timeout_s + 5
    try:
        while not all(f.done() for f in futs):  # a client that went away frees its batch slots at the next step
            await asyncio.wait([f for f in futs if not f.done()], timeout=DISCONNECT_POLL_S)
            if not all(f.done() for f in futs) and (await request.is_disconnected() or time.monotonic() > deadline):
                for job, f in zip(jobs, futs):
                    job.cancel()
                    f.add_done_callback(_retrieved)  # nobody awaits it now: its `cancelled` error is expected
                if time.monotonic() > deadline:
                    raise generation_timeout(timeout_s)
                return JSONResponse({"error": {"message": "client disconnected"}}, status_code=499)
        results = [f.result() for f in futs]
    except BaseException:  # one prompt failed (or the handler was cancelled): the others stop too
        for job in jobs:
            job.cancel()
        raise
    rid, created = response_id(chat)
    text, logprobs = TokenText(server.engine.tokenizer), req.logprobs_count() is not None
    # choice index = prompt index * n + choice within the prompt, as OpenAI and vLLM number them
    choices = [final_choice(k * req.n + i, s, chat, text, logprobs)
               for k, job in enumerate(jobs) for i, s in enumerate(job.seqs)]
    if chat and prepared[0].tools:  # call blocks become message.tool_calls
        choices = [with_tool_calls(c, prepared[0].tools, prepared[0].calls_required) for c in choices]
    completion = sum(s.stats.completion_tokens for job in jobs for s in job.seqs)
    return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                         "created": created, "model": server.model_id, "choices": choices,
                         "usage": usage([seq.stats for _, seq, _ in results], completion),
                         "ragkv": ragkv_extras(results)})


async def event_or_gone(request: Request, events: asyncio.Queue, deadline: float, timeout_s: float):
    """The next event, or None once the client has disconnected (checked while none comes); JobTimeout once the
    deadline has passed without one (a guard: the worker ends every job by its deadline, but a stream must never
    wait for ever on a job that was not ended)."""
    while True:
        try:
            return await asyncio.wait_for(events.get(), timeout=DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                return None
            if time.monotonic() > deadline:
                raise generation_timeout(timeout_s) from None


async def stream(request: Request, req, prepared: list[Prepared], chat: bool):
    server = server_of(request)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()  # (prompt index, kind, payload)
    jobs = start_all(server, prepared, emit=lambda k, kind, payload: loop.call_soon_threadsafe(
        events.put_nowait, (k, kind, payload)))
    for k, job in enumerate(jobs):
        job.future.add_done_callback(lambda f, k=k: loop.call_soon_threadsafe(events.put_nowait, (k, "done", f)))
    # every prompt's first event before answering 200: one that fails before its first token is a normal error
    early, started = [], set()
    timeout_s = server.scheduler.timeout_s
    deadline = time.monotonic() + timeout_s + 5
    try:
        while len(started) < len(jobs):
            got = await event_or_gone(request, events, deadline, timeout_s)
            if got is None:  # the client left before the first token: its queued or prefilling work stops now
                for job in jobs:
                    job.cancel()
                return JSONResponse({"error": {"message": "client disconnected"}}, status_code=499)
            k, kind, payload = got
            if kind == "done" and k not in started:
                payload.result()  # raises the failure
            started.add(k)
            early.append((k, kind, payload))
    except BaseException:
        for job in jobs:
            job.cancel()
        raise
    rid, created = response_id(chat)
    chunks = Chunks(rid, created, server.model_id, chat, TokenText(server.engine.tokenizer),
                    req.logprobs_count() is not None)

    async def next_event():
        if early:
            return early.pop(0)
        return await asyncio.wait_for(events.get(), timeout=max(0.0, deadline - time.monotonic()))

    async def body():
        results: dict[int, tuple] = {}
        try:
            if chat:
                for i in range(req.n):
                    yield sse(chunks.role(i))
            tools = chat and prepared[0].tools  # the answer is held until done: only then is it known to be calls
            while len(results) < len(jobs):
                try:
                    k, kind, payload = await next_event()
                except asyncio.TimeoutError:
                    err = to_api_error(generation_timeout(timeout_s))
                    yield sse({"error": {"message": err.message, "type": err.type, "code": err.code}})
                    return
                if kind == "delta" and not tools:
                    i, delta = payload
                    yield sse(chunks.delta(k * req.n + i, delta))
                elif kind == "done":
                    try:
                        results[k] = payload.result()
                    except Exception as e:  # noqa: BLE001
                        err = to_api_error(e)
                        yield sse({"error": {"message": err.message, "type": err.type, "code": err.code}})
                        return
                    for i, s in enumerate(jobs[k].seqs):  # the request's last one carries the statistics
                        reason = s.out.finish_reason
                        if tools:
                            try:
                                pieces, called = chunks.tool_deltas(k * req.n + i, s.out.text, prepared[k].tools,
                                                                    reason, prepared[k].calls_required)
                            except ToolCallError as e:
                                err = to_api_error(e)
                                yield sse({"error": {"message": err.message, "type": err.type, "code": err.code}})
                                return
                            for piece in pieces:
                                yield sse(piece)
                            reason = "tool_calls" if called else reason
                        last = chunks.finish(k * req.n + i, reason)
                        if len(results) == len(jobs) and i == len(jobs[k].seqs) - 1:
                            last["ragkv"] = ragkv_extras([results[j] for j in range(len(jobs))])
                        yield sse(last)
            if req.stream_options and req.stream_options.include_usage:
                completion = sum(s.stats.completion_tokens for job in jobs for s in job.seqs)
                stats = [results[j][1].stats for j in range(len(jobs))]
                yield sse(chunks.envelope([]) | {"usage": usage(stats, completion)})
            yield "data: [DONE]\n\n"
        finally:
            for job in jobs:
                job.cancel()  # a client that went away frees the model at the next token
            # a cancelled stream's traceback keeps this frame in a cycle until a full garbage collection: the frame
            # must not keep the jobs and their sequences
            jobs.clear()
            results.clear()

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
