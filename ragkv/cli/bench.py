"""`ragkv bench ...` (ttft, decode, store, serve, soak and more): flags -> each benchmark's config (ragkv.bench.*)."""

from __future__ import annotations

import argparse
import contextlib
import os
from dataclasses import replace
from pathlib import Path

from ragkv.cli.bench_replicas import (add_replica_args, add_replica_soak_args, run_replica_soak_bench,
                                     run_replicas_bench)
from ragkv.cli.common import (MODEL_HELP, add_fusion_args, add_model_args, add_output_args, engine_from_args,
                              finish_bench, floats, fusion_from_args, ints, say)
from ragkv.engine.modes import MODES
from ragkv.errors import InvalidRequestError, RagkvError
from ragkv.settings import DEFAULT_MODEL, SERVE


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: ttft, shared, invariance, engine (vs transformers), decode, "
                                     "train-step, store, serve, structured, fuzz, fairness, soak, chat, controller, "
                                     "lookahead, ceiling, profile, weights, shadow")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH")

    t = bsub.add_parser("ttft", help="TTFT and FLOPs to first token per mode and context length")
    t.add_argument("--contexts", default="512,1024,2048,4096,8192")
    t.add_argument("--modes", default=",".join(MODES))
    t.add_argument("--query-tokens", type=int, default=50)
    t.add_argument("--repeats", type=int, default=3)
    add_output_args(t)
    add_fusion_args(t, default_mode=None, title="mode parameters")
    add_model_args(t)
    t.set_defaults(func=run_ttft)

    sh = bsub.add_parser("shared", help="reuse with blocks copied per request vs read in place from the pool: TTFT "
                                        "and batched decode steps")
    sh.add_argument("--passages", type=int, default=4, help="blocks per request")
    sh.add_argument("--distinct", type=int, default=12, help="passages the requests draw from")
    sh.add_argument("--requests", type=int, default=8, help="TTFT samples per layout")
    sh.add_argument("--batch-sizes", default="1,4,16")
    sh.add_argument("--steps", type=int, default=16, help="decode steps timed per batch size")
    sh.add_argument("--mode", default="reuse", choices=("reuse", "ape", "blend"), help="the requests' mode")
    add_output_args(sh)
    add_model_args(sh)
    sh.set_defaults(func=run_shared)

    iv = bsub.add_parser("invariance", help="greedy answers decoded in a batch vs alone, with free and fixed row "
                                            "counts (serve --batch-invariant), and the fixed count's cost")
    iv.add_argument("--requests", type=int, default=8, help="requests decoded together")
    iv.add_argument("--tokens", type=int, default=32, help="greedy tokens per request")
    iv.add_argument("--passages", type=int, default=4, help="blocks per request")
    iv.add_argument("--rows", type=int, default=SERVE.max_batch, help="the fixed row count (serve's --max-batch)")
    add_output_args(iv)
    add_fusion_args(iv, title="the requests' mode")
    add_model_args(iv)
    iv.set_defaults(func=run_invariance)

    e = bsub.add_parser("engine", help="our full prefill vs transformers' forward on the same tokens")
    e.add_argument("--lengths", default="512,1024,2048,4096")
    e.add_argument("--dtypes", default="float32,bfloat16")
    e.add_argument("--repeats", type=int, default=3)
    e.add_argument("--weights", default="auto",
                   help="decode copies whose prefill is timed, comma-separated (as --decode-weights: e.g. auto,w8a8)")
    e.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    add_output_args(e)
    e.set_defaults(func=run_engine)

    k = bsub.add_parser("kernels", help="every candidate kernel of every bf16 product, timed per row class on this "
                                        "machine, and the one the engine uses (cached per CPU; this re-measures)")
    k.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    k.add_argument("--cached", action="store_true", help="report the cached choices, measuring only what is missing")
    add_output_args(k)
    k.set_defaults(func=run_kernels)

    d = bsub.add_parser("decode", help="decode tokens/s (single and batched), its profile and fidelity cost")
    d.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    d.add_argument("--configs", default="float32:exact,float32:onednn,bfloat16:exact,bfloat16:auto,float32:int8,"
                                         "bfloat16:int4",
                   help="comma-separated dtype:decode-weights pairs")
    d.add_argument("--batch-sizes", default="1,4,16")
    d.add_argument("--steps", type=int, default=32)
    d.add_argument("--rounds", type=int, default=3)
    d.add_argument("--fidelity-examples", type=int, default=8)
    add_output_args(d)
    d.set_defaults(func=run_decode)

    f = bsub.add_parser("train-step", help="one fine-tuning example's forward + backward: causal vs Block-Attention "
                                           "mask (dense, and block by block)")
    f.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    f.add_argument("--examples", type=int, default=4, help="HotpotQA train examples (10 passages each)")
    f.add_argument("--rounds", type=int, default=3, help="passes over the examples, the variants' order rotating")
    f.add_argument("--max-length", type=int, default=2048)
    f.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 autocast with fp32 weights, as `ragkv finetune` (default: where the hardware runs bf16 "
                        "fast)")
    f.add_argument("--device", default="cpu")
    f.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's; finetune runs used 1)")
    add_output_args(f)
    f.set_defaults(func=run_train_step)

    s = bsub.add_parser("store", help="KV store: load GB/s per tier, TTFT with blocks in memory / disk / Redis")
    s.add_argument("--context", type=int, default=4096, help="context tokens of the request")
    s.add_argument("--modes", default="reuse,blend", help="fusion modes reading the blocks (reuse, ape, blend)")
    s.add_argument("--query-tokens", type=int, default=50)
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--redis", default=None, metavar="URL", help="Redis to use (default: a private redis-server on "
                   "a free port for the run; the Redis rows are skipped if redis-server is not installed)")
    s.add_argument("--disk-dir", default=None, help="directory of the disk tier (default: a temporary directory "
                   "under $RAGKV_CACHE_DIR/bench, removed afterwards)")
    s.add_argument("--compare-kv", default="", metavar="CODECS", help="instead of timing tiers, compare compressed "
                   "stores (comma-separated: int8, int4, fp8) with the uncompressed one: bytes per token, "
                   "first-token KL and top-1 on HotpotQA (writes store_compressed.md)")
    s.add_argument("--examples", type=int, default=5, help="HotpotQA dev examples for --compare-kv")
    add_output_args(s)
    add_fusion_args(s, default_mode=None, title="mode parameters")
    add_model_args(s, decode_weights=False)
    s.set_defaults(func=run_store)

    v = bsub.add_parser("serve", help="load benchmark of `ragkv serve`: requests/s and TTFT per mode and "
                                      "concurrency, optionally beside vLLM's CPU backend (--peer vllm-cpu) or "
                                      "llama.cpp's server (--peer llama-cpp)")
    v.add_argument("--url", action="append", default=None,
                   help="a running server (default: start one here and stop it after); repeat it for servers "
                        "sharing one store: requests go round-robin, only the first is warmed up, and the table "
                        "shows each server's TTFT and hits")
    v.add_argument("--modes", default="full,prefix,reuse,blend",
                   help="ragkv modes or mode keys, comma-separated (reuse:kv=shared; empty with --peer: the "
                        "peer only)")
    v.add_argument("--concurrency", default="1,4,16", help="client threads per level, comma-separated")
    v.add_argument("--requests", type=int, default=32,
                   help="requests per cell; a closed-loop cell sends at least --min-waves per client")
    v.add_argument("--min-waves", type=int, default=3,
                   help="a closed-loop cell sends at least this many requests per client (steady state, not the "
                        "transient of one wave)")
    v.add_argument("--request-rates", default="", metavar="R,R",
                   help="open-loop cells too: --requests arrivals as a Poisson process at each rate (requests/s), "
                        "with goodput at --slo-ttft / --slo-tpot")
    v.add_argument("--slo-ttft", type=float, default=2.0, help="goodput's TTFT limit, seconds")
    v.add_argument("--slo-tpot", type=float, default=0.15, help="goodput's time-per-output-token limit, seconds")
    v.add_argument("--passages-per-request", type=int, default=4)
    v.add_argument("--pool-size", type=int, default=40, help="MuSiQue passages shared by all requests")
    v.add_argument("--passage-words", type=int, default=210, help="passages cut to this many words (~300 tokens)")
    v.add_argument("--max-tokens", type=int, default=64, help="answer length limit (greedy, streamed)")
    v.add_argument("--min-tokens", type=int, default=0,
                   help="no answer ends before this many tokens (vLLM's min_tokens, sent to ragkv and vllm-cpu; "
                        "llama-cpp ignores it): a decode-bound workload, e.g. --min-tokens 256 --max-tokens 256")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--no-warmup", action="store_true", help="skip the warm-up pass over the pool")
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

    so = bsub.add_parser("structured", help="decode tokens/s with and without response_format's constrained "
                                            "decoding (the grammar mask's cost), per batch size")
    so.add_argument("--batch-sizes", default="1,16")
    so.add_argument("--tokens", type=int, default=48, help="tokens decoded per sequence")
    so.add_argument("--repeats", type=int, default=3)
    add_output_args(so)
    add_model_args(so)
    so.set_defaults(func=run_structured)

    fz = bsub.add_parser("fuzz", help="property-based requests from the server's own OpenAPI document "
                                      "(schemathesis): counts per status, every 5xx listed")
    fz.add_argument("--examples", type=int, default=500, help="generated requests per route")
    fz.add_argument("--url", default=None, help="a running server (default: start one here)")
    fz.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    fz.add_argument("--new-draw", action="store_true", help="a new random draw (default: seeded, repeatable)")
    add_output_args(fz)
    fz.set_defaults(func=run_fuzz)

    sv = bsub.add_parser("shadow", help="what shadow verification costs live traffic: TTFT and req/s under load with "
                                        "--shadow-fraction F against 0, servers started here in alternating order")
    sv.add_argument("--mode", default="blend:sel=query,r=0.15", help="the requests' mode (approximate: checked)")
    sv.add_argument("--fraction", type=float, default=0.05, help="the checked server's --shadow-fraction")
    sv.add_argument("--concurrency", type=int, default=16, help="closed-loop clients")
    sv.add_argument("--requests", type=int, default=64, help="requests per run")
    sv.add_argument("--rounds", type=int, default=2, help="rounds of (without, with), the order flipped each round")
    sv.add_argument("--max-tokens", type=int, default=32)
    sv.add_argument("--seed", type=int, default=0)
    sv.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    sv.add_argument("--dtype", default="float32")
    add_output_args(sv)
    sv.set_defaults(func=run_shadow)

    fa = bsub.add_parser("fairness", help="another tenant's TTFT while one tenant's long request (ape over many "
                                          "documents) runs, against a `ragkv serve` started here")
    fa.add_argument("--mode", default="ape", help="the long request's mode")
    fa.add_argument("--docs", type=int, default=8, help="documents of the long request")
    fa.add_argument("--words", type=int, default=1500, help="words per document (about one token each)")
    fa.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                    help="extra argument for the started server, repeatable")
    add_output_args(fa)
    fa.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    fa.add_argument("--dtype", default="float32")
    fa.set_defaults(func=run_fairness)

    k = bsub.add_parser("soak", help="N clients for M minutes against `ragkv serve` (two tenants, memory+disk+Redis "
                                     "store) while faults are injected: crashes, 5xx, lost documents, cross-tenant "
                                     "reads, changed greedy answers")
    k.add_argument("--clients", type=int, default=4, help="concurrent client threads")
    k.add_argument("--minutes", type=float, default=3.0, help="minutes of load with faults (after --calm)")
    k.add_argument("--calm", type=float, default=20.0, help="seconds of load without faults first")
    k.add_argument("--fault-interval", type=float, default=10.0, help="mean seconds between two faults")
    k.add_argument("--seed", type=int, default=0, help="seeds the workload, the clients and the fault injector")
    k.add_argument("--modes", default="reuse,blend,full", help="modes the clients use, comma-separated")
    k.add_argument("--max-tokens", type=int, default=16, help="answer length limit (greedy)")
    k.add_argument("--memory", default="48MiB", help="memory tier of the server's store (small: blocks fall "
                   "through to disk and Redis)")
    k.add_argument("--disk-size", default="512MiB", help="disk tier capacity")
    k.add_argument("--request-timeout", type=float, default=180.0, help="client-side seconds per request")
    k.add_argument("--max-requests", type=int, default=20_000, help="requests of all clients together, at most")
    k.add_argument("--work-dir", default=None, help="server cache folder, Redis folder and logs (default: "
                   "OUTPUT_DIR/soak-work; cleared at the start, its KV files removed at the end)")
    k.add_argument("--max-batch", type=int, default=8, help="the server's --max-batch")
    k.add_argument("--kv-memory", default="2GiB", help="the server's --kv-memory (`default`: not passed)")
    ab = k.add_argument_group("abuse phase (after the faults; RSS watched; all counts 0: none)")
    ab.add_argument("--abuse-only", action="store_true", help="set up, then run the abuse phase only")
    ab.add_argument("--abuse-clients", type=int, default=8)
    ab.add_argument("--abuse-streams", type=int, default=200, help="streams closed after a few events")
    ab.add_argument("--abuse-n", type=int, default=8, help="choices per abandoned stream")
    ab.add_argument("--abuse-max-tokens", type=int, default=2000, help="max_tokens of an abandoned stream")
    ab.add_argument("--abuse-read-events", type=int, default=3, help="events read before closing")
    ab.add_argument("--abuse-salts", type=int, default=40, help="requests with a cache_salt of their own")
    ab.add_argument("--abuse-long-words", type=int, default=4, help="requests whose document is one long word")
    ab.add_argument("--abuse-word-chars", type=int, default=6000, help="letters of that word")
    ab.add_argument("--abuse-documents", type=int, default=6,
                    help="requests with the most inline documents the server accepts (every other one: one more)")
    ab.add_argument("--abuse-seconds", type=float, default=600.0, help="the phase stops sending after this long")
    ab.add_argument("--rss-slack", default="1GiB", help="RSS may rise by memory tier + KV limit + this")
    ab.add_argument("--rss-return-pct", type=float, default=10.0, help="RSS must come back within this %% of its "
                    "pre-phase level ...")
    ab.add_argument("--rss-return-s", type=float, default=30.0, help="... within this many seconds")
    ho = k.add_argument_group("hostile traffic during the faults (0: none)")
    ho.add_argument("--fuzz-clients", type=int, default=0, help="threads fuzzing the API from its OpenAPI schema")
    ho.add_argument("--fuzz-examples", type=int, default=25, help="generated requests per route and round")
    ho.add_argument("--long-ape-every", type=float, default=0.0, help="seconds between two long `ape` requests")
    ho.add_argument("--long-ape-documents", type=int, default=8, help="documents of a long `ape` request")
    ho.add_argument("--long-ape-words", type=int, default=1000, help="words per document (random letters, ~3.6 "
                    "tokens a word: 8 x 1000 is ~29K tokens)")
    add_output_args(k)
    add_model_args(k, decode_weights=False)
    add_replica_soak_args(k)
    k.set_defaults(func=run_soak)
    h = bsub.add_parser("chat", help="a long stateless chat as it is, compacted and with a dropped exchange: TTFT "
                                     "per turn of full, prefix and chat turns as blocks, with KL to full")
    h.add_argument("--turns", type=int, default=20, help="user turns of the conversation")
    h.add_argument("--edit-at", type=int, default=12, help="the turn at which the history is compacted or cut")
    h.add_argument("--words", type=int, default=80, help="words of each user turn (a MuSiQue passage's start)")
    h.add_argument("--paths", default="prefix,auto,blend:sel=query,r=0.3",
                   help="mode keys beside full, the reference (comma-separated; a key keeps its own parameters)")
    h.add_argument("--scenarios", default="unedited,compacted,dropped")
    h.add_argument("--repeats", type=int, default=3, help="runs of each measured turn (the edit, the last), each "
                                                          "from the same cache state; the median is reported")
    add_output_args(h)
    add_model_args(h)
    h.set_defaults(func=run_chat)

    c = bsub.add_parser("controller", help="blend's loading controller vs every fixed (r, tier) choice: TTFT and "
                                           "first-token KL, blocks spread over memory, disk, Redis and a throttled "
                                           "tier")
    c.add_argument("--context", type=int, default=3072, help="context tokens of the request")
    c.add_argument("--query-tokens", type=int, default=50)
    c.add_argument("--ratios", default="0.05,0.15,0.3,0.5", help="the fixed choices' r, comma-separated")
    c.add_argument("--repeats", type=int, default=3, help="timed round-robin rounds")
    c.add_argument("--throttle", choices=("latency", "bandwidth"), default="latency",
                   help="throttled tier: a fixed delay per block and layer read, or a bandwidth limit")
    c.add_argument("--throttle-ms", type=float, default=None, help="latency: the delay (default: auto, see "
                   "--throttle-factor)")
    c.add_argument("--throttle-mbps", type=float, default=None, help="bandwidth: MB/s (default: auto)")
    c.add_argument("--throttle-factor", type=float, default=2.0, help="auto throttle: the blocks held only by the "
                   "throttled tier load in this x the recompute at r_min per layer")
    c.add_argument("--target", type=float, default=1.10, help="controller TTFT / best fixed TTFT at equal KL")
    c.add_argument("--keep-profile", action="store_true", help="use a saved recompute profile instead of "
                   "re-measuring it under this run's threads")
    c.add_argument("--redis", default=None, metavar="URL", help="Redis to use (default: a private redis-server)")
    c.add_argument("--disk-dir", default=None, help="disk tiers' parent directory (default: temporary)")
    add_output_args(c)
    add_fusion_args(c, default_mode=None, title="blend parameters (--ratio: the controller's r_min)")
    add_model_args(c, decode_weights=False)
    c.set_defaults(func=run_controller)
    from ragkv.cli import bench_probes

    bench_probes.register(bsub)
    p.set_defaults(func=lambda args: p.print_help() or 2)


