"""The state one `ragkv serve` shares across its routes: the engine and its batching scheduler, the served model
names, keys and limits, the metrics, the tenants' document libraries and the ingestion jobs (serve/ingest.py). It
knows no HTTP: requests are built by `RequestBuilder` (serve/requests.py), answered by the routers (serve/routes/)."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from ragkv.engine.kv.kvbudget import KVBudget, freeze_long_lived, kv_need
from ragkv.engine.kv.kvcache import bytes_per_token
from ragkv.engine.modes import get_mode
from ragkv.engine.options import FusionOptions
from ragkv.serve.scheduling import Job, QueueFull, Scheduler
from ragkv.serve.auth import ApiKeys
from ragkv.serve.budget import TenantBudget, TenantInFlight
from ragkv.serve.ingest import IngestJobs
from ragkv.serve.metrics import Metrics
from ragkv.serve.requests import Prepared, RequestBuilder
from ragkv.serve.schemas import FieldError
from ragkv.serve.shadow import ShadowChecks
from ragkv.settings import DEFAULT_TENANT, SERVE
from ragkv.store.sizes import human_size

LONG_PREFILL_UNITS = 8  # a prefill of more units than this does not keep its tenant's later requests waiting

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server; each refusal names the limit and its flag (defaults: settings)."""
    max_body_bytes: int = SERVE.max_body_bytes          # --max-body: larger bodies get 413 before being read
    max_documents: int = SERVE.max_documents            # --max-documents: per request, or per POST /v1/documents
    max_document_chars: int = SERVE.max_document_chars  # --max-document-chars: characters of one document
    max_prompt_tokens: int | None = SERVE.max_prompt_tokens  # --max-prompt-tokens (None: the model's positions)
    ingest_timeout_s: float = SERVE.ingest_timeout_s    # --ingest-timeout: deadline of a document ingestion job
    kv_memory_bytes: int = SERVE.kv_memory_bytes        # --kv-memory: KV the running generations may reserve
    max_request_cost: int | None = None  # --max-request-cost: token-layers (None: SERVE.max_request_windows; 0: none)
    tenant_budget: int | None = SERVE.tenant_budget     # --tenant-budget: token-layers per tenant per minute
    tenant_in_flight_cost: int | None = None  # --tenant-in-flight-cost (None: SERVE.tenant_in_flight_windows; 0: none)


