"""OpenAI-compatible endpoints over the engine: chat/completions (streaming or not; n choices, log-probabilities),
models, embeddings, vLLM's tokenize/detokenize, documents, health and Prometheus metrics. Every model call goes
through the Scheduler (one worker, continuous batching, bounded queue)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from ragkv.engine.options import FusionOptions, GenerationOptions
from ragkv.engine.request import Passage, Segments
from ragkv.errors import PromptTooLongError, RagkvError
from ragkv.rag.redis_catalog import LibraryUnavailableError
from ragkv.serve.metrics import Metrics
from ragkv.serve.playground import PAGE_PATHS, STATIC_PREFIX, mount_playground
from ragkv.serve.auth import DEFAULT_TENANT, ApiKeys
from ragkv.serve.choices import Chunks, TokenText, final_choice
from ragkv.serve.embeddings import EMBEDDING_NAMES, embed
from ragkv.serve.scheduler import Cancelled, JobTimeout, QueueFull, Scheduler, ShuttingDown
from ragkv.serve.schemas import (ChatRequest, CompletionRequest, DetokenizeRequest, DocumentsRequest,
                                 EmbeddingsRequest, RagkvExtras, Retrieval, TokenizeRequest)
from ragkv.serve.tokens import detokenize, tokenize

log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = {"Retry-After": str(retry_after)} if retry_after is not None else {}
        if status == 401:
            self.headers["WWW-Authenticate"] = "Bearer"

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=self.headers)


def to_api_error(e: BaseException) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, PromptTooLongError):
        return ApiError(400, str(e), code="context_length_exceeded")
    if isinstance(e, LibraryUnavailableError):  # the shared library's Redis is down: not the client's fault
        return ApiError(503, str(e), "server_error", "library_unavailable", retry_after=5)
    if isinstance(e, RagkvError):
        return ApiError(400, str(e), param=getattr(e, "param", None))
    if isinstance(e, QueueFull):
        return ApiError(429, str(e), "rate_limit_error", "queue_full", retry_after=QueueFull.retry_after_s)
    if isinstance(e, ShuttingDown):
        return ApiError(503, str(e), "server_error", "shutting_down", retry_after=1)
    if isinstance(e, Cancelled):
        return ApiError(409, f"the job was cancelled: {e}", code="cancelled")
    if isinstance(e, (JobTimeout, asyncio.TimeoutError, TimeoutError)):
        return ApiError(504, f"request timed out: {e}", "timeout_error", "timeout")
    log.exception("internal error", exc_info=e)
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error")


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server; each refusal names the limit and its flag."""
    max_body_bytes: int = 8 << 20        # --max-body: larger bodies get 413 before being read
    max_documents: int = 64              # --max-documents: inline documents per request, or per POST /v1/documents
    max_document_chars: int = 1_000_000  # --max-document-chars: characters of one document
    max_prompt_tokens: int | None = None  # --max-prompt-tokens: prompt tokens (None: the model's positions)
    ingest_timeout_s: float = 1800.0     # --ingest-timeout: deadline of a document ingestion job


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


@dataclass
class Prepared:
    segs: Segments
    fusion: FusionOptions
    gen: GenerationOptions
    namespace: str | None
    sources: list[dict]
    n: int = 1  # choices: one prefill, n sequences decoding in the batch


def salted_namespace(namespace: str, salt: str) -> str:
    """The namespace of a `cache_salt`: requests share cached KV only with the same salt (and tenant). The hash
    covers the whole namespace and salt; the readable front keeps the name within the store's 64 characters."""
    digest = hashlib.sha256(f"{namespace}\0{salt}".encode()).hexdigest()[:16]
    return f"{namespace[:40]}.salt-{digest}"


class RetrieveRequest(Retrieval):
    """POST /v1/retrieve: the library's `top_k` chunks for `query` (an empty query is a 400)."""
    query: str


