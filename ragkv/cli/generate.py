"""`ragkv generate` (a plain chat prompt) and `ragkv models`."""

from __future__ import annotations

import sys
import time

from ragkv.cli.common import add_model_args, engine_from_args, print_json
from ragkv.errors import RagkvError


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate a reply to a chat prompt on the default or given model")
    p.add_argument("--prompt", required=True)
    p.add_argument("--system", default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object with text and timings")
    add_model_args(p)
    p.set_defaults(func=run_generate)

    m = sub.add_parser("models", help="list known and converted models")
    m.add_argument("--prepare", nargs="?", const="smollm2", default=None, metavar="NAME_OR_GGUF",
                   help="convert a known model or a .gguf file now if needed (default: smollm2)")
    m.set_defaults(func=run_models)


def run_generate(args) -> int:
    from ragkv.engine.options import FusionOptions, GenerationOptions

    gen = GenerationOptions(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed, stop=tuple(args.stop))
    engine = engine_from_args(args)
    segs = engine.chat_segments(args.prompt, args.system)
    t0 = time.perf_counter()
    run = engine.stream(segs, FusionOptions(mode="full"), gen)
    if args.json:
        ans = run.answer()
        s = ans.stats
        print_json({"text": ans.text, "prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
                    "ttft_ms": round(s.ttft_ms, 2), "tokens_per_s": round(s.tokens_per_s, 2),
                    "total_ms": round((time.perf_counter() - t0) * 1000, 2), "finish_reason": ans.finish_reason,
                    "model": args.model, "dtype": engine.dtype_name, "device": str(engine.device)})
    else:
        for delta in run:
            sys.stdout.write(delta.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def run_models(args) -> int:
    from pathlib import Path

    from ragkv.config import models_dir
    from ragkv.models.gguf_files import CONVERTED_DIR, converted_gguf_models
    from ragkv.models.registry import KNOWN_MODELS, converted_path, is_converted, resolve_model_path

    if args.prepare:
        if args.prepare not in KNOWN_MODELS and not Path(args.prepare).expanduser().is_file():
            raise RagkvError(f"--prepare {args.prepare!r}: not a known model nor a .gguf file; choose from "
                             f"{', '.join(KNOWN_MODELS)} or pass a GGUF path")
        resolve_model_path(args.prepare)
    print(f"known models (converted into {models_dir()}):")
    for name, km in KNOWN_MODELS.items():
        state = "converted" if is_converted(converted_path(name)) else "not converted yet (first use converts)"
        print(f"  {name:20s} {km.description} [{state}]")
    converted = converted_gguf_models()
    if converted:
        print("GGUF files converted (--model FILE.gguf; the same content at any path reuses its folder):")
        for folder, note in converted:
            print(f"  {note.get('file_name', '?'):40s} {note.get('architecture', '?'):8s} {folder}")
    skip = {"gguf", CONVERTED_DIR, *KNOWN_MODELS}
    others = [p for p in models_dir().glob("*") if p.is_dir() and p.name not in skip and not p.name.startswith(".")] \
        if models_dir().exists() else []
    if others:
        print("other folders in the models directory:")
        for p in sorted(others):
            print(f"  {p}")
    print("any local Hugging Face folder or .gguf file of a Llama, Mistral or Qwen2 model also works: --model PATH")
    return 0
