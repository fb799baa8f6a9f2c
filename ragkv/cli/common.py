"""Flags shared by the subcommands, and the one place where they become engine objects and configs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ragkv.engine.options import FusionOptions, fusion_option_specs, validate_fusion
from ragkv.errors import InvalidRequestError
from ragkv.settings import (DEFAULT_BLOCK_POOL_BYTES, DEFAULT_DTYPE, DEFAULT_MODEL, DEFAULT_NAMESPACE,
                            default_index_dir, default_store_spec)
from ragkv.store.spec import SYNTAX


MODEL_HELP = ("known name (see `ragkv models`), a local Hugging Face folder, or a .gguf file of a Llama, Mistral or "
              "Qwen2 model (converted once per file content into the models folder)")


def add_model_args(p: argparse.ArgumentParser, decode_weights: bool = True) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    g.add_argument("--dtype", default=DEFAULT_DTYPE, help="auto | float32 | bfloat16 (auto: bf16 where fast)")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    if decode_weights:
        from ragkv.models.quant import WEIGHT_CHOICES

        g.add_argument("--decode-weights", default="auto", choices=WEIGHT_CHOICES,
                       help="weights of the decode steps (prefill stays exact but with w8a8): auto (default) is onednn for an "
                            "fp32 model on a CPU and for a bf16 model on an AVX-512 BF16 or AMX CPU, else exact; "
                            "transposed is an exact copy of "
                            "the wide linears in the layout a CPU's batch-1 matmul reads faster (same answers, "
                            "their bytes again); onednn runs every linear through oneDNN's kernel on the model's own "
                            "weights (fp32 CPU; 1.3-2.4x faster matmuls at 1-46 rows on Zen 3, no copy; in bf16 a "
                            "packed copy for ragkv's decode kernel, 1.6x faster decode on Zen 4); with either, "
                            "every prefill forward runs on that path too, each linear choosing its kernel by rows; "
                            "int4/int8 are "
                            "weight-only quantized copies, 2-4x faster decode on CPU, with the fidelity cost "
                            "`ragkv bench decode` prints; w8a8 also runs prefill on int8 products (int8 weights "
                            "and per-row int8 activations through oneDNN's VNNI / AMX-INT8 kernel; the MLP's "
                            "down projection stays exact): faster prefill, approximate, said in every reply")


def add_store_args(p: argparse.ArgumentParser, namespace: bool = True) -> None:
    g = p.add_argument_group("KV store")
    g.add_argument("--store", default=default_store_spec(), metavar="SPEC",
                   help=f"tiers, fastest first (default: {default_store_spec()}, the same for every command and "
                        f"the server); {SYNTAX}")
    if namespace:
        g.add_argument("--namespace", default=DEFAULT_NAMESPACE, help="tenant namespace of cached blocks")
    g.add_argument("--block-pool", type=size_arg, default=DEFAULT_BLOCK_POOL_BYTES, metavar="SIZE",
                   help="device memory for blocks read in place by kv_layout=shared requests, least recently used "
                        f"out (default {DEFAULT_BLOCK_POOL_BYTES >> 20}MiB; a block in use outlives its eviction)")


def size_arg(text: str) -> int:
    """A size flag's value (4GiB, 512MiB, bytes), argparse's error naming the flag when it is not one."""
    from ragkv.store.sizes import parse_size

    try:
        return parse_size(text)
    except Exception as e:  # noqa: BLE001 - argparse reports it as a bad value of the flag
        raise argparse.ArgumentTypeError(str(e)) from None


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


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_fusion_args(p: argparse.ArgumentParser, default_mode: str | None = "reuse", title: str = "fusion",
                    mode_key: bool = False) -> None:
    """The fusion mode (unless `default_mode` is None) and every other field of FusionOptions, each flag derived
    from the field's declaration (ragkv/engine/options.py), for ask, eval, serve and the benchmarks alike.
    `mode_key`: --mode takes a mode key too (`blend:sel=query,r=0.15`: the mode and its own parameters)."""
    g = p.add_argument_group(title)
    for spec in fusion_option_specs():
        if spec.name == "mode":
            if default_mode is not None and mode_key:
                g.add_argument("--mode", default=default_mode, metavar="MODE[:K=V,...]",
                               help=f"{spec.help}: one of {', '.join(spec.choices)}, or a mode key with its own "
                                    f"parameters, which win over the flags below (default: {default_mode})")
            elif default_mode is not None:
                g.add_argument("--mode", default=default_mode, choices=spec.choices, help=spec.help)
            continue
        shown = ",".join(map(str, spec.default)) if spec.type is tuple else spec.default
        help_ = spec.help + (f" (default: {shown})" if spec.default is not None and spec.default is not False else "")
        if spec.type is bool:
            g.add_argument(_flag(spec.name), action="store_true", help=help_)
        elif spec.type is tuple or spec.word:  # parsed and checked by fusion_from_args, naming the flag
            extra = f"; or '{spec.word[0]}' ({spec.word[1]})" if spec.word else ""
            g.add_argument(_flag(spec.name), default=str(shown), help=help_ + extra +
                           ("; comma-separated" if spec.type is tuple else ""))
        else:
            g.add_argument(_flag(spec.name), type=spec.type, default=spec.default, choices=spec.choices,
                           help=help_)


def fusion_from_args(args, mode: str | None = None, key_params: bool = True) -> FusionOptions:
    """FusionOptions from the flags `add_fusion_args` declared; FusionOptions checks every value. A mode key
    (`blend:sel=query,r=0.15`) sets its own parameters over the flags' (`key_params=False`: its mode only)."""
    key = mode or getattr(args, "mode", None) or "full"
    base = validate_fusion(_flags_fusion(args, key.partition(":")[0]))
    if key_params and ":" in key:
        from ragkv.eval.modes import parse_mode_key
        return parse_mode_key(key, base)
    return base