class Server:
    def __init__(self, engine, model_id: str, index_dir=None, max_queue: int = 64, timeout_s: float = 300.0,
                 default_fusion: FusionOptions = FusionOptions(), max_batch: int = 16, prefill_chunk: int = 512,
                 worker_thread: bool = True, keys: ApiKeys = ApiKeys({}), limits: Limits = Limits(),
                 served_names: tuple[str, ...] = ()):
        """served_names (--served-model-name): the names `model` may take, the first echoed in responses;
        without them, `model_id` or the model's path."""
        self.engine, self.index_dir = engine, index_dir
        self.model_names = tuple(served_names) or (model_id,)
        self.model_id = self.model_names[0]
        self.accepted_names = set(served_names) if served_names else {model_id, str(engine.model_path)}
        self.keys, self.limits = keys, limits
        self.ingest_jobs: dict[str, IngestJob] = {}
        self.default_fusion = default_fusion  # the server's flags; a request's own `ragkv` fields override them
        self.metrics = Metrics()
        self.prefill_chunk = prefill_chunk  # tokens of a full/prefix prefill between two decode steps
        self.scheduler = Scheduler(engine.step, max_queue, timeout_s, max_batch, on_finish=self.metrics.observe_stats,
                                   lock=engine.lock, thread=worker_thread)
        self._library = None

    def library(self, tenant: str = DEFAULT_TENANT):
        """The tenant's document library (its documents only; their KV in its namespace)."""
        if self._library is None:  # loading the embedder costs seconds: only when documents are used
            from ragkv.rag.library import DocumentLibrary
            self._library = DocumentLibrary(self.engine, self.index_dir)
        return self._library.tenant(tenant)

    def namespace(self, extras: RagkvExtras | None, tenant: str, cache_salt: str | None = None) -> str | None:
        """The KV namespace of a request: its tenant's when keys are configured (naming another is refused),
        made its own by a `cache_salt`."""
        asked = extras.namespace if extras is not None else None
        if not self.keys:
            ns = asked if asked is not None else (None if tenant == DEFAULT_TENANT else tenant)
        elif asked is not None and asked != tenant:
            raise ApiError(403, f"namespace {asked!r} belongs to another tenant; this key's is {tenant!r}",
                           "permission_error", "namespace_forbidden", "ragkv.namespace")
        else:
            ns = tenant
        return ns if cache_salt is None else salted_namespace(ns or self.engine.namespace, cache_salt)

    # -- request -> segments ------------------------------------------------------------------------------
    def _passages(self, req, question: str, tenant: str = DEFAULT_TENANT) -> tuple[list[Passage], list[dict]]:
        """Inline documents (top-level `documents` or `ragkv.documents`), then retrieved ones."""
        extras = req.ragkv
        passages, sources = [], []
        docs, field = req.inline_documents()
        self.check_documents(len(docs), (d if isinstance(d, str) else d.text for d in docs), field)
        for d in docs:
            p = Passage(d) if isinstance(d, str) else Passage(d.text, d.title or "")
            passages.append(p)
            sources.append({"title": p.title, "source": "inline"})
        if extras is not None and extras.retrieval is not None:
            for r in self.library(tenant).retrieve(question, extras.retrieval.top_k):
                passages.append(r.passage)
                sources.append({"title": r.passage.title, "chunk_id": r.chunk_id, "doc_id": r.doc_id,
                                "score": round(r.score, 4)})
        return passages, sources

    def check_documents(self, count: int, texts, field: str) -> None:
        lim = self.limits
        if count > lim.max_documents:
            raise ApiError(400, f"{count} documents in one request; the limit is {lim.max_documents} "
                                "(--max-documents)", param=field, code="too_many_documents")
        for i, text in enumerate(texts):
            if len(text) > lim.max_document_chars:
                raise ApiError(400, f"document {i} has {len(text)} characters; the limit is "
                                    f"{lim.max_document_chars} (--max-document-chars)", param=f"{field}.{i}",
                               code="document_too_long")

    def check_prompt(self, segs: Segments, gen: GenerationOptions) -> None:
        lim = self.limits.max_prompt_tokens or self.engine.max_positions
        if segs.num_tokens > lim:
            raise ApiError(400, f"the prompt has {segs.num_tokens} tokens; the limit is {lim}"
                                f"{' (--max-prompt-tokens)' if self.limits.max_prompt_tokens else ' (the model)'}",
                           code="context_length_exceeded", param="messages")
        if gen.max_new_tokens > self.engine.max_positions:
            raise ApiError(400, f"max_tokens {gen.max_new_tokens} exceeds the model's {self.engine.max_positions} "
                                "positions", param="max_tokens")

    def _fusion(self, extras: RagkvExtras | None, has_blocks: bool) -> FusionOptions:
        e = extras or RagkvExtras()
        given = e.fusion_fields()
        given.setdefault("mode", self.default_fusion.mode if has_blocks else "prefix")
        return replace(self.default_fusion, **given)  # validates: unknown mode, r outside [0, 1], T or S <= 0, ...

    def _generation(self, req, default_max: int) -> GenerationOptions:
        max_new = getattr(req, "max_completion_tokens", None) or req.max_tokens
        if req.n > self.scheduler.max_batch:
            raise ApiError(400, f"n={req.n} choices exceed the {self.scheduler.max_batch} sequences decoded "
                                "together (--max-batch)", param="n")
        penalty = req.repetition_penalty
        return GenerationOptions(max_new_tokens=default_max if max_new is None else max_new,
                                 temperature=req.temperature or 0.0, top_p=req.top_p or 1.0, seed=req.seed,
                                 stop=req.stops(), top_k=max(req.top_k or 0, 0), min_p=req.min_p or 0.0,
                                 presence_penalty=req.presence_penalty or 0.0,
                                 frequency_penalty=req.frequency_penalty or 0.0,
                                 repetition_penalty=1.0 if penalty is None else penalty,
                                 logprobs=req.logprobs_count())

    def prepare_chat(self, req: ChatRequest, tenant: str = DEFAULT_TENANT) -> Prepared:
        msgs = req.messages
        system = next((m.text() for m in msgs if m.role in ("system", "developer")), None)
        turns = [m for m in msgs if m.role in ("user", "assistant")]
        if not turns or turns[-1].role != "user":
            raise ApiError(400, "the last message must come from the user", param="messages")
        question = turns[-1].text()
        passages, sources = self._passages(req, question, tenant)
        fusion = self._fusion(req.ragkv, bool(passages))
        if passages:
            history = "".join(f"{m.role.capitalize()}: {m.text()}\n" for m in turns[:-1])
            segs = self.engine.segments((history + question) if history else question, passages, system=system)
        else:
            if not question.strip():
                raise ApiError(400, "the last user message is empty", param="messages")
            segs = self.engine.chat_segments([{"role": m.role, "content": m.text()} for m in turns], system)
        gen = self._generation(req, 256)
        self.check_prompt(segs, gen)
        return Prepared(segs, fusion, gen, self.namespace(req.ragkv, tenant, req.cache_salt), sources, req.n)

    def prepare_completion(self, req: CompletionRequest, tenant: str = DEFAULT_TENANT) -> Prepared:
        prompt = req.prompt if isinstance(req.prompt, str) else "".join(req.prompt)
        if not prompt.strip():
            raise ApiError(400, "the prompt is empty", param="prompt")
        passages, sources = self._passages(req, prompt, tenant)
        fusion = self._fusion(req.ragkv, bool(passages))
        if passages:
            segs = self.engine.segments(prompt, passages)
        else:
            segs = self.engine.text_segments(prompt)
        gen = self._generation(req, 16)
        self.check_prompt(segs, gen)
        return Prepared(segs, fusion, gen, self.namespace(req.ragkv, tenant, req.cache_salt), sources, req.n)

    # -- running on the scheduler ---------------------------------------------------------------------------
    def start(self, prepare, emit=None):
        """Queue a generation: the worker prepares and prefills it, then decodes it batched with the others;
        `emit(kind, payload)` streams events. The job's future resolves to (Prepared, Sequence, finish); the job's
        `seqs` are the request's n choices (one prefill; the others decode from copies of its KV)."""

        def chunk():  # chunk a full/prefix prefill only while other answers are decoding
            return self.prefill_chunk if self.scheduler.running else None

        def begin():
            p = prepare()
            seq = yield from self.engine.start_steps(p.segs, p.fusion, p.gen, p.namespace, chunk)
            return [seq] + [seq.fork(i) for i in range(1, p.n)], p

        return self.scheduler.submit_generation(begin, emit)


