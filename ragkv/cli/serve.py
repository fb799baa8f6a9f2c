"""`ragkv serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import logging
import math
import os

from ragkv.cli.common import (
    add_fusion_args,
    add_index_arg,
    add_model_args,
    add_store_args,
    engine_from_args,
    fusion_from_args,
    library_location,
    size_arg,
)
from ragkv.errors import InvalidRequestError
from ragkv.serve.replicas.policy import ROUTERS
from ragkv.settings import DEFAULT_DOCUMENTS_MODE, SERVE

log = logging.getLogger("ragkv.serve")


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat/completions, documents, metrics)")
    p.add_argument("--host", default=SERVE.host)
    p.add_argument("--port", type=int, default=SERVE.port)
    p.add_argument("--served-model-name", action="append", default=[], metavar="NAME",
                   help="a name clients may send as `model` (repeatable: e.g. gpt-3.5-turbo for clients that "
                        "default to it); /v1/models lists them all and responses echo the first. Default: --model")
    add_index_arg(p)
    p.add_argument("--max-queue", type=int, default=SERVE.max_queue, help="waiting requests before answering 429")
    p.add_argument("--timeout", type=float, default=SERVE.timeout_s, help="seconds a request may wait and run")
    p.add_argument("--max-batch", type=int, default=SERVE.max_batch,
                   help="generations decoded together in one batched step (continuous batching)")
    p.add_argument("--prefill-chunk", type=int, default=SERVE.prefill_chunk,
                   help="every prefill (and a block's encoding) runs in units of this many tokens, between two "
                        "decode steps and other tenants' units: bounds the pause a request imposes on the others "
                        "(a short request alone on the server takes --max-num-batched-tokens a unit)")
    p.add_argument("--prefill-stall-ms", type=float, default=SERVE.prefill_stall_ms, metavar="MS",
                   help="newcomers' prefill units may run this long between two decode steps (at least one "
                        "unit): under a burst of requests more of them join each batched step (more output "
                        "tokens/s) while the running answers wait longer between tokens; 0: one unit per step")
    p.add_argument("--max-num-batched-tokens", type=int, default=SERVE.max_num_batched_tokens, metavar="N",
                   help="rows of one forward: every running answer's next token and prefill units of waiting "
                        "requests (each at most --prefill-chunk tokens) run in one pass over the layers while they "
                        "fit in N (one unit always runs); larger N: more prefill per step, longer steps")
    p.add_argument("--max-prefills-per-tenant", type=int, default=SERVE.max_prefills_per_tenant, metavar="N",
                   help="a tenant's waiting requests start prefilling beside its own in flight while their forwards "
                        "share a step within --max-num-batched-tokens, at most N at once (0: as many as fit; 1: one "
                        "at a time, first come first served)")
    p.add_argument("--no-mixed-steps", dest="mixed_steps", action="store_false", default=SERVE.mixed_steps,
                   help="run prefill units alone between decode steps, not in the decode step's forward (to "
                        "measure what one forward per step gains)")
    p.add_argument("--batch-invariant", action="store_true", default=SERVE.batch_invariant,
                   help="an answer never depends on the requests decoded beside it (greedy answers repeat exactly "
                        "under load): every decode step runs at --max-batch rows and every prefill in "
                        "--prefill-chunk units; small batches lose their speed")
    p.add_argument("--startup-profile", action=argparse.BooleanOptionalAction, default=SERVE.startup_profile,
                   help="measure the loading controller's profile (tier speeds, the model's recompute cost) at "
                        "start-up where none is saved, one forward at a time while the server is idle; without "
                        "it blend has no loading plan until `ragkv store profile` (for short-lived servers)")
    r = p.add_argument_group("replicas on Ray Serve (docs/deployment.md; `pip install ragkv[replicas]`)")
    r.add_argument("--replicas", type=int, default=1,
                   help="engine replicas as a Ray Serve deployment behind Ray Serve's HTTP proxy, each with its "
                        "own model and KV memory (default 1: this process serves alone, without Ray)")
    r.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join this Ray cluster (e.g. auto, ray://head:10001) instead of starting a local Ray")
    r.add_argument("--router", choices=ROUTERS, default="balance",
                   help="which replica answers (default `balance`: docs/results/replicas, runs 5-6): `affinity`, the "
                        "one holding most of the request's blocks in memory "
                        "(the least loaded when none does or it is busier than the others by --affinity-slack); "
                        "`home`, the home replica of most of its blocks by rendezvous hashing, unless busier by "
                        "--affinity-slack (the blocks partitioned: for replicas whose memory holds only a share of "
                        "the working set); `balance`, among those within --affinity-slack of the least loaded, the "
                        "one that would add fewest of the request's blocks while the replicas' working sets stay "
                        "even; or `round-robin`, each in turn")
    r.add_argument("--affinity-slack", type=int, default=2, metavar="REQUESTS",
                   help="a holder busier than the least loaded replica by more requests than this loses the request "
                        "to the least loaded one (while a replica is idle, only idle replicas answer)")
    r.add_argument("--replica-threads", type=int, default=1, metavar="N",
                   help="CPU threads (and Ray CPUs) of each replica")
    a = p.add_argument_group("access (without keys the server is open: everyone is tenant `default`)")
    a.add_argument("--api-key", action="append", default=[], metavar="KEY[:TENANT]",
                   help="accept `Authorization: Bearer KEY`; its tenant (default: default) owns its documents and "
                        "KV namespace (repeatable)")
    a.add_argument("--api-keys", action="append", default=[], metavar="FILE",
                   help="a file of `KEY TENANT` lines (# comments)")
    a.add_argument("--metrics-need-key", action="store_true", help="/metrics needs a key too (default: open)")
    _add_limits(p)
    add_fusion_args(p, default_mode=DEFAULT_DOCUMENTS_MODE, mode_key=True,
                    title="fusion defaults (--mode: for requests with documents that name no mode; the other flags "
                          "for every request; a request's own `ragkv` fields win)")
    add_model_args(p)
    add_store_args(p)
    p.set_defaults(func=run_serve)


def _add_limits(p) -> None:
    """The server's limits: each refusal names the one it hit."""
    lim = p.add_argument_group("limits (each refusal names its limit)")
    lim.add_argument("--max-body", type=int, default=SERVE.max_body_bytes, help="request body bytes (413 above)")
    lim.add_argument("--max-documents", type=int, default=SERVE.max_documents, help="documents per request")
    lim.add_argument("--max-document-chars", type=int, default=SERVE.max_document_chars,
                     help="characters per document")
    lim.add_argument("--max-prompt-tokens", type=int, default=SERVE.max_prompt_tokens,
                     help="prompt tokens (default: the model's)")
    lim.add_argument("--keep-alive", type=float, default=SERVE.keep_alive_s, metavar="S",
                     help="seconds an idle HTTP connection stays open (above clients' own expiry: httpx's is 5)")
    lim.add_argument("--ingest-timeout", type=float, default=SERVE.ingest_timeout_s,
                     help="seconds a document ingestion job may run")
    lim.add_argument("--kv-memory", type=size_arg, default=SERVE.kv_memory_bytes, metavar="SIZE",
                     help="KV memory the running generations may reserve, e.g. 4GiB (default: "
                          f"{SERVE.kv_memory_bytes >> 30}GiB): each reserves its prompt's rows plus n x max_tokens "
                          "rows; one that does not fit waits, one that never could gets a 400")
    lim.add_argument("--max-request-cost", type=int, default=None, metavar="TOKEN_LAYERS",
                     help="the most one request's prefill may cost, in token-layers (prompt rows through layers, "
                          "cold cache, the mode's worst case); above it a 400 states the cost (default: "
                          f"{SERVE.max_request_windows:g} x the model's positions x layers; 0: no limit)")
    lim.add_argument("--tenant-budget", type=int, default=SERVE.tenant_budget, metavar="TOKEN_LAYERS",
                     help="token-layers each tenant's admitted requests may cost per minute; above it a 429 with "
                          "Retry-After (default: no budget)")
    lim.add_argument("--tenant-in-flight-cost", type=int, default=None, metavar="TOKEN_LAYERS",
                     help="token-layers each tenant's queued and running requests may cost together; above it a "
                          f"429 (default: {SERVE.tenant_in_flight_windows:g} x the model's positions x layers: one "
                          "request at --max-request-cost's default and a window of others; 0: no limit)")
    p.add_argument("--history-mode", default=SERVE.history_mode,
                   help="mode of a chat without documents when the request names none: earlier turns are blocks, "
                        "exact while the conversation only grows; after an edit the turns behind it are fused by "
                        f"this mode (default {SERVE.history_mode}; `prefix` keeps every answer exact)")
    p.add_argument("--shadow-fraction", type=float, default=SERVE.shadow_fraction, metavar="F",
                   help="share of approximate answers re-run with `full` while the server is idle (never delaying a "
                        "request): their measured first-token KL, top-1 and greedy agreement per mode, beside the "
                        f"estimates they stated, in /metrics (ragkv_fidelity_*); 0: none (default {SERVE.shadow_fraction})")
    p.add_argument("--shadow-max-pending", type=int, default=SERVE.shadow_max_pending, metavar="N",
                   help="checks waiting at once; a sampled answer beyond it is skipped (and counted)")