def run_structured(args) -> int:
    from ragkv.bench.structured import StructuredBenchConfig, run_structured_bench

    cfg = StructuredBenchConfig(batch_sizes=ints(args.batch_sizes, "--batch-sizes"), tokens=args.tokens,
                                repeats=args.repeats)
    return finish_bench(args, run_structured_bench(engine_from_args(args), cfg, Path(args.output_dir), say),
                   "structured.md")


def run_fuzz(args) -> int:
    from ragkv.bench.fuzz import FuzzConfig, run_fuzz_bench

    cfg = FuzzConfig(examples=args.examples, url=args.url, model=args.model, seed=None if args.new_draw else 0)
    result = run_fuzz_bench(cfg, Path(args.output_dir), say)
    finish_bench(args, result, "fuzz.md")
    return 1 if result["failures"] else 0


def run_shadow(args) -> int:
    from ragkv.bench.shadow_cost import ShadowBenchConfig, run_shadow_bench

    cfg = ShadowBenchConfig(model=args.model, dtype=args.dtype, mode=args.mode, fraction=args.fraction,
                            concurrency=args.concurrency, requests=args.requests, rounds=args.rounds,
                            max_tokens=args.max_tokens, seed=args.seed)
    return finish_bench(args, run_shadow_bench(cfg, Path(args.output_dir), say), "shadow_bench.md")


