"""`ragkv bench shared`: `reuse` (or `ape`, `blend`: --mode) with each request's own re-rotated copy of its blocks
(kv_layout=copied) against the blocks read in place from the pool (kv_layout=shared), on real MuSiQue passages.

Requests draw `passages` blocks each from a small common set, so sequences hold the same blocks at different
offsets, as a server's do. Every block is in the store (and, for `shared`, in the pool) before timing: what is
measured is what a request pays when its passages were seen before. Per layout: TTFT (prefill to the first token's
logits, median over the requests), and the time of one batched decode step at each batch size (median of
`steps`). Both layouts' greedy tokens are compared, so a speed figure never hides a different answer.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ragkv.bench.common import greedy_steps, markdown_table, real_passages, save_json, sync_device
from ragkv.engine.options import FusionOptions

LAYOUTS = ("copied", "shared")


@dataclass(frozen=True)
class SharedBenchConfig:
    passages: int = 4          # blocks per request
    distinct: int = 12         # passages the requests draw from
    requests: int = 8          # TTFT samples per layout
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    steps: int = 16            # decode steps timed per batch size
    seed: int = 0
    mode: str = "reuse"        # reuse, ape or blend (blend: prefilled as a copy either way; decode differs)


def _requests(engine, cfg: SharedBenchConfig, n: int):
    passages, questions = real_passages(cfg.distinct)
    rng = random.Random(cfg.seed)
    return [engine.segments(questions[i % len(questions)], rng.sample(passages[:cfg.distinct], cfg.passages))
            for i in range(n)]


def _timed_prefill(engine, segs, fusion):
    sync_device()
    t0 = time.perf_counter()
    state, _ = engine.prefill(segs, fusion)
    sync_device()
    return state, (time.perf_counter() - t0) * 1000


def run_shared_bench(engine, cfg: SharedBenchConfig, out_dir: Path, progress=print) -> dict:
    largest = max(cfg.batch_sizes)
    reqs = _requests(engine, cfg, max(cfg.requests, largest))
    rows, answers = [], {}
    for layout in LAYOUTS:
        fusion = FusionOptions(mode=cfg.mode, kv_layout=layout)
        for segs in reqs:  # every block stored (and pooled) before timing
            engine.prefill(segs, fusion)
        ttft = [_timed_prefill(engine, s, fusion)[1] for s in reqs[:cfg.requests]]
        row = {"layout": layout, "ttft_ms": statistics.median(ttft), "ttft_runs_ms": ttft, "step_ms": {}}
        for b in cfg.batch_sizes:
            states = [engine.prefill(s, fusion)[0] for s in reqs[:b]]
            answers[(layout, b)], times = greedy_steps(engine.decode_model, states, cfg.steps)
            row["step_ms"][b] = statistics.median(times)
            for s in states:
                s.release()
        progress(f"  {layout:7s} TTFT {row['ttft_ms']:8.1f} ms   step ms " +
                 "  ".join(f"b{b}: {ms:.1f}" for b, ms in row["step_ms"].items()))
        rows.append(row)
    copied, shared = rows
    agree = {b: answers[("copied", b)] == answers[("shared", b)] for b in cfg.batch_sizes}
    result = {"model": engine.model_name, "dtype": engine.dtype_name, "device": str(engine.device),
              "threads": torch.get_num_threads(), "config": {**cfg.__dict__, "batch_sizes": list(cfg.batch_sizes)},
              "context_tokens": statistics.median(s.num_tokens for s in reqs), "rows": rows,
              "ttft_shared_vs_copied": shared["ttft_ms"] / copied["ttft_ms"],
              "step_shared_vs_copied": {b: shared["step_ms"][b] / copied["step_ms"][b] for b in cfg.batch_sizes},
              "greedy_tokens_equal": agree, "pool": engine.block_pool.stats()}
    save_json(out_dir / "shared.json", result)
    table = markdown_table(
        ["layout", "TTFT ms (vs copied)"] + [f"decode step ms, batch {b} (vs copied)" for b in cfg.batch_sizes],
        [[r["layout"], f"{r['ttft_ms']:.1f} ({r['ttft_ms'] / copied['ttft_ms']:.2f}x)"]
         + [f"{r['step_ms'][b]:.1f} ({r['step_ms'][b] / copied['step_ms'][b]:.2f}x)" for b in cfg.batch_sizes]
         for r in rows])
    (out_dir / "shared.md").write_text(
        f"`{cfg.mode}`, blocks copied vs read in place, on {result['model']} ({result['dtype']}, {result['device']}, "
        f"{result['threads']} threads); {cfg.passages} MuSiQue passages per request from {cfg.distinct}, median "
        f"context {result['context_tokens']} tokens; greedy tokens equal per batch size: {agree}.\n\n{table}\n")
    return result