def _flags_fusion(args, mode: str) -> FusionOptions:
    values = {"mode": mode}
    for spec in fusion_option_specs()[1:]:
        raw = getattr(args, spec.name)
        if spec.word and str(raw) == spec.word[0]:
            values[spec.word[1]] = True
            continue
        if spec.type is tuple:
            values[spec.name] = ints(str(raw), _flag(spec.name))
        elif spec.word:
            try:
                values[spec.name] = spec.type(raw)
            except ValueError:
                raise InvalidRequestError(f"{_flag(spec.name)} wants a number or '{spec.word[0]}', got {raw!r}") \
                    from None
        elif spec.type is bool:
            values[spec.name] = values.get(spec.name, False) or bool(raw)
        else:
            values[spec.name] = raw
    return FusionOptions(**values)


def make_store(spec: str | None, must_reach: bool = True):
    """The --store; `must_reach=False` (the server) starts with an unreachable tier down instead of refusing."""
    from ragkv.store.spec import open_store

    # write-back: requests never wait for slow tiers
    return open_store(spec or default_store_spec(), write_back=True, must_reach=must_reach)


def engine_from_args(args, store=None, must_reach: bool = True):
    from ragkv.engine.engine import Engine

    if store is None and hasattr(args, "store"):
        store = make_store(args.store, must_reach)
    return Engine.load(args.model, dtype=args.dtype, device=args.device, store=store,
                       namespace=getattr(args, "namespace", DEFAULT_NAMESPACE),
                       decode_weights=getattr(args, "decode_weights", "exact"),
                       pool_bytes=getattr(args, "block_pool", DEFAULT_BLOCK_POOL_BYTES))


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


def add_output_args(p) -> None:
    """A benchmark's output flags."""
    p.add_argument("--output-dir", default="bench_out", help="where the JSON, markdown and PNG go")
    p.add_argument("--json", action="store_true", help="print the result as JSON (default: the markdown table)")


def finish_bench(args, result: dict, markdown: str) -> int:
    """Print a benchmark's result: its JSON with --json, else the markdown it wrote."""
    if args.json:
        print_json(result)
    else:
        print((Path(args.output_dir) / markdown).read_text())
    return 0


def mode_list(text: str) -> tuple[str, ...]:
    """A comma-separated list of mode keys (empty items dropped)."""
    return tuple(m for m in text.split(",") if m)