def check_flags(args) -> None:
    """Every flag checked before anything loads: a one-line error naming it."""
    from ragkv.store.base import check_namespace
    from ragkv.store.spec import parse_spec

    if not 0 <= args.port <= 65535:
        raise InvalidRequestError(f"--port must be in 0..65535, got {args.port}")
    for flag in ("max_queue", "max_batch", "prefill_chunk", "max_body", "max_documents", "max_document_chars"):
        if getattr(args, flag) < 1:
            raise InvalidRequestError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
        raise InvalidRequestError(f"--max-prompt-tokens must be >= 1, got {args.max_prompt_tokens}")
    if args.max_request_cost is not None and args.max_request_cost < 0:
        raise InvalidRequestError(f"--max-request-cost must be >= 0 (0: no limit), got {args.max_request_cost}")
    if args.tenant_in_flight_cost is not None and args.tenant_in_flight_cost < 0:
        raise InvalidRequestError(f"--tenant-in-flight-cost must be >= 0 (0: no limit), got "
                                  f"{args.tenant_in_flight_cost}")
    if args.tenant_budget is not None and args.tenant_budget < 1:
        raise InvalidRequestError(f"--tenant-budget must be >= 1 token-layers per minute, got {args.tenant_budget}")
    if not (math.isfinite(args.shadow_fraction) and 0 <= args.shadow_fraction <= 1):
        raise InvalidRequestError(f"--shadow-fraction must be in [0, 1], got {args.shadow_fraction}")
    if args.shadow_max_pending < 1:
        raise InvalidRequestError(f"--shadow-max-pending must be >= 1, got {args.shadow_max_pending}")
    if args.max_prefills_per_tenant < 0:
        raise InvalidRequestError(f"--max-prefills-per-tenant must be >= 0, got {args.max_prefills_per_tenant}")
    if args.max_num_batched_tokens < 1:
        raise InvalidRequestError(f"--max-num-batched-tokens must be >= 1, got {args.max_num_batched_tokens}")
    if not (math.isfinite(args.prefill_stall_ms) and args.prefill_stall_ms >= 0):
        raise InvalidRequestError(f"--prefill-stall-ms must be a number of milliseconds >= 0, got "
                                  f"{args.prefill_stall_ms}")
    for flag in ("timeout", "ingest_timeout", "keep_alive"):
        value = getattr(args, flag)
        if not (math.isfinite(value) and value > 0):
            raise InvalidRequestError(f"--{flag.replace('_', '-')} must be a positive number of seconds, got {value}")
    for flag in ("replicas", "replica_threads"):
        if getattr(args, flag) < 1:
            raise InvalidRequestError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.affinity_slack < 0:
        raise InvalidRequestError(f"--affinity-slack must be >= 0, got {args.affinity_slack}")
    for name in args.served_model_name:
        if not name.strip():
            raise InvalidRequestError("--served-model-name must not be empty")
    check_namespace(args.namespace)
    from ragkv.engine.modes import mode_names

    if args.history_mode not in mode_names():
        raise InvalidRequestError(f"--history-mode {args.history_mode!r} is not a mode; choose one of "
                                  f"{', '.join(mode_names())}")
    parse_spec(args.store)
    library_location(args)


