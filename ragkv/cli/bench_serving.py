"""`ragkv bench` for the server under load: serve (vs vLLM or llama.cpp), structured, chat. Flags -> each
benchmark's config (ragkv.bench.*)."""


from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ragkv.cli.bench_replicas import (add_replica_args, run_replicas_bench)
from ragkv.cli.config_args import add_config_args, config_from_args
from ragkv.cli.common import (add_model_args, add_output_args, engine_from_args,
                              finish_bench, say)
from ragkv.errors import InvalidRequestError






def register(bsub) -> None:
    for add in (_add_serve, _add_structured, _add_chat):
        add(bsub)


def _add_serve(bsub) -> None:
    v = bsub.add_parser("serve", help="load benchmark of `ragkv serve`: requests/s and TTFT per mode and "
                                      "concurrency, optionally beside vLLM's CPU backend (--peer vllm-cpu) or "
                                      "llama.cpp's server (--peer llama-cpp)")
    v.add_argument("--url", action="append", default=None,
                   help="a running server (default: start one here and stop it after); repeat it for servers "
                        "sharing one store: requests go round-robin, only the first is warmed up, and the table "
                        "shows each server's TTFT and hits")
    from ragkv.bench.serve.config import ServeBenchConfig

    v.add_argument("--modes", default=",".join(ServeBenchConfig.modes),
                   help="ragkv modes or mode keys, comma-separated (reuse:kv=shared; empty with --peer: the "
                        "peer only)")
    add_config_args(v, ServeBenchConfig, skip=SERVE_BUILT, flags=SERVE_FLAG_NAMES, help={
        "concurrency": "client threads per level",
        "requests": "requests per cell; a closed-loop cell sends at least --min-waves per client",
        "min_waves": "a closed-loop cell sends at least this many requests per client (steady state, not the "
                     "transient of one wave)",
        "rates": "open-loop cells too: --requests arrivals as a Poisson process at each rate (requests/s), with "
                 "goodput at --slo-ttft / --slo-tpot",
        "slo_ttft_s": "goodput's TTFT limit, seconds",
        "slo_tpot_s": "goodput's time-per-output-token limit, seconds",
        "passages_per_request": "MuSiQue passages per request", "pool_size": "MuSiQue passages shared by all requests",
        "passage_words": "passages cut to this many words (~300 tokens)",
        "max_tokens": "answer length limit (greedy, streamed)",
        "min_tokens": "no answer ends before this many tokens (vLLM's min_tokens, sent to ragkv and vllm-cpu; "
                      "llama-cpp ignores it): a decode-bound workload, e.g. --min-tokens 256 --max-tokens 256",
        "seed": "seeds the requests", "warmup": "a warm-up pass over the pool first",
        "timeout_s": "client-side seconds per request"})
    v.add_argument("--server-store", default="memory:2GiB", help="KV store of the server started here")
    v.add_argument("--max-batch", type=int, default=16, help="the started server's --max-batch")
    v.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for the started servers, repeatable (e.g. --server-arg=--prefill-stall-ms "
                        "--server-arg=2000)")
    v.add_argument("--servers", type=int, default=1,
                   help="start this many servers here, each on cores/N threads, sharing --server-store's shared "
                        "tiers; requests go round-robin and only the first is warmed up")
    v.add_argument("--shared-cluster", action="store_true",
                   help="start a private Redis Cluster (3 masters + 3 replicas on 127.0.0.1) and give it to the "
                        "started servers as their last store tier and their --library")
    add_output_args(v)
    add_replica_args(v)
    from ragkv.bench.serve import DEFAULT_PEER_PYTHON, PEER_PACKAGE, PEERS
    from ragkv.bench.serve.peer_vllm import DEFAULT_VLLM_PYTHON, VLLM_PACKAGE

    g = v.add_argument_group("peer (the same requests to another OpenAI server, its cells interleaved with ragkv's)")
    g.add_argument("--peer", choices=PEERS, default=None,
                   help=f"vllm-cpu: vLLM's CPU backend ({VLLM_PACKAGE}) on the model's converted folder in "
                        f"--dtype, prefix caching on; llama-cpp: llama.cpp's OpenAI server ({PEER_PACKAGE}) on "
                        "the model's GGUF; llama-server: upstream llama.cpp's server on the model's GGUF, one slot "
                        "per client, --cache-reuse 256 (build: bash scripts/install_llama_server.sh); openvino: "
                        "OpenVINO GenAI's continuous-batching pipeline (prefix caching on) on the model exported "
                        "to IR, computing in --dtype (install: bash scripts/install_openvino_peer.sh)")
    g.add_argument("--peer-python", default=None,
                   help=f"the peer's python (default: {DEFAULT_VLLM_PYTHON} with {VLLM_PACKAGE}, install: bash "
                        f"scripts/install_vllm_peer.sh; {DEFAULT_PEER_PYTHON} with {PEER_PACKAGE}, install: bash "
                        "scripts/install_peer.sh; .venv-ov/bin/python for openvino)")
    g.add_argument("--peer-binary", default=None,
                   help="--peer llama-server: the llama-server binary (default: the one scripts/"
                        "install_llama_server.sh builds, else llama-server on PATH)")
    g.add_argument("--peer-url", default=None, help="a running peer server (default: start one here)")
    g.add_argument("--peer-gguf", default=None,
                   help="the GGUF llama-cpp or llama-server loads (default: the model's own)")
    g.add_argument("--peer-threads", type=int, default=None,
                   help="the peer's compute threads (default: torch's thread count, as ragkv)")
    g.add_argument("--peer-ctx", type=int, default=4096, help="the peer's context length (n_ctx, max-model-len)")
    g.add_argument("--peer-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for the peer server, repeatable (e.g. --peer-arg=--flash_attn "
                        "--peer-arg=True)")
    add_model_args(v)
    v.set_defaults(func=run_serve)


