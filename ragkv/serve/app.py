"""OpenAI-compatible endpoints over the engine: chat/completions (streaming or not), models, documents,
health and Prometheus metrics. Every model call goes through the Scheduler (one worker, continuous batching,
bounded queue)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError

from ragkv.engine.options import FusionOptions, GenerationOptions
from ragkv.engine.request import Passage, Segments
from ragkv.errors import PromptTooLongError, RagkvError
from ragkv.serve.metrics import Metrics
from ragkv.serve.scheduler import JobTimeout, QueueFull, Scheduler
from ragkv.serve.schemas import ChatRequest, CompletionRequest, DocumentsRequest, RagkvExtras

log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


def to_api_error(e: BaseException) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, PromptTooLongError):
        return ApiError(400, str(e), code="context_length_exceeded")
    if isinstance(e, RagkvError):
        return ApiError(400, str(e))
    if isinstance(e, QueueFull):
        return ApiError(429, str(e), "rate_limit_error", "queue_full")
    if isinstance(e, (JobTimeout, asyncio.TimeoutError, TimeoutError)):
        return ApiError(504, f"request timed out: {e}", "timeout_error", "timeout")
    log.exception("internal error", exc_info=e)
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error")


@dataclass
class Prepared:
    segs: Segments
    fusion: FusionOptions
    gen: GenerationOptions
    namespace: str | None
    sources: list[dict]


class Server:
    def __init__(self, engine, model_id: str, index_dir=None, max_queue: int = 64, timeout_s: float = 300.0,
                 default_fusion: FusionOptions = FusionOptions(), max_batch: int = 16, prefill_chunk: int = 512,
                 worker_thread: bool = True):
        self.engine, self.model_id, self.index_dir = engine, model_id, index_dir
        self.default_fusion = default_fusion  # the server's flags; a request's own `ragkv` fields override them
        self.metrics = Metrics()
        self.prefill_chunk = prefill_chunk  # tokens of a full/prefix prefill between two decode steps
        self.scheduler = Scheduler(engine.step, max_queue, timeout_s, max_batch, on_finish=self.metrics.observe_stats,
                                   lock=engine.lock, thread=worker_thread)
        self._library = None

    @property
    def library(self):
        if self._library is None:  # loading the embedder costs seconds: only when retrieval is used
            from ragkv.rag.library import DocumentLibrary
            self._library = DocumentLibrary(self.engine, self.index_dir)
        return self._library

    # -- request -> segments ------------------------------------------------------------------------------
    def _passages(self, extras: RagkvExtras | None, question: str) -> tuple[list[Passage], list[dict]]:
        if extras is None:
            return [], []
        passages, sources = [], []
        for d in extras.documents or []:
            p = Passage(d) if isinstance(d, str) else Passage(d.text, d.title or "")
            passages.append(p)
            sources.append({"title": p.title, "source": "inline"})
        if extras.retrieval is not None:
            for r in self.library.retrieve(question, extras.retrieval.top_k):
                passages.append(r.passage)
                sources.append({"title": r.passage.title, "chunk_id": r.chunk_id, "doc_id": r.doc_id,
                                "score": round(r.score, 4)})
        return passages, sources

    def _fusion(self, extras: RagkvExtras | None, has_blocks: bool) -> FusionOptions:
        e = extras or RagkvExtras()
        given = e.fusion_fields()
        given.setdefault("mode", self.default_fusion.mode if has_blocks else "prefix")
        return replace(self.default_fusion, **given)  # validates: unknown mode, r outside [0, 1], T or S <= 0, ...

    def _generation(self, req, default_max: int) -> GenerationOptions:
        max_new = getattr(req, "max_completion_tokens", None) or req.max_tokens
        return GenerationOptions(max_new_tokens=default_max if max_new is None else max_new,
                                 temperature=req.temperature or 0.0, top_p=req.top_p or 1.0, seed=req.seed,
                                 stop=req.stops())

    def prepare_chat(self, req: ChatRequest) -> Prepared:
        msgs = req.messages
        system = next((m.text() for m in msgs if m.role in ("system", "developer")), None)
        turns = [m for m in msgs if m.role in ("user", "assistant")]
        if not turns or turns[-1].role != "user":
            raise ApiError(400, "the last message must come from the user", param="messages")
        question = turns[-1].text()
        passages, sources = self._passages(req.ragkv, question)
        fusion = self._fusion(req.ragkv, bool(passages))
        if passages:
            history = "".join(f"{m.role.capitalize()}: {m.text()}\n" for m in turns[:-1])
            segs = self.engine.segments((history + question) if history else question, passages, system=system)
        else:
            if not question.strip():
                raise ApiError(400, "the last user message is empty", param="messages")
            segs = self.engine.chat_segments([{"role": m.role, "content": m.text()} for m in turns], system)
        return Prepared(segs, fusion, self._generation(req, 256), req.ragkv.namespace if req.ragkv else None,
                        sources)

    def prepare_completion(self, req: CompletionRequest) -> Prepared:
        prompt = req.prompt if isinstance(req.prompt, str) else "".join(req.prompt)
        if not prompt.strip():
            raise ApiError(400, "the prompt is empty", param="prompt")
        passages, sources = self._passages(req.ragkv, prompt)
        fusion = self._fusion(req.ragkv, bool(passages))
        if passages:
            segs = self.engine.segments(prompt, passages)
        else:
            segs = self.engine.text_segments(prompt)
        return Prepared(segs, fusion, self._generation(req, 16), req.ragkv.namespace if req.ragkv else None,
                        sources)

    # -- running on the scheduler ---------------------------------------------------------------------------
    def start(self, prepare, emit=None):
        """Queue a generation: the worker prepares and prefills it, then decodes it batched with the others;
        `emit(kind, payload)` streams events. The job's future resolves to (Prepared, Sequence, finish)."""

        def chunk():  # chunk a full/prefix prefill only while other answers are decoding
            return self.prefill_chunk if self.scheduler.running else None

        def begin():
            p = prepare()
            seq = yield from self.engine.start_steps(p.segs, p.fusion, p.gen, p.namespace, chunk)
            return seq, p

        return self.scheduler.submit_generation(begin, emit)


