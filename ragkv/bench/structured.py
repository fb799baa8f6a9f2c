"""`ragkv bench structured`: what constrained decoding (response_format json_schema, engine/decode/constrained.py) costs the
decode: tokens/s of the same batched decode with and without a grammar, at each batch size, measured back to back
in one process (the target: the mask costs <= 10% at batch 1 and 16).

Both runs decode exactly `tokens` tokens per sequence from the same prompt: free text with min_tokens = tokens, and
JSON following a schema whose shortest valid answer is longer than that (an array of `tokens` integers), so no
sequence ends early. Only the decode steps are timed (the prefill is not); repeated, the best run is kept."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ragkv.bench.common import save_json
from ragkv.engine.decode.constrained import json_grammar
from ragkv.engine.options import FusionOptions, GenerationOptions


@dataclass(frozen=True)
class StructuredBenchConfig:
    batch_sizes: tuple[int, ...] = (1, 16)
    tokens: int = 48
    repeats: int = 3


def _decode_rate(engine, segs, gen: GenerationOptions, batch: int) -> tuple[float, int]:
    seqs = [engine.start(segs, FusionOptions(mode="prefix"), gen) for _ in range(batch)]
    for s in seqs:
        s.advance()
    t0, tokens = time.perf_counter(), 0
    while any(not s.finished for s in seqs):
        engine.step(seqs)
        for s in seqs:
            if not s.finished:
                s.advance()
    elapsed = time.perf_counter() - t0
    tokens = sum(len(s.out.token_ids) for s in seqs)
    return tokens / elapsed, tokens


def run_structured_bench(engine, cfg: StructuredBenchConfig, out_dir: Path, say=print) -> dict:
    schema = {"type": "array", "minItems": cfg.tokens, "maxItems": cfg.tokens,
              "items": {"type": "integer", "minimum": 0, "maximum": 9}}
    segs = engine.chat_segments("Write a list of small numbers as a JSON array.")
    free = GenerationOptions(max_new_tokens=cfg.tokens, min_tokens=cfg.tokens)
    constrained = GenerationOptions(max_new_tokens=cfg.tokens, grammar=json_grammar(schema))
    rows = []
    for batch in cfg.batch_sizes:
        best = {"free": 0.0, "json": 0.0}
        for _ in range(cfg.repeats):  # interleaved: drift hits both alike
            for name, gen in (("free", free), ("json", constrained)):
                rate, _ = _decode_rate(engine, segs, gen, batch)
                best[name] = max(best[name], rate)
        overhead = 1 - best["json"] / best["free"]
        rows.append({"batch": batch, "free_tok_s": round(best["free"], 2), "json_tok_s": round(best["json"], 2),
                     "mask_overhead": round(overhead, 4)})
        say(f"[structured] batch {batch}: free {best['free']:.1f} tok/s, json {best['json']:.1f} tok/s, "
            f"overhead {overhead:.1%}")
    result = {"config": asdict(cfg), "model": engine.model_name, "rows": rows}
    save_json(out_dir / "structured.json", result)
    (out_dir / "structured.md").write_text(
        "| batch | free text tok/s | JSON schema tok/s | mask overhead |\n|---|---|---|---|\n" +
        "".join(f"| {r['batch']} | {r['free_tok_s']} | {r['json_tok_s']} | {r['mask_overhead']:.1%} |\n"
                for r in rows))
    return result
