"""`ragkv bench ...` (ttft, decode, store, serve, soak and more): flags -> each benchmark's config (ragkv.bench.*)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from ragkv.cli.config_args import add_config_args, config_from_args
from ragkv.cli.common import (MODEL_HELP, add_fusion_args, add_model_args, add_output_args, engine_from_args,
                              finish_bench, fusion_from_args, say)
from ragkv.errors import InvalidRequestError, RagkvError
from ragkv.settings import DEFAULT_MODEL


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: ttft, shared, invariance, engine (vs transformers), decode, "
                                     "train-step, store, serve, structured, fuzz, fairness, soak, chat, controller, "
                                     "lookahead, ceiling, profile, weights, shadow")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH")

    for add in (_add_ttft, _add_shared, _add_invariance, _add_engine, _add_kernels, _add_decode, _add_train_step,
                _add_store, _add_controller):
        add(bsub)
    from ragkv.cli import bench_probes, bench_serving, bench_soak

    bench_serving.register(bsub)
    bench_soak.register(bsub)
    bench_probes.register(bsub)
    p.set_defaults(func=lambda args: p.print_help() or 2)


def _add_ttft(bsub) -> None:
    from ragkv.bench.ttft import TtftBenchConfig

    t = bsub.add_parser("ttft", help="TTFT and FLOPs to first token per mode and context length")
    add_config_args(t, TtftBenchConfig, skip=("fusion",), help={
        "contexts": "context lengths (tokens)", "modes": "fusion modes timed", "query_tokens": "query tokens",
        "repeats": "timed runs of each cell (the median counts)"})
    add_output_args(t)
    add_fusion_args(t, default_mode=None, title="mode parameters")
    add_model_args(t)
    t.set_defaults(func=run_ttft)


def _add_shared(bsub) -> None:
    from ragkv.bench.shared_blocks import SharedBenchConfig

    sh = bsub.add_parser("shared", help="reuse with blocks copied per request vs read in place from the pool: TTFT "
                                        "and batched decode steps")
    add_config_args(sh, SharedBenchConfig, help={
        "passages": "blocks per request", "distinct": "passages the requests draw from",
        "requests": "TTFT samples per layout", "batch_sizes": "batched decode sizes",
        "steps": "decode steps timed per batch size", "seed": "the passages drawn",
        "mode": "the requests' mode: reuse, ape or blend"})
    add_output_args(sh)
    add_model_args(sh)
    sh.set_defaults(func=run_shared)


def _add_invariance(bsub) -> None:
    from ragkv.bench.invariance import InvarianceBenchConfig

    iv = bsub.add_parser("invariance", help="greedy answers decoded in a batch vs alone, with free and fixed row "
                                            "counts (serve --batch-invariant), and the fixed count's cost")
    add_config_args(iv, InvarianceBenchConfig, skip=("fusion",), help={
        "requests": "requests decoded together", "tokens": "greedy tokens per request",
        "passages": "blocks per request", "distinct": "passages the requests draw from",
        "rows": "the fixed row count (serve's --max-batch)", "seed": "the passages drawn"})
    add_output_args(iv)
    add_fusion_args(iv, title="the requests' mode")
    add_model_args(iv)
    iv.set_defaults(func=run_invariance)


def _add_engine(bsub) -> None:
    from ragkv.bench.engine_vs_hf import EngineBenchConfig

    e = bsub.add_parser("engine", help="our full prefill vs transformers' forward on the same tokens")
    add_config_args(e, EngineBenchConfig, help={
        "model": MODEL_HELP, "lengths": "prompt lengths (tokens)", "dtypes": "dtypes timed",
        "repeats": "rounds, each side once per round in turn (the median counts)",
        "weights": "decode copies whose prefill is timed (as --decode-weights: e.g. auto,w8a8)"})
    add_output_args(e)
    e.set_defaults(func=run_engine)


def _add_kernels(bsub) -> None:
    k = bsub.add_parser("kernels", help="every candidate kernel of every bf16 product, timed per row class on this "
                                        "machine, and the one the engine uses (cached per CPU; this re-measures)")
    k.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    k.add_argument("--cached", action="store_true", help="report the cached choices, measuring only what is missing")
    add_output_args(k)
    k.set_defaults(func=run_kernels)


def _add_decode(bsub) -> None:
    from ragkv.bench.decode import DecodeBenchConfig

    d = bsub.add_parser("decode", help="decode tokens/s (single and batched), its profile and fidelity cost")
    add_config_args(d, DecodeBenchConfig, help={
        "model": MODEL_HELP, "configs": "dtype:decode-weights pairs", "batch_sizes": "batched decode sizes",
        "steps": "decode steps timed per run", "rounds": "rounds over the configs, in turn",
        "fidelity_examples": "prompts whose greedy answers are compared with fp32 exact (0: none)",
        "passages": "blocks per prompt"})
    add_output_args(d)
    d.set_defaults(func=run_decode)


def _add_train_step(bsub) -> None:
    from ragkv.bench.train_step import TrainStepBenchConfig

    f = bsub.add_parser("train-step", help="one fine-tuning example's forward + backward: causal vs Block-Attention "
                                           "mask (dense, and block by block)")
    add_config_args(f, TrainStepBenchConfig, skip=("bf16", "device"), help={
        "model": MODEL_HELP, "examples": "HotpotQA train examples (10 passages each)",
        "rounds": "passes over the examples, the variants' order rotating",
        "max_length": "tokens per example, at most"})
    f.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 autocast with fp32 weights, as `ragkv finetune` (default: where the hardware runs bf16 "
                        "fast)")
    f.add_argument("--device", default="cpu")
    f.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's; finetune runs used 1)")
    add_output_args(f)
    f.set_defaults(func=run_train_step)


def _add_store(bsub) -> None:
    from ragkv.bench.store import StoreBenchConfig

    s = bsub.add_parser("store", help="KV store: load GB/s per tier, TTFT with blocks in memory / disk / Redis")
    add_config_args(s, StoreBenchConfig, skip=("model", "dtype", "device", "fusion"), help={
        "context": "context tokens of the request", "modes": "fusion modes reading the blocks (reuse, ape, blend)",
        "query_tokens": "query tokens", "repeats": "timed runs of each cell",
        "redis": "Redis URL to use (default: a private redis-server on a free port for the run; the Redis rows are "
                 "skipped if redis-server is not installed)",
        "disk_dir": "directory of the disk tier (default: a temporary directory under $RAGKV_CACHE_DIR/bench, "
                    "removed afterwards)",
        "compare_kv": "instead of timing tiers, compare compressed stores (int8, int4, fp8) with the uncompressed "
                      "one: bytes per token, first-token KL and top-1 on HotpotQA (writes store_compressed.md)",
        "examples": "HotpotQA dev examples for --compare-kv"})
    add_output_args(s)
    add_fusion_args(s, default_mode=None, title="mode parameters")
    add_model_args(s, decode_weights=False)
    s.set_defaults(func=run_store)


def _add_controller(bsub) -> None:
    from ragkv.bench.controller.config import ControllerBenchConfig

    c = bsub.add_parser("controller", help="blend's loading controller vs every fixed (r, tier) choice: TTFT and "
                                           "first-token KL, blocks spread over memory, disk, Redis and a throttled "
                                           "tier")
    add_config_args(c, ControllerBenchConfig, skip=CONTROLLER_BUILT, help={
        "context": "context tokens of the request", "query_tokens": "query tokens",
        "ratios": "the fixed choices' r", "repeats": "timed round-robin rounds",
        "throttle": "throttled tier: latency (a fixed delay per block and layer read) or bandwidth (a limit)",
        "throttle_ms": "latency: the delay (default: auto, see --throttle-factor)",
        "throttle_mbps": "bandwidth: MB/s (default: auto)",
        "throttle_factor": "auto throttle: the blocks held only by the throttled tier load in this x the recompute "
                           "at r_min per layer",
        "target": "controller TTFT / best fixed TTFT at equal KL",
        "redis": "Redis URL to use (default: a private redis-server)",
        "disk_dir": "disk tiers' parent directory (default: temporary)"})
    c.add_argument("--keep-profile", action="store_true", help="use a saved recompute profile instead of "
                   "re-measuring it under this run's threads")
    add_output_args(c)
    add_fusion_args(c, default_mode=None, title="blend parameters (--ratio: the controller's r_min)")
    add_model_args(c, decode_weights=False)
    c.set_defaults(func=run_controller)


# the controller bench's fields the CLI builds itself: the model flags, blend's options and --keep-profile
CONTROLLER_BUILT = ("model", "dtype", "device", "r_min", "refresh_profile", "fusion")


def run_ttft(args) -> int:
    from ragkv.bench.ttft import TtftBenchConfig, run_ttft_bench

    cfg = config_from_args(TtftBenchConfig, args, fusion=fusion_from_args(args))
    result = run_ttft_bench(engine_from_args(args), cfg, Path(args.output_dir), say)
    return finish_bench(args, result, "ttft.md")


def run_shared(args) -> int:
    from ragkv.bench.shared_blocks import SharedBenchConfig, run_shared_bench

    shared_modes = ("reuse", "ape", "blend")  # the modes that read pooled blocks
    if args.mode not in shared_modes:
        raise InvalidRequestError(f"--mode takes {', '.join(shared_modes)}, got {args.mode!r}")
    cfg = config_from_args(SharedBenchConfig, args)
    return finish_bench(args, run_shared_bench(engine_from_args(args), cfg, Path(args.output_dir), say), "shared.md")


def run_invariance(args) -> int:
    from ragkv.bench.invariance import InvarianceBenchConfig, run_invariance_bench

    if args.rows < args.requests:
        raise RagkvError(f"--rows ({args.rows}) must be at least --requests ({args.requests}): the batch is "
                         "compared at one fixed row count")
    cfg = config_from_args(InvarianceBenchConfig, args, fusion=fusion_from_args(args))
    return finish_bench(args, run_invariance_bench(engine_from_args(args), cfg, Path(args.output_dir), say),
                   "invariance.md")


def run_engine(args) -> int:
    from ragkv.bench.engine_vs_hf import EngineBenchConfig, run_engine_bench

    from ragkv.models.quant import WEIGHT_CHOICES

    cfg = config_from_args(EngineBenchConfig, args)
    bad = [w for w in cfg.weights if w not in WEIGHT_CHOICES]
    if bad or not cfg.weights:
        raise InvalidRequestError(f"--weights: {bad or args.weights!r} not among {', '.join(WEIGHT_CHOICES)}")
    return finish_bench(args, run_engine_bench(cfg, Path(args.output_dir), say), "engine_vs_hf.md")


def run_kernels(args) -> int:
    from ragkv.bench.kernels import run_kernels_bench

    return finish_bench(args, run_kernels_bench(args.model, Path(args.output_dir), say, not args.cached),
                        "kernels.md")


def run_decode(args) -> int:
    from ragkv.bench.decode import DecodeBenchConfig, run_decode_bench

    cfg = config_from_args(DecodeBenchConfig, args)
    if not cfg.configs:
        raise RagkvError(f"--configs wants dtype:weights pairs like float32:int4, got {args.configs!r}")
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
    cfg = config_from_args(TrainStepBenchConfig, args, bf16=bf16, device=str(device))
    return finish_bench(args, run_train_step_bench(cfg, Path(args.output_dir), say), "train_step.md")


def run_store(args) -> int:
    from ragkv.bench.store import StoreBenchConfig, run_store_bench

    cfg = config_from_args(StoreBenchConfig, args, model=args.model, dtype=args.dtype, device=args.device,
                           fusion=replace(fusion_from_args(args), mode="full"))
    return finish_bench(args, run_store_bench(cfg, Path(args.output_dir), say),
                   "store_compressed.md" if cfg.compare_kv else "store_bench.md")


def run_controller(args) -> int:
    from ragkv.bench.controller import ControllerBenchConfig, run_controller_bench

    fusion = fusion_from_args(args, mode="blend")
    cfg = config_from_args(ControllerBenchConfig, args, model=args.model, dtype=args.dtype, device=args.device,
                           r_min=fusion.ratio, refresh_profile=not args.keep_profile,
                           fusion=replace(fusion, auto_ratio=False))
    return finish_bench(args, run_controller_bench(cfg, Path(args.output_dir), say), "controller_bench.md")