def _usage(stats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
            "total_tokens": stats.prompt_tokens + stats.completion_tokens, "reused_tokens": stats.reused_tokens,
            "recomputed_tokens": stats.recomputed_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.reused_tokens}}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="ragkv", version="0.1.0")
    app.state.server = server

    async def parse(request: Request, schema):
        try:
            data = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}")
        try:
            return schema.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(x) for x in first.get("loc", ()))
            raise ApiError(400, f"invalid request: {where}: {first.get('msg')}", param=where or None)

    def check_model(name: str | None) -> None:
        if name and name not in (server.model_id, str(server.engine.model_path)):
            raise ApiError(404, f"model {name!r} is not served here; this server runs {server.model_id!r}",
                           code="model_not_found", param="model")

    async def generate(request: Request, endpoint: str, schema, chat: bool):
        try:
            req = await parse(request, schema)
            check_model(req.model)
            prepare = (lambda: server.prepare_chat(req)) if chat else (lambda: server.prepare_completion(req))
            if req.stream:
                resp = await stream(req, prepare, chat)
            else:
                resp = await complete(request, req, prepare, chat)
            server.metrics.observe_request(endpoint, 200)
            return resp
        except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI-style error body
            err = to_api_error(e)
            server.metrics.observe_request(endpoint, err.status)
            return err.response()

    async def complete(request: Request, req, prepare, chat: bool):
        job = server.start(prepare)
        fut = asyncio.wrap_future(job.future)
        deadline = time.monotonic() + server.scheduler.timeout_s + 5
        try:
            while not fut.done():  # a client that went away frees its batch slot at the next step
                await asyncio.wait({fut}, timeout=0.25)
                if not fut.done() and (await request.is_disconnected() or time.monotonic() > deadline):
                    job.cancel()
                    if time.monotonic() > deadline:
                        raise JobTimeout(f"generation exceeded {server.scheduler.timeout_s:.0f} s")
                    return JSONResponse({"error": {"message": "client disconnected"}}, status_code=499)
            p, seq, finish = fut.result()
        except (asyncio.TimeoutError, asyncio.CancelledError):
            job.cancel()
            raise
        stats, text = seq.stats, seq.out.text
        if finish == "timeout":
            raise JobTimeout(f"generation exceeded {server.scheduler.timeout_s:.0f} s")
        rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time())
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
                  if chat else {"index": 0, "text": text, "finish_reason": finish, "logprobs": None})
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": created, "model": server.model_id, "choices": [choice],
                             "usage": _usage(stats), "ragkv": {"stats": stats.to_dict(), "sources": p.sources}})

    async def stream(req, prepare, chat: bool):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        job = server.start(prepare, emit=lambda kind, payload: loop.call_soon_threadsafe(
            events.put_nowait, (kind, payload)))
        job.future.add_done_callback(lambda f: loop.call_soon_threadsafe(events.put_nowait, ("done", f)))
        kind, payload = await events.get()
        if kind == "done":  # failed before the first token: a normal error response
            job.future.result()
        rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta_text=None, finish=None, role=False):
            if chat:
                delta = {"role": "assistant", "content": ""} if role else (
                    {"content": delta_text} if delta_text is not None else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta_text or "", "finish_reason": finish, "logprobs": None}
            return {"id": rid, "object": obj, "created": created, "model": server.model_id, "choices": [choice]}

        async def body():
            try:
                if chat:
                    yield _sse(chunk(role=True))
                while True:
                    kind, payload = await events.get()
                    if kind == "delta":
                        yield _sse(chunk(payload))
                    elif kind == "done":
                        try:
                            p, seq, finish = payload.result()
                            stats = seq.stats
                        except Exception as e:  # noqa: BLE001
                            err = to_api_error(e)
                            yield _sse({"error": {"message": err.message, "type": err.type, "code": err.code}})
                            break
                        last = chunk(finish=finish)
                        last["ragkv"] = {"stats": stats.to_dict(), "sources": p.sources}
                        yield _sse(last)
                        if req.stream_options and req.stream_options.include_usage:
                            yield _sse({"id": rid, "object": obj, "created": created, "model": server.model_id,
                                        "choices": [], "usage": _usage(stats)})
                        yield "data: [DONE]\n\n"
                        break
            finally:
                job.cancel()  # a client that went away frees the model at the next token

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, "chat", ChatRequest, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "completions", CompletionRequest, chat=False)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_id, "object": "model", "created": 0,
                                            "owned_by": "ragkv"}]}

    @app.post("/v1/documents")
    async def add_documents(request: Request):
        try:
            req = await parse(request, DocumentsRequest)
            docs = [d.model_dump() for d in req.documents]
            job = server.scheduler.submit(lambda job: server.library.add_documents(docs))
            report = await asyncio.wrap_future(job.future)
            server.metrics.observe_request("documents", 200)
            return {"object": "list", "added_chunks": report.chunks_added, "unchanged": report.unchanged,
                    "data": [vars(d) for d in server.library.documents()]}
        except Exception as e:  # noqa: BLE001
            err = to_api_error(e)
            server.metrics.observe_request("documents", err.status)
            return err.response()

    @app.get("/v1/documents")
    async def list_documents():
        return {"object": "list", "data": [vars(d) for d in server.library.documents()]}

    @app.delete("/v1/documents/{doc_id}")
    async def delete_document(doc_id: str):
        removed = server.library.remove(doc_id)
        if not removed:
            return ApiError(404, f"no document {doc_id!r}", code="document_not_found").response()
        return {"id": doc_id, "deleted": True, "chunks_removed": removed}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": server.model_id, "dtype": server.engine.dtype_name,
                **server.scheduler.stats()}

    @app.get("/metrics")
    async def metrics():
        stats = server.engine.store_stats()
        return PlainTextResponse(server.metrics.render(stats, server.scheduler.stats()),
                                 media_type="text/plain; version=0.0.4")

    return app