def _usage(stats, completion_tokens: int | None = None) -> dict:
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
            "uncached_blocks": stats.extra.get("uncached_blocks", 0), "store_fault": "store_fault" in stats.extra}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _no_constants(name: str):
    raise ApiError(400, f"the request body contains {name}, which is not a JSON number; send a finite number")


def parse_body(raw: bytes, schema):
    """A request body -> the schema's model; every way it can be wrong is a 400 naming the field."""
    try:
        data = json.loads(raw, parse_constant=_no_constants)
        json.dumps(data, ensure_ascii=False).encode("utf-8")  # an unpaired surrogate (\\ud800) cannot be text
    except ApiError:
        raise
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}")
    except UnicodeEncodeError:
        raise ApiError(400, "the request body contains an unpaired UTF-16 surrogate (like \\ud800); send valid "
                            "Unicode text")
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply")
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {type(data).__name__}")
    unsupported = schema.unsupported(data) if hasattr(schema, "unsupported") else []
    if unsupported:
        raise ApiError(400, f"unsupported field(s) {', '.join(unsupported)}: this server does not implement them "
                            "yet; leave them out", param=unsupported[0], code="unsupported_field")
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        raise ApiError(400, f"invalid request: {where}: {first.get('msg')}", param=where or None)
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply")


