"""`ragkv bench ttft|engine|decode`; the store and serve subsystems register `bench store` and `bench serve`."""

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

    d = bsub.add_parser("decode", help="decode tokens/s (single and batched), its profile and fidelity cost")
    d.add_argument("--model", default="smollm2")
    d.add_argument("--configs", default="float32:exact,bfloat16:exact,float32:int8,float32:int4,bfloat16:int4",
                   help="comma-separated dtype:decode-weights pairs")
    d.add_argument("--batch-sizes", default="1,4,16")
    d.add_argument("--steps", type=int, default=32)
    d.add_argument("--rounds", type=int, default=3)
    d.add_argument("--fidelity-examples", type=int, default=8)
    d.add_argument("--output-dir", default="bench_out")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=run_decode)

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


def run_decode(args) -> int:
    from ragkv.bench.decode import DecodeBenchConfig, run_decode_bench
    from ragkv.errors import RagkvError

    try:
        configs = tuple(tuple(c.split(":")) for c in args.configs.split(",") if c)
        assert configs and all(len(c) == 2 for c in configs)
    except AssertionError:
        raise RagkvError(f"--configs wants dtype:weights pairs like float32:int4, got {args.configs!r}")
    cfg = DecodeBenchConfig(model=args.model, configs=configs, batch_sizes=tuple(_ints(args.batch_sizes)),
                            steps=args.steps, rounds=args.rounds, fidelity_examples=args.fidelity_examples)
    result = run_decode_bench(cfg, Path(args.output_dir), _progress)
    if args.json:
        print_json(result)
    else:
        print((Path(args.output_dir) / "decode.md").read_text())
    return 0