def run_fairness(args) -> int:
    from ragkv.bench.fairness import FairnessConfig, run_fairness_bench

    cfg = FairnessConfig(model=args.model, dtype=args.dtype, mode=args.mode, docs=args.docs, words=args.words,
                         server_args=tuple(args.server_arg))
    return finish_bench(args, run_fairness_bench(cfg, Path(args.output_dir), say), "fairness.md")


def _modes(text: str) -> tuple[str, ...]:
    return tuple(m for m in text.split(",") if m)


def run_chat(args) -> int:
    from ragkv.bench.chat import SCENARIOS, ChatBenchConfig, run_chat_bench
    from ragkv.eval.modes import split_mode_list

    scenarios = tuple(s for s in args.scenarios.split(",") if s)
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown or not scenarios:
        raise InvalidRequestError(f"--scenarios takes {', '.join(SCENARIOS)}; got {args.scenarios!r}")
    if not 2 <= args.edit_at <= args.turns:
        raise InvalidRequestError(f"--edit-at must be in 2..--turns ({args.turns}), got {args.edit_at}")
    cfg = ChatBenchConfig(turns=args.turns, edit_at=args.edit_at, words=args.words,
                          paths=tuple(split_mode_list(args.paths)), scenarios=scenarios,
                          repeats=max(1, args.repeats))
    result = run_chat_bench(engine_from_args(args), cfg, Path(args.output_dir), say)
    return finish_bench(args, result, "chat.md")