class Server:
    def __init__(self, engine, model_id: str, index_dir=None, max_queue: int = SERVE.max_queue,
                 timeout_s: float = SERVE.timeout_s, default_fusion: FusionOptions = FusionOptions(),
                 max_batch: int = SERVE.max_batch, prefill_chunk: int = SERVE.prefill_chunk,
                 worker_thread: bool = True, keys: ApiKeys = ApiKeys({}), limits: Limits = Limits(),
                 served_names: tuple[str, ...] = (), history_mode: str = SERVE.history_mode,
                 batch_invariant: bool = SERVE.batch_invariant, prefill_stall_ms: float = SERVE.prefill_stall_ms,
                 shadow_fraction: float = SERVE.shadow_fraction, shadow_max_pending: int = SERVE.shadow_max_pending,
                 max_num_batched_tokens: int = SERVE.max_num_batched_tokens, mixed_steps: bool = SERVE.mixed_steps,
                 max_prefills_per_tenant: int = SERVE.max_prefills_per_tenant,
                 documents_fusion: FusionOptions | None = None):
        """served_names (--served-model-name): the names `model` may take, the first echoed in responses;
        without them, `model_id` or the model's path. `default_fusion`: the parameters of a request that names its
        mode; `documents_fusion`: the mode and parameters of a request with documents that names none (default:
        `default_fusion`'s)."""
        self.engine, self.index_dir = engine, index_dir
        self.model_names = tuple(served_names) or (model_id,)
        self.model_id = self.model_names[0]
        self.accepted_names = set(served_names) if served_names else {model_id, str(engine.model_path)}
        self.keys, self.limits = keys, limits
        self.ingest = IngestJobs(self)  # document ingestion jobs, recorded in the library
        self.default_fusion = default_fusion
        self.metrics = Metrics()
        self.prefill_chunk = prefill_chunk  # tokens of every prefill unit, between two decode steps
        self.batch_invariant = batch_invariant  # every step at max_batch rows, every prefill chunked
        self.kv_bytes_per_token = bytes_per_token(engine.model)
        rows = max_batch if batch_invariant else None
        # one forward per step: the answers' next tokens and prefill units together (not at a fixed row count: a
        # batch-invariant answer must not depend on what runs beside it)
        self.scheduler = Scheduler(lambda seqs, forwards=(): engine.step(seqs, rows, forwards), max_queue,
                                   timeout_s, max_batch, on_finish=self.metrics.observe_stats, lock=engine.lock,
                                   thread=worker_thread, kv_budget=KVBudget(limits.kv_memory_bytes),
                                   prefill_stall_ms=prefill_stall_ms,
                                   mixed=mixed_steps and not batch_invariant,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   max_prefills_per_tenant=max_prefills_per_tenant)
        self._library, self._library_lock = None, threading.Lock()
        # shadow verification: sampled approximate answers re-run with `full` while idle, measured in /metrics
        self.shadow = ShadowChecks(engine, self.scheduler, shadow_fraction, prefill_chunk, shadow_max_pending)
        self.metrics.registry.register(self.shadow)
        self.requests = RequestBuilder(engine, keys, limits, default_fusion, max_batch, self.library, history_mode,
                                       TenantBudget(limits.tenant_budget), documents_fusion)
        in_flight = limits.tenant_in_flight_cost
        if in_flight is None:
            in_flight = int(SERVE.tenant_in_flight_windows * engine.max_positions * engine.num_layers)
        self.in_flight = TenantInFlight(in_flight or None)
        # requests are tokenized on the handlers' threads while the model thread decodes: one call here first, so
        # that a tokenizer resetting its truncation or padding settings on first use does it before any race
        engine.tokenize("ragkv")
        self.ingest.recover_in_background()  # jobs an earlier server left unfinished: taken over and resumed

    def library(self, tenant: str = DEFAULT_TENANT):
        """The tenant's document library (its documents only; their KV in its namespace)."""
        with self._library_lock:  # called from several handler threads; the embedder loads once
            if self._library is None:  # loading the embedder costs seconds: only when documents are used
                from ragkv.rag.library import DocumentLibrary
                self._library = DocumentLibrary(self.engine, self.index_dir)
                freeze_long_lived()  # the embedder's objects, as the model's, out of later collections
        return self._library.tenant(tenant)

    def start(self, p: Prepared, emit=None) -> Job:
        """Queue a prepared generation: the model thread prefills it in units, then decodes it batched with the
        others; `emit(kind, payload)` streams events. The job's future resolves to (Prepared, Sequence, finish);
        its `seqs` are the request's n choices (one prefill; they share its KV and each holds only its own tokens).
        It reserves the most KV it can hold: refused here if that could never fit the limit, else it waits in the
        queue until it fits."""
        need = kv_need(self.kv_bytes_per_token, get_mode(p.fusion.mode).own_rows(p.segs, p.fusion),
                       p.gen.max_new_tokens, p.n)
        if not self.scheduler.kv.fits_ever(need):
            raise self.kv_refusal(p, need)

        layers = self.engine.num_layers
        cost = p.cost or self.engine.worst_token_layers(p.segs, p.fusion, p.namespace)  # cold cache
        long = cost > LONG_PREFILL_UNITS * (self.prefill_chunk or SERVE.prefill_chunk) * layers
        # every prefill in units of --prefill-chunk tokens: a request arriving meanwhile waits one unit, not a whole
        # long prompt or block (`bench fairness`: another tenant's TTFT p95 23.7 s -> 1.0 s beside a 12K-token `ape`
        # request). A short one alone on the server takes the step's whole budget a unit (Scheduler.unit_tokens);
        # a long one, and every one under --batch-invariant, keeps the fixed unit.
        chunk = self.prefill_chunk
        if chunk and not long and not self.batch_invariant:
            chunk = lambda: self.scheduler.unit_tokens(self.prefill_chunk)  # noqa: E731

        def begin():
            seq = yield from self.engine.start_steps(p.segs, p.fusion, p.gen, p.namespace, chunk)
            return [seq] + [seq.fork(i) for i in range(1, p.n)], p

        def settle(seqs):  # what one prompt's sequence really kept (a fork's choices share it: not settled)
            if p.n != 1:
                return None
            return kv_need(self.kv_bytes_per_token, seqs[0].state.prompt_rows(), p.gen.max_new_tokens)

        release = self.in_flight.admit(p.tenant, cost)  # a 429 when the tenant's unfinished requests cost too much
        try:
            job = self.scheduler.submit_generation(begin, emit, kv_bytes=need, settle=settle, tenant=p.tenant,
                                                   long=long, cost=cost)
        except BaseException:
            release()
            raise
        job.future.add_done_callback(lambda _: release())
        job.future.add_done_callback(self._maybe_shadow)
        if p.segs.history and p.segs.blocks and get_mode(p.fusion.mode).reads_blocks:
            # once the reply is whole: a request whose client left (or that failed) leaves no work behind, and
            # settling never repeats the prefill in flight (its prefix chunks are stored only as it ends)
            job.future.add_done_callback(lambda f: self._settle_after(f, p))
        return job

    def _settle_after(self, future, p: Prepared) -> None:
        if future.cancelled() or future.exception() is not None or future.result()[2] in ("cancelled", "timeout"):
            return
        self.warm_turns(p)

    def _maybe_shadow(self, future) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        p, seq, _ = future.result()
        self.shadow.consider(p, seq)

    def warm_turns(self, p: Prepared) -> None:
        """In the background while the server is idle, after a whole reply: encode the chat's turns the block store
        lacks (a later edit of this conversation fuses them instead of prefilling them) and prefill a fused history
        exactly into the prefix cache (the next turn is exact again); engine/blocks/history.py. Skipped when the
        background queue is full: the next turn then prefills what it lacks, as without blocks."""
        try:
            self.scheduler.submit_background(
                lambda: self.engine.settle_history_steps(p.segs, p.namespace, p.fusion.prefix_chunk,
                                                         self.prefill_chunk),
                timeout_s=self.scheduler.timeout_s, idle_only=True, tenant=p.tenant)
        except QueueFull:
            log.info("background queue full: this chat's turns are not encoded as blocks")

    def kv_refusal(self, p: Prepared, need: int) -> FieldError:
        """The 400 of a request whose KV could never fit: what it needs, from what, and the limit with its flag."""
        limit, per = self.limits.kv_memory_bytes, self.kv_bytes_per_token
        prompt_alone = per * p.segs.num_tokens > limit
        return FieldError("messages" if prompt_alone else "max_tokens",
                          f"this request needs {human_size(need)} of KV memory (a prompt of {p.segs.num_tokens} "
                          f"tokens + n={p.n} x max_tokens {p.gen.max_new_tokens}, at {per} bytes per token); the "
                          f"server's KV memory limit is {human_size(limit)} (--kv-memory): "
                          + ("shorten the prompt" if prompt_alone else "lower max_tokens or n"), "kv_memory_exceeded")
