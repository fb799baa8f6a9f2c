"""Options shared by subcommands and the one place that turns flags into engine objects."""

from __future__ import annotations

import argparse
import json
import sys

from ragkv.engine.options import MODES


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default="smollm2", help="known name (smollm2) or a local Hugging Face folder")
    g.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 (auto: bf16 where fast)")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    g.add_argument("--decode-weights", default="exact", choices=("exact", "int8", "int4"),
                   help="weights of the decode steps (prefill stays exact): int4/int8 are weight-only quantized "
                        "copies, 2-4x faster decode on CPU, with the fidelity cost `ragkv bench decode` prints")


def add_store_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("KV store")
    g.add_argument("--store", default=None,
                   help="tiers, e.g. memory:2GiB,disk:~/.cache/ragkv/kv:20GiB,redis://127.0.0.1:6379/0 "
                        "(default: memory only)")
    g.add_argument("--namespace", default="default", help="tenant namespace of cached blocks")


def add_fusion_args(p: argparse.ArgumentParser, default_mode: str = "reuse") -> None:
    g = p.add_argument_group("fusion")
    g.add_argument("--mode", default=default_mode, choices=MODES)
    add_fusion_params(g)


def add_fusion_params(g, auto_ratio: bool = True) -> None:
    """The per-mode parameters (blend's and APE's); `auto_ratio` also accepts --ratio auto (loading controller)."""
    if auto_ratio:
        g.add_argument("--ratio", default="0.15",
                       help="blend: recompute ratio r in [0, 1], or 'auto' (loading controller, r >= 0.15)")
    else:
        g.add_argument("--ratio", type=float, default=0.15, help="blend: recompute ratio r in [0, 1]")
    g.add_argument("--check-layers", default="1", help="blend: comma-separated check layers")
    g.add_argument("--deviation", default="v", choices=("v", "k"), help="blend: deviation measured on V or K")
    g.add_argument("--gradual", action="store_true", help="blend: gradual filtering over the check layers")
    g.add_argument("--sink-tokens", type=int, default=0, help="blend: always recompute each block's first N")
    g.add_argument("--ape-temperature", type=float, default=None, help="ape: T (default: calibrated or 0.9)")
    g.add_argument("--ape-scale", type=float, default=None, help="ape: S (default: calibrated or 0.9)")


def fusion_from_args(args, mode: str | None = None):
    from ragkv.engine.options import FusionOptions
    from ragkv.errors import InvalidRequestError

    try:
        checks = tuple(int(c) for c in str(args.check_layers).split(",") if c.strip())
    except ValueError:
        raise InvalidRequestError(f"--check-layers wants comma-separated integers, got {args.check_layers!r}")
    auto = str(args.ratio) == "auto"
    try:
        ratio = 0.15 if auto else float(args.ratio)
    except ValueError:
        raise InvalidRequestError(f"--ratio wants a number in [0, 1] or 'auto', got {args.ratio!r}")
    return FusionOptions(mode=mode or args.mode, ratio=ratio, auto_ratio=auto, check_layers=checks,
                         deviation=args.deviation,
                         gradual=args.gradual, sink_tokens=args.sink_tokens,
                         ape_temperature=args.ape_temperature, ape_scale=args.ape_scale)


def make_store(spec: str | None):
    if not spec:
        from ragkv.store.base import MemoryStore
        return MemoryStore()
    from ragkv.store.spec import open_store
    return open_store(spec)


def engine_from_args(args, store=None):
    from ragkv.engine.engine import Engine

    if store is None and hasattr(args, "store"):
        store = make_store(args.store)
    return Engine.load(args.model, dtype=args.dtype, device=args.device, store=store,
                       namespace=getattr(args, "namespace", "default"),
                       decode_weights=getattr(args, "decode_weights", "exact"))


def print_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=2, ensure_ascii=False)
    sys.stdout.write("\n")