OPEN_PATHS = ("/health",) + PAGE_PATHS  # the playground page and its files; the API calls it makes need a key
OPEN_PREFIXES = (STATIC_PREFIX,)


class Guard:
    """Keys first (401 before anything is read), then the body size (413 before it is read); the request's
    tenant goes into its state. Plain ASGI: Starlette's BaseHTTPMiddleware would hide client disconnects."""

    def __init__(self, app, server: Server, open_paths: tuple[str, ...], open_prefixes: tuple[str, ...] = ()):
        self.app, self.server, self.open_paths, self.open_prefixes = app, server, open_paths, open_prefixes

    def is_open(self, path: str) -> bool:
        return path in self.open_paths or path.startswith(self.open_prefixes)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        tenant, keys = DEFAULT_TENANT, self.server.keys
        if keys and not self.is_open(scope.get("path", "")):
            tenant = keys.tenant_of(headers.get("authorization"))
            if tenant is None:
                self.server.metrics.observe_request("auth", 401)
                return await ApiError(401, "a valid API key is required: send `Authorization: Bearer KEY`",
                                      "authentication_error", "invalid_api_key").response()(scope, receive, send)
        limit, size = self.server.limits.max_body_bytes, headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > limit):
            return await ApiError(413, f"the request body has {size} bytes; the limit is {limit} (--max-body)",
                                  code="body_too_large").response()(scope, receive, send)
        scope.setdefault("state", {})["tenant"] = tenant
        return await self.app(scope, receive, send)