# the serve bench's fields the CLI builds itself (mode keys hold commas; the peer has its own group), and the flags
# named without the field's unit
SERVE_BUILT = ("modes", "peer")
SERVE_FLAG_NAMES = {"rates": "request_rates", "slo_ttft_s": "slo_ttft", "slo_tpot_s": "slo_tpot",
                    "timeout_s": "request_timeout"}


def _add_structured(bsub) -> None:
    from ragkv.bench.structured import StructuredBenchConfig

    so = bsub.add_parser("structured", help="decode tokens/s with and without response_format's constrained "
                                            "decoding (the grammar mask's cost), per batch size")
    add_config_args(so, StructuredBenchConfig, help={
        "batch_sizes": "batched decode sizes", "tokens": "tokens decoded per sequence",
        "repeats": "timed runs of each (the median counts)"})
    add_output_args(so)
    add_model_args(so)
    so.set_defaults(func=run_structured)


def _add_chat(bsub) -> None:
    from ragkv.bench.chat import ChatBenchConfig

    h = bsub.add_parser("chat", help="a long stateless chat as it is, compacted and with a dropped exchange: TTFT "
                                     "per turn of full, prefix and chat turns as blocks, with KL to full")
    # paths are mode keys, whose own parameters hold commas (split_mode_list reads them); the system prompt is fixed
    add_config_args(h, ChatBenchConfig, skip=("paths", "system"), help={
        "turns": "user turns of the conversation", "edit_at": "the turn at which the history is compacted or cut",
        "words": "words of each user turn (a MuSiQue passage's start)",
        "scenarios": "unedited, compacted and/or dropped",
        "repeats": "runs of each measured turn (the edit, the last), each from the same cache state; the median is "
                   "reported"})
    h.add_argument("--paths", default=",".join(ChatBenchConfig().paths),
                   help="mode keys beside full, the reference (comma-separated; a key keeps its own parameters)")
    add_output_args(h)
    add_model_args(h)
    h.set_defaults(func=run_chat)


def run_structured(args) -> int:
    from ragkv.bench.structured import StructuredBenchConfig, run_structured_bench

    cfg = config_from_args(StructuredBenchConfig, args)
    return finish_bench(args, run_structured_bench(engine_from_args(args), cfg, Path(args.output_dir), say),
                   "structured.md")


def run_chat(args) -> int:
    from ragkv.bench.chat import SCENARIOS, ChatBenchConfig, run_chat_bench
    from ragkv.eval.modes import split_mode_list

    cfg = config_from_args(ChatBenchConfig, args, skip=("system",), paths=tuple(split_mode_list(args.paths)),
                           repeats=max(1, args.repeats))
    unknown = [s for s in cfg.scenarios if s not in SCENARIOS]
    if unknown or not cfg.scenarios:
        raise InvalidRequestError(f"--scenarios takes {', '.join(SCENARIOS)}; got {args.scenarios!r}")
    if not 2 <= cfg.edit_at <= cfg.turns:
        raise InvalidRequestError(f"--edit-at must be in 2..--turns ({cfg.turns}), got {cfg.edit_at}")
    result = run_chat_bench(engine_from_args(args), cfg, Path(args.output_dir), say)
    return finish_bench(args, result, "chat.md")


def run_serve(args) -> int:
    if args.replicas > 1:
        return run_replicas_bench(args)
    from ragkv.bench.serve import ServeBenchConfig, ServerProcess, run_serve_bench
    from ragkv.bench.serve.peer import make_peer

    from ragkv.eval.modes import split_mode_list

    cfg = config_from_args(ServeBenchConfig, args, skip=SERVE_BUILT, flags=SERVE_FLAG_NAMES,
                           modes=tuple(split_mode_list(args.modes)), peer=args.peer)
    if args.servers < 1:
        raise InvalidRequestError(f"--servers {args.servers}: start at least 1 server")
    if args.url and (args.servers > 1 or args.shared_cluster):
        raise InvalidRequestError("--servers and --shared-cluster start servers here; leave out --url (or start "
                                  "the servers yourself and repeat --url)")
    peer = None
    if cfg.peer and not args.peer_url:  # fail before ragkv's cells run, not after
        peer = make_peer(cfg.peer, args.model, args.dtype, args.peer_python, args.peer_threads, args.peer_ctx,
                         args.peer_gguf, tuple(args.peer_arg), args.peer_binary, slots=max(cfg.concurrency))
    with contextlib.ExitStack() as stack:
        store, extra = args.server_store, ("--decode-weights", args.decode_weights, "--max-batch", str(args.max_batch),
                                           *args.server_arg)
        if args.shared_cluster:
            from ragkv.bench.common import bench_dir
            from ragkv.store.redis_cluster_server import private_redis_cluster

            say("[serve bench] starting a private Redis Cluster (3 masters + 3 replicas)")
            work = stack.enter_context(bench_dir("serve-cluster"))
            cluster = stack.enter_context(private_redis_cluster(work))
            store, extra = f"{store},{cluster.url}", (*extra, "--library", cluster.url)
        threads = max(1, (os.cpu_count() or 1) // args.servers) if args.servers > 1 else None
        servers = None if args.url or not cfg.modes else [
            ServerProcess(args.model, args.dtype, args.device, store, extra=extra, threads=threads)
            for _ in range(args.servers)]
        result = run_serve_bench(cfg, args.url, Path(args.output_dir), say, servers, peer, args.peer_url,
                                 model=args.model)
    return finish_bench(args, result, "serve_bench.md")