def run_ttft(args) -> int:
    from ragkv.bench.ttft import TtftBenchConfig, run_ttft_bench

    cfg = TtftBenchConfig(contexts=ints(args.contexts, "--contexts"), modes=_modes(args.modes),
                          query_tokens=args.query_tokens, repeats=args.repeats, fusion=fusion_from_args(args))
    result = run_ttft_bench(engine_from_args(args), cfg, Path(args.output_dir), say)
    return finish_bench(args, result, "ttft.md")


def run_shared(args) -> int:
    from ragkv.bench.shared_blocks import SharedBenchConfig, run_shared_bench

    cfg = SharedBenchConfig(passages=args.passages, distinct=args.distinct, requests=args.requests,
                            batch_sizes=ints(args.batch_sizes, "--batch-sizes"), steps=args.steps, mode=args.mode)
    return finish_bench(args, run_shared_bench(engine_from_args(args), cfg, Path(args.output_dir), say), "shared.md")


def run_invariance(args) -> int:
    from ragkv.bench.invariance import InvarianceBenchConfig, run_invariance_bench

    if args.rows < args.requests:
        raise RagkvError(f"--rows ({args.rows}) must be at least --requests ({args.requests}): the batch is "
                         "compared at one fixed row count")
    cfg = InvarianceBenchConfig(requests=args.requests, tokens=args.tokens, passages=args.passages, rows=args.rows,
                                fusion=fusion_from_args(args))
    return finish_bench(args, run_invariance_bench(engine_from_args(args), cfg, Path(args.output_dir), say),
                   "invariance.md")