def build_server(args, worker_thread: bool = False, keys=None):
    """The Server the flags describe (the engine loaded, its scheduler built): one process's or one replica's.
    `keys`: the API keys, when read elsewhere (a replica gets the launcher's: its machine may lack the file)."""
    from ragkv.serve.auth import ApiKeys
    from ragkv.serve.server import Limits, Server

    fusion = fusion_from_args(args, key_params=False)  # a request naming its mode gets the flags' parameters
    documents = fusion_from_args(args)  # one naming none: --mode's key, its own parameters too
    keys = keys if keys is not None else ApiKeys.parse(args.api_key, args.api_keys)
    # the model loads only once every flag passed; a store tier down now (Redis) starts down and is retried, as
    # one failing mid-run is: a replica restarted during an outage serves instead of staying down
    engine = engine_from_args(args, must_reach=False)
    limits = Limits(args.max_body, args.max_documents, args.max_document_chars, args.max_prompt_tokens,
                    args.ingest_timeout, args.kv_memory, args.max_request_cost, args.tenant_budget,
                    args.tenant_in_flight_cost)
    return Server(engine, args.model, library_location(args), args.max_queue, args.timeout, fusion,
                  args.max_batch, args.prefill_chunk, worker_thread=worker_thread, keys=keys, limits=limits,
                  served_names=tuple(dict.fromkeys(args.served_model_name)), history_mode=args.history_mode,
                  batch_invariant=args.batch_invariant, prefill_stall_ms=args.prefill_stall_ms,
                  max_num_batched_tokens=args.max_num_batched_tokens, mixed_steps=args.mixed_steps,
                  max_prefills_per_tenant=args.max_prefills_per_tenant,
                  shadow_fraction=args.shadow_fraction, shadow_max_pending=args.shadow_max_pending,
                  documents_fusion=documents)


