"""`ragkv bench ttft|engine`; the store and serve subsystems register `bench store` and `bench serve`."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from ragkv.commands.common import add_model_args, engine_from_args, print_json
from ragkv.engine.options import MODES


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: ttft, engine (vs transformers), store, serve")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH")

    t = bsub.add_parser("ttft", help="TTFT and FLOPs to first token per mode and context length")
    t.add_argument("--contexts", default="512,1024,2048,4096,8192")
    t.add_argument("--modes", default=",".join(MODES))
    t.add_argument("--query-tokens", type=int, default=50)
    t.add_argument("--repeats", type=int, default=3)
    t.add_argument("--ratio", type=float, default=0.15, help="blend recompute ratio")
    t.add_argument("--output-dir", default="bench_out")
    t.add_argument("--json", action="store_true")
    add_model_args(t)
    t.set_defaults(func=run_ttft, dtype="float32")

    e = bsub.add_parser("engine", help="our full prefill vs transformers' forward on the same tokens")
    e.add_argument("--lengths", default="512,1024,2048,4096")
    e.add_argument("--dtypes", default="float32,bfloat16")
    e.add_argument("--repeats", type=int, default=3)
    e.add_argument("--model", default="smollm2")
    e.add_argument("--output-dir", default="bench_out")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=run_engine)

    for name in ("ragkv.store.bench", "ragkv.serve.bench"):  # those subsystems own their benchmarks
        importlib.import_module(name).register(bsub)
    p.set_defaults(func=lambda args: p.print_help() or 2)


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_ttft(args) -> int:
    from ragkv.bench.ttft import run_ttft_bench
    from ragkv.errors import RagkvError

    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise RagkvError(f"unknown mode(s) {bad}; choose from {', '.join(MODES)}")
    if "full" in modes:
        modes = ["full"] + [m for m in modes if m != "full"]
    engine = engine_from_args(args)
    result = run_ttft_bench(engine, _ints(args.contexts), modes, args.query_tokens, args.repeats, args.ratio,
                            Path(args.output_dir), _progress)
    if args.json:
        print_json(result)
    else:
        print((Path(args.output_dir) / "ttft.md").read_text())
    return 0


def run_engine(args) -> int:
    from ragkv.bench.engine_vs_hf import run_engine_bench

    result = run_engine_bench(args.model, _ints(args.lengths), args.dtypes.split(","), args.repeats,
                              Path(args.output_dir), _progress)
    if args.json:
        print_json(result)
    else:
        print((Path(args.output_dir) / "engine_vs_hf.md").read_text())
    return 0