def create_app(server: Server, metrics_need_key: bool = False) -> FastAPI:
    app = FastAPI(title="ragkv", version="0.1.0")
    app.state.server = server
    open_paths = OPEN_PATHS + (() if metrics_need_key else ("/metrics",))

    app.add_middleware(Guard, server=server, open_paths=open_paths, open_prefixes=OPEN_PREFIXES)
    mount_playground(app)

    async def read_body(request: Request) -> bytes:
        """The body, stopping at the limit (a chunked upload has no Content-Length to check up front)."""
        limit, parts, n = server.limits.max_body_bytes, [], 0
        async for part in request.stream():
            n += len(part)
            if n > limit:
                raise ApiError(413, f"the request body exceeds {limit} bytes (--max-body)", code="body_too_large")
            parts.append(part)
        return b"".join(parts)

    async def parse(request: Request, schema):
        return parse_body(await read_body(request), schema)

    def check_model(name: str | None) -> None:
        if name and name not in server.accepted_names:
            raise ApiError(404, f"model {name!r} is not served here; this server runs "
                                f"{', '.join(map(repr, server.model_names))}", code="model_not_found", param="model")

    async def generate(request: Request, endpoint: str, schema, chat: bool):
        try:
            req = await parse(request, schema)
            check_model(req.model)
            tenant = request.state.tenant
            prepare = (lambda: server.prepare_chat(req, tenant)) if chat else (
                lambda: server.prepare_completion(req, tenant))
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
        stats = seq.stats
        if finish == "timeout":
            raise JobTimeout(f"generation exceeded {server.scheduler.timeout_s:.0f} s")
        rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time())
        text, logprobs = TokenText(server.engine.tokenizer), req.logprobs_count() is not None
        choices = [final_choice(i, s, chat, text, logprobs) for i, s in enumerate(job.seqs)]
        completion = sum(s.stats.completion_tokens for s in job.seqs)
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": created, "model": server.model_id, "choices": choices,
                             "usage": _usage(stats, completion),
                             "ragkv": {"stats": stats.to_dict(), "sources": p.sources}})

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
        chunks = Chunks(rid, created, server.model_id, chat, TokenText(server.engine.tokenizer),
                        req.logprobs_count() is not None)

        async def body():
            try:
                if chat:
                    for i in range(req.n):
                        yield _sse(chunks.role(i))
                while True:
                    kind, payload = await events.get()
                    if kind == "delta":
                        yield _sse(chunks.delta(*payload))
                    elif kind == "done":
                        try:
                            p, seq, finish = payload.result()
                            stats = seq.stats
                        except Exception as e:  # noqa: BLE001
                            err = to_api_error(e)
                            yield _sse({"error": {"message": err.message, "type": err.type, "code": err.code}})
                            break
                        for i, s in enumerate(job.seqs):  # the last one carries the request's statistics
                            last = chunks.finish(i, s.out.finish_reason)
                            if i == len(job.seqs) - 1:
                                last["ragkv"] = {"stats": stats.to_dict(), "sources": p.sources}
                            yield _sse(last)
                        if req.stream_options and req.stream_options.include_usage:
                            completion = sum(s.stats.completion_tokens for s in job.seqs)
                            yield _sse(chunks.envelope([]) | {"usage": _usage(stats, completion)})
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
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "ragkv",
                                            "max_model_len": server.engine.max_positions}
                                           for name in server.model_names]}

    async def utility(request: Request, endpoint: str, schema, answer):
        """A request that does not generate: parsed, checked, answered off the event loop."""
        try:
            req = await parse(request, schema)
            result = await asyncio.to_thread(answer, req)
            server.metrics.observe_request(endpoint, 200)
            return result
        except Exception as e:  # noqa: BLE001
            err = to_api_error(e)
            server.metrics.observe_request(endpoint, err.status)
            return err.response()

    def checked(fn):
        def run(req):
            check_model(req.model)
            return fn(server.engine, req)
        return run

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        return await utility(request, "tokenize", TokenizeRequest, checked(tokenize))

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        return await utility(request, "detokenize", DetokenizeRequest, checked(detokenize))

    def embeddings(req: EmbeddingsRequest) -> dict:
        if req.model is not None and req.model not in EMBEDDING_NAMES:
            raise ApiError(404, f"model {req.model!r} does not embed here; embeddings come from "
                                f"{' or '.join(map(repr, EMBEDDING_NAMES))}", code="model_not_found", param="model")
        from ragkv.rag.embedding import get_embedder  # the library's embedder: loaded once, on first use
        return embed(get_embedder(), req)

    @app.post("/v1/embeddings")
    async def embeddings_route(request: Request):
        return await utility(request, "embeddings", EmbeddingsRequest, embeddings)

    @app.post("/v1/documents")
    async def add_documents(request: Request):
        """Ingestion runs as a background job that yields to chat requests between short units. By default the
        call waits for it (200 with the report); with `"wait": false` it answers 202 with the job to poll."""
        try:
            req = await parse(request, DocumentsRequest)
            server.check_documents(len(req.documents), (d.text for d in req.documents), "documents")
            tenant = request.state.tenant
            library = await asyncio.to_thread(server.library, tenant)  # the embedder loads once, off the loop
            docs = [d.model_dump() for d in req.documents]
            library.parse(docs)  # an empty text is a 400 now, not a failed job later
            status: dict = {"documents_total": len(docs), "documents_done": 0, "chunks_total": None, "chunks_done": 0}
            job = server.scheduler.submit_background(lambda: library.add_steps(docs, status),
                                                     server.limits.ingest_timeout_s)
            ingest = IngestJob(f"ingest-{uuid.uuid4().hex[:16]}", tenant, job, status)
            server.ingest_jobs[ingest.id] = ingest
            if not req.wait:
                server.metrics.observe_request("documents", 202)
                return JSONResponse(ingest.as_dict(), status_code=202)
            try:
                report = await asyncio.shield(asyncio.wrap_future(job.future))
            except asyncio.CancelledError:
                job.cancel()
                raise
            server.metrics.observe_request("documents", 200)
            return {"object": "list", "added_chunks": report.chunks_added, "unchanged": report.unchanged,
                    "job": ingest.id, "data": [vars(d) for d in library.documents()]}
        except Exception as e:  # noqa: BLE001
            err = to_api_error(e)
            server.metrics.observe_request("documents", err.status)
            return err.response()

    def own_job(request: Request, job_id: str) -> IngestJob:
        ingest = server.ingest_jobs.get(job_id)
        if ingest is None or ingest.tenant != request.state.tenant:  # another tenant's job does not exist here
            raise ApiError(404, f"no ingestion job {job_id!r}", code="job_not_found", param="job_id")
        return ingest

    @app.get("/v1/documents/jobs/{job_id}")
    async def job_status(request: Request, job_id: str):
        try:
            return own_job(request, job_id).as_dict()
        except ApiError as e:
            return e.response()

    @app.delete("/v1/documents/jobs/{job_id}")
    async def cancel_job(request: Request, job_id: str):
        """Cancel between two units: documents already committed stay (each is added atomically)."""
        try:
            ingest = own_job(request, job_id)
        except ApiError as e:
            return e.response()
        ingest.job.cancel()
        return {**ingest.as_dict(), "cancel_requested": True}

    @app.get("/v1/documents")
    async def list_documents(request: Request):
        library = await asyncio.to_thread(server.library, request.state.tenant)
        return {"object": "list", "data": [vars(d) for d in library.documents()]}

    @app.post("/v1/retrieve")
    async def retrieve(request: Request):
        """The chunks `ragkv.retrieval` would answer from, with their text: clients (ragkv.integrations) send
        them back as `ragkv.documents`, whose KV the library precomputed."""
        def chunks(req: RetrieveRequest) -> dict:
            found = server.library(request.state.tenant).retrieve(req.query, req.top_k)
            return {"object": "list", "data": [{"text": r.passage.text, "title": r.passage.title, "doc_id": r.doc_id,
                                                "chunk_id": r.chunk_id, "score": round(r.score, 4)} for r in found]}
        return await utility(request, "retrieve", RetrieveRequest, chunks)

    @app.delete("/v1/documents/{doc_id:path}")
    async def delete_document(request: Request, doc_id: str):
        library = await asyncio.to_thread(server.library, request.state.tenant)
        removed = library.remove(doc_id)
        if not removed:
            return ApiError(404, f"no document {doc_id!r}", code="document_not_found").response()
        return {"id": doc_id, "deleted": True, "chunks_removed": removed}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": server.model_id, "dtype": server.engine.dtype_name,
                "write_back_pending": server.engine.write_back_pending(),
                **server.scheduler.stats()}

    server.metrics.watch(server.scheduler.stats, server.engine.store_stats)

    @app.get("/metrics")
    async def metrics(request: Request):
        body, content_type = server.metrics.render(request.headers.get("accept"))
        return Response(body, media_type=content_type)

    return app