def run_engine(args) -> int:
    from ragkv.bench.engine_vs_hf import EngineBenchConfig, run_engine_bench

    from ragkv.models.quant import WEIGHT_CHOICES

    weights = tuple(w for w in args.weights.split(",") if w)
    bad = [w for w in weights if w not in WEIGHT_CHOICES]
    if bad or not weights:
        raise InvalidRequestError(f"--weights: {bad or args.weights!r} not among {', '.join(WEIGHT_CHOICES)}")
    cfg = EngineBenchConfig(args.model, ints(args.lengths, "--lengths"), tuple(args.dtypes.split(",")), args.repeats,
                            weights)
    return finish_bench(args, run_engine_bench(cfg, Path(args.output_dir), say), "engine_vs_hf.md")


def run_kernels(args) -> int:
    from ragkv.bench.kernels import run_kernels_bench

    return finish_bench(args, run_kernels_bench(args.model, Path(args.output_dir), say, not args.cached),
                        "kernels.md")


def run_decode(args) -> int:
    from ragkv.bench.decode import DecodeBenchConfig, run_decode_bench

    configs = tuple(tuple(c.split(":")) for c in args.configs.split(",") if c)
    if not configs or any(len(c) != 2 for c in configs):
        raise RagkvError(f"--configs wants dtype:weights pairs like float32:int4, got {args.configs!r}")
    cfg = DecodeBenchConfig(model=args.model, configs=configs, batch_sizes=ints(args.batch_sizes, "--batch-sizes"),
                            steps=args.steps, rounds=args.rounds, fidelity_examples=args.fidelity_examples)
    return finish_bench(args, run_decode_bench(cfg, Path(args.output_dir), say), "decode.md")