def run_serve(args) -> int:
    import signal
    import threading

    import uvicorn

    from ragkv.engine.kv.kvbudget import freeze_long_lived
    from ragkv.net import listening_socket
    from ragkv.serve.app import create_app

    check_flags(args)
    # a server loads once and decodes for hours: its packed weights go to 2 MB pages (ops/huge_pages), unless the
    # environment says otherwise (one-shot commands keep 4 KB pages: mapping ~1 GB of 2 MB pages added ~5 s to a load)
    os.environ.setdefault("RAGKV_HUGE_PAGES", "1")
    if args.replicas > 1 or args.ray_address:
        from ragkv.cli.serve_replicas import run_replicas

        return run_replicas(args, build_server)
    try:
        sock = listening_socket(args.host, args.port)
    except OSError as e:
        raise InvalidRequestError(e.strerror) from None
    server = build_server(args)
    engine, keys = server.engine, server.keys
    # HTTP on a thread, the model on the main thread: OpenMP kernels launched from another thread ran 40%
    # slower (decode 39 vs 64 tokens/s, measured).
    http = uvicorn.Server(uvicorn.Config(create_app(server, args.metrics_need_key), host=args.host, port=args.port,
                                         log_level="warning", timeout_keep_alive=args.keep_alive))
    web = threading.Thread(target=http.run, kwargs={"sockets": [sock]}, name="ragkv-http", daemon=True)

    def stop(signum, frame):
        http.should_exit = True  # stop accepting; the worker leaves after the unit it is in
        server.scheduler.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    freeze_long_lived()  # the loaded model out of every later collection (a full one stalled requests ~150 ms)
    web.start()
    # the loading controller's profile (tier bandwidths, recompute cost): measured once, in the background, only
    # while the server is idle (a background job of one forward per unit, never between two decode steps of an
    # answer); later starts read it
    if args.startup_profile:
        engine.profile_in_background(lambda start: server.scheduler.submit_background(start, timeout_s=3600,
                                                                                            idle_only=True))
    if not keys:
        log.warning("no --api-key: the server is open, and every client shares tenant 'default' (documents and "
                    "KV); pass --api-key KEY[:TENANT] to require keys")
    names = f" as {', '.join(server.model_names)}" if args.served_model_name else ""
    print(f"ragkv: serving {args.model}{names} ({engine.dtype_name}) on http://{args.host}:{args.port}/v1"
          f"{f' for {len(keys.tenants)} tenant(s)' if keys else ''}", flush=True)
    server.scheduler.serve_forever()
    web.join(timeout=10)
    engine.flush_store()  # blocks still queued for the slower tiers land before the process ends
    return 0

