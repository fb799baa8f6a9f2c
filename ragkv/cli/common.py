"""Flags shared by the subcommands, and the one place where they become engine objects and configs."""

from __future__ import annotations

import argparse
import json
import sys

from ragkv.engine.options import MODES, FusionOptions
from ragkv.errors import InvalidRequestError
from ragkv.settings import (DEFAULT_DTYPE, DEFAULT_MODEL, DEFAULT_NAMESPACE, default_index_dir,
                            default_store_spec)
from ragkv.store.spec import SYNTAX


MODEL_HELP = ("known name (see `ragkv models`), a local Hugging Face folder, or a .gguf file of a Llama, Mistral or "
              "Qwen2 model (converted once per file content into the models folder)")


def add_model_args(p: argparse.ArgumentParser, decode_weights: bool = True) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    g.add_argument("--dtype", default=DEFAULT_DTYPE, help="auto | float32 | bfloat16 (auto: bf16 where fast)")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    if decode_weights:
        g.add_argument("--decode-weights", default="exact", choices=("exact", "int8", "int4"),
                       help="weights of the decode steps (prefill stays exact): int4/int8 are weight-only "
                            "quantized copies, 2-4x faster decode on CPU, with the fidelity cost `ragkv bench "
                            "decode` prints")


def add_store_args(p: argparse.ArgumentParser, namespace: bool = True) -> None:
    g = p.add_argument_group("KV store")
    g.add_argument("--store", default=default_store_spec(), metavar="SPEC",
                   help=f"tiers, fastest first (default: {default_store_spec()}, the same for every command and "
                        f"the server); {SYNTAX}")
    if namespace:
        g.add_argument("--namespace", default=DEFAULT_NAMESPACE, help="tenant namespace of cached blocks")


def add_index_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--index", default=str(default_index_dir()),
                   help="document index folder shared by ingest, ask and serve (default: %(default)s)")
    p.add_argument("--library", default=None, metavar="URL",
                   help="keep the document library in Redis instead of --index, shared by every server that names "
                        "it: redis://HOST:PORT/DB or redis+cluster://HOST:PORT[,HOST:PORT...] (?prefix=P)")


def library_location(args):
    """Where the document library is: --library's Redis URL (checked now, naming the flag) or the --index folder."""
    if args.library is None:
        return args.index
    from ragkv.rag.catalog import CatalogError, is_library_url
    from ragkv.rag.redis_catalog import parse_library_url

    if not is_library_url(args.library):
        raise InvalidRequestError(f"--library wants a Redis URL (redis://HOST:PORT/DB or "
                                  f"redis+cluster://HOST:PORT,...), got {args.library!r}; for a folder use --index")
    try:
        parse_library_url(args.library)
    except CatalogError as e:
        raise InvalidRequestError(str(e)) from None
    return args.library


def add_fusion_args(p: argparse.ArgumentParser, default_mode: str | None = "reuse", title: str = "fusion") -> None:
    """The fusion mode (unless `default_mode` is None) and every parameter of FusionOptions, for ask, eval,
    serve and the benchmarks alike."""
    g = p.add_argument_group(title)
    if default_mode is not None:
        g.add_argument("--mode", default=default_mode, choices=MODES)
    d = FusionOptions()
    g.add_argument("--ratio", default=str(d.ratio),
                   help="blend: recompute ratio r in [0, 1], or 'auto' (loading controller, r >= 0.15)")
    g.add_argument("--check-layers", default=",".join(map(str, d.check_layers)),
                   help="blend: comma-separated check layers")
    g.add_argument("--deviation", default=d.deviation, choices=("v", "k"), help="blend: deviation on V or K")
    g.add_argument("--gradual", action="store_true", help="blend: gradual filtering over the check layers")
    g.add_argument("--sink-tokens", type=int, default=d.sink_tokens,
                   help="blend: always recompute each block's first N")
    g.add_argument("--check-rows", default=d.check_rows, choices=("selected", "all"),
                   help="blend: rows the check layer itself recomputes (all: every row, as CacheBlend's code)")
    g.add_argument("--select-per-block", action="store_true", help="blend: keep the top r of each block")
    g.add_argument("--ape-temperature", type=float, default=None, help="ape: T (default: calibrated or 0.9)")
    g.add_argument("--ape-scale", type=float, default=None, help="ape: S (default: calibrated or 0.9)")


def fusion_from_args(args, mode: str | None = None) -> FusionOptions:
    try:
        checks = tuple(int(c) for c in str(args.check_layers).split(",") if c.strip())
    except ValueError:
        raise InvalidRequestError(f"--check-layers wants comma-separated integers, got {args.check_layers!r}")
    auto = str(args.ratio) == "auto"
    try:
        ratio = FusionOptions.ratio if auto else float(args.ratio)
    except ValueError:
        raise InvalidRequestError(f"--ratio wants a number in [0, 1] or 'auto', got {args.ratio!r}")
    return FusionOptions(mode=mode or getattr(args, "mode", None) or "full", ratio=ratio, auto_ratio=auto,
                         check_layers=checks, deviation=args.deviation, gradual=args.gradual,
                         sink_tokens=args.sink_tokens, check_rows=args.check_rows,
                         select_per_block=args.select_per_block, ape_temperature=args.ape_temperature,
                         ape_scale=args.ape_scale)


def make_store(spec: str | None):
    from ragkv.store.spec import open_store

    return open_store(spec or default_store_spec(), write_back=True)  # requests never wait for slow tiers


def engine_from_args(args, store=None):
    from ragkv.engine.engine import Engine

    if store is None and hasattr(args, "store"):
        store = make_store(args.store)
    return Engine.load(args.model, dtype=args.dtype, device=args.device, store=store,
                       namespace=getattr(args, "namespace", DEFAULT_NAMESPACE),
                       decode_weights=getattr(args, "decode_weights", "exact"))


def ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise InvalidRequestError(f"{flag} wants comma-separated integers, got {text!r}") from None


def floats(text: str, flag: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise InvalidRequestError(f"{flag} wants comma-separated numbers, got {text!r}") from None


def say(msg: str) -> None:
    """Progress and notes go to stderr, so that stdout stays the result (JSON or a table)."""
    print(msg, file=sys.stderr, flush=True)


def print_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=2, ensure_ascii=False)
    sys.stdout.write("\n")