def run_train_step(args) -> int:
    from ragkv.bench.train_step import TrainStepBenchConfig, run_train_step_bench
    from ragkv.config import resolve_autocast, resolve_device

    if args.examples < 1 or args.rounds < 1 or (args.threads is not None and args.threads < 1):
        raise InvalidRequestError("--examples, --rounds and --threads must be >= 1")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    bf16 = resolve_autocast(args.bf16, device)
    cfg = TrainStepBenchConfig(model=args.model, examples=args.examples, rounds=args.rounds,
                               max_length=args.max_length, bf16=bf16, device=str(device))
    return finish_bench(args, run_train_step_bench(cfg, Path(args.output_dir), say), "train_step.md")


def run_store(args) -> int:
    from ragkv.bench.store import StoreBenchConfig, run_store_bench

    cfg = StoreBenchConfig(model=args.model, dtype=args.dtype, device=args.device, context=args.context,
                           modes=_modes(args.modes), query_tokens=args.query_tokens, repeats=args.repeats,
                           fusion=replace(fusion_from_args(args), mode="full"), redis=args.redis,
                           disk_dir=args.disk_dir, compare_kv=_modes(args.compare_kv), examples=args.examples)
    return finish_bench(args, run_store_bench(cfg, Path(args.output_dir), say),
                   "store_compressed.md" if cfg.compare_kv else "store_bench.md")


