"""`ragkv bench invariance`: do greedy answers depend on what is decoded beside them, and what does it cost to
make sure they do not (`serve --batch-invariant`: every decode forward at a fixed row count)?

Real MuSiQue requests (passages drawn from a small common set) are prefilled with one mode, then decoded greedily
twice per row policy: each request alone, and all of them in one batch. An answer "repeats" when its tokens in
the batch equal its tokens alone. Timed beside it: the median decode step alone (batch 1) and in the batch, so
the price of the fixed row count shows as a ratio against free row counts measured in the same run.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from ragkv.bench.common import greedy_steps, markdown_table, real_passages, save_json
from ragkv.engine.options import FusionOptions


@dataclass(frozen=True)
class InvarianceBenchConfig:
    requests: int = 8       # decoded together (the batch size)
    tokens: int = 32        # greedy tokens per request
    passages: int = 4       # blocks per request
    distinct: int = 12      # passages the requests draw from
    rows: int = 16          # the fixed row count (serve's --max-batch)
    fusion: FusionOptions = FusionOptions(mode="reuse")
    seed: int = 0


def _decode(engine, states, n: int, rows: int | None) -> tuple[list[list[int]], list[float]]:
    """Greedy decode of `states` together for n tokens, then their KV released."""
    tokens, times = greedy_steps(engine.decode_model, states, n, rows)
    for s in states:
        s.release()
    return tokens, times


def run_invariance_bench(engine, cfg: InvarianceBenchConfig, out_dir: Path, progress=print) -> dict:
    passages, questions = real_passages(cfg.distinct)
    rng = random.Random(cfg.seed)
    reqs = [engine.segments(questions[i % len(questions)], rng.sample(passages[:cfg.distinct], cfg.passages))
            for i in range(cfg.requests)]
    for segs in reqs:  # every block stored before decoding: the prefills below only read
        engine.prefill(segs, cfg.fusion)
    results = []
    for rows in (None, cfg.rows):
        alone, alone_ms = [], []
        for segs in reqs:
            out, ms = _decode(engine, [engine.prefill(segs, cfg.fusion, cfg.tokens)[0]], cfg.tokens, rows)
            alone.append(out[0])
            alone_ms += ms
        together, batch_ms = _decode(engine, [engine.prefill(s, cfg.fusion, cfg.tokens)[0] for s in reqs],
                                     cfg.tokens, rows)
        repeated = sum(a == b for a, b in zip(alone, together))
        row = {"rows": rows, "answers_repeated": repeated, "answers": len(reqs),
               "step_ms_batch_1": statistics.median(alone_ms),
               f"step_ms_batch_{len(reqs)}": statistics.median(batch_ms)}
        progress(f"  rows={rows or 'free'}: {repeated}/{len(reqs)} answers repeat; step ms alone "
                 f"{row['step_ms_batch_1']:.1f}, batch of {len(reqs)} {row[f'step_ms_batch_{len(reqs)}']:.1f}")
        results.append(row)
    free, fixed = results
    key = f"step_ms_batch_{len(reqs)}"
    result = {"model": engine.model_name, "dtype": engine.dtype_name, "device": str(engine.device),
              "decode_weights": engine.info()["decode_weights"], "threads": torch.get_num_threads(),
              "config": {**cfg.__dict__, "fusion": cfg.fusion.mode},
              "context_tokens": statistics.median(s.num_tokens for s in reqs), "results": results,
              "fixed_vs_free_batch_1": fixed["step_ms_batch_1"] / free["step_ms_batch_1"],
              f"fixed_vs_free_batch_{len(reqs)}": fixed[key] / free[key]}
    save_json(out_dir / "invariance.json", result)
    table = markdown_table(
        ["row count", "greedy answers equal to alone", "decode step ms, alone (vs free)",
         f"decode step ms, batch {len(reqs)} (vs free)"],
        [[f"fixed at {r['rows']}" if r["rows"] else "free (as batched)", f"{r['answers_repeated']}/{r['answers']}",
          f"{r['step_ms_batch_1']:.1f} ({r['step_ms_batch_1'] / free['step_ms_batch_1']:.2f}x)",
          f"{r[key]:.1f} ({r[key] / free[key]:.2f}x)"] for r in results])
    (out_dir / "invariance.md").write_text(
        f"Batch invariance on {result['model']} ({result['dtype']}, decode weights {result['decode_weights']}, "
        f"{result['device']}, {result['threads']} threads): {len(reqs)} `{cfg.fusion.mode}` requests of "
        f"{cfg.passages} MuSiQue passages (median {result['context_tokens']} tokens), {cfg.tokens} greedy tokens.\n\n"
        f"{table}\n")
    return result