def run_serve(args) -> int:
    if args.replicas > 1:
        return run_replicas_bench(args)
    from ragkv.bench.serve import ServeBenchConfig, ServerProcess, run_serve_bench
    from ragkv.bench.serve.peer import make_peer

    from ragkv.eval.modes import split_mode_list

    cfg = ServeBenchConfig(modes=tuple(split_mode_list(args.modes)),
                           concurrency=ints(args.concurrency, "--concurrency"),
                           requests=args.requests, passages_per_request=args.passages_per_request,
                           pool_size=args.pool_size, passage_words=args.passage_words, max_tokens=args.max_tokens,
                           min_tokens=args.min_tokens, seed=args.seed, warmup=not args.no_warmup, peer=args.peer,
                           min_waves=args.min_waves, rates=floats(args.request_rates, "--request-rates"),
                           slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot)
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


def run_soak(args) -> int:
    if args.replicas > 1:
        return run_replica_soak_bench(args)
    from ragkv.bench.soak import SoakConfig, run_soak as run_soak_bench

    cfg = SoakConfig(clients=args.clients, minutes=args.minutes, seed=args.seed, fault_interval_s=args.fault_interval,
                     calm_s=args.calm, model=args.model, dtype=args.dtype, device=args.device,
                     modes=_modes(args.modes), max_tokens=args.max_tokens, memory=args.memory,
                     disk_size=args.disk_size, request_timeout_s=args.request_timeout,
                     max_requests=args.max_requests, work_dir=args.work_dir, max_batch=args.max_batch,
                     kv_memory=None if args.kv_memory == "default" else args.kv_memory, abuse_only=args.abuse_only,
                     abuse_clients=args.abuse_clients, abuse_streams=args.abuse_streams, abuse_n=args.abuse_n,
                     abuse_max_tokens=args.abuse_max_tokens, abuse_read_events=args.abuse_read_events,
                     abuse_salts=args.abuse_salts, abuse_long_words=args.abuse_long_words,
                     abuse_word_chars=args.abuse_word_chars, abuse_documents=args.abuse_documents,
                     abuse_max_s=args.abuse_seconds, rss_slack=args.rss_slack, rss_return_pct=args.rss_return_pct,
                     rss_return_s=args.rss_return_s, fuzz_clients=args.fuzz_clients,
                     fuzz_examples=args.fuzz_examples, long_ape_every_s=args.long_ape_every,
                     long_ape_documents=args.long_ape_documents, long_ape_words=args.long_ape_words)
    return finish_bench(args, run_soak_bench(cfg, Path(args.output_dir), say), "soak.md")


def run_controller(args) -> int:
    from ragkv.bench.controller import ControllerBenchConfig, run_controller_bench
    from ragkv.cli.common import floats

    fusion = fusion_from_args(args, mode="blend")
    cfg = ControllerBenchConfig(model=args.model, dtype=args.dtype, device=args.device, context=args.context,
                                query_tokens=args.query_tokens, ratios=floats(args.ratios, "--ratios"),
                                r_min=fusion.ratio, repeats=args.repeats, throttle=args.throttle,
                                throttle_ms=args.throttle_ms, throttle_mbps=args.throttle_mbps,
                                throttle_factor=args.throttle_factor, target=args.target,
                                refresh_profile=not args.keep_profile,
                                fusion=replace(fusion, auto_ratio=False), redis=args.redis, disk_dir=args.disk_dir)
    return finish_bench(args, run_controller_bench(cfg, Path(args.output_dir), say), "controller_bench.md")
