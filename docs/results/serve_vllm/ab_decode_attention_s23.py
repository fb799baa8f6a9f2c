"""Issue 28, session 23: a decode step's attention through SDPA with `enable_gqa` (before) against torch's flash
kernel with the GQA group folded into the rows (after), and with no attention at all (the floor), in one process,
alternated. Qwen 0.5B fp32 on the oneDNN copy, 16 `reuse` sequences of 4 MuSiQue passages each.

    .venv/bin/python docs/results/serve_vllm/ab_decode_attention_s23.py [rounds]
"""
import statistics
import sys
import time

import torch

import ragkv.ops.attention as attention
from ragkv.bench.common import real_passages
from ragkv.config import machine
from ragkv.engine.engine import Engine
from ragkv.engine.options import FusionOptions
from ragkv.engine.state import decode_batch

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
eng = Engine.load("qwen2.5-coder-0.5b", dtype="float32", decode_weights="onednn")
passages, questions = real_passages(12)
states = [eng.prefill(eng.segments(q, passages[:4]), FusionOptions(mode="reuse"), 4 * rounds * 3 + 8)[0]
          for q in (questions * 2)[:16]]
paths = {"sdpa enable_gqa": lambda q, k, v: attention.sdpa(q, k, v),
         "folded flash": attention._torch_decode_attention,
         "no attention": lambda q, k, v: torch.zeros_like(q)}
print(machine(), f"threads={torch.get_num_threads()}", f"keys {states[0].next_position}")
ms = {(p, b): [] for p in paths for b in (1, 4, 16)}
for r in range(rounds + 1):
    for name, fn in paths.items():
        attention._torch_decode_attention = fn
        for b in (1, 4, 16):
            t0 = time.perf_counter()
            decode_batch(eng.decode_model, states[:b], [13] * b)
            if r:  # round 0 warms every shape
                ms[name, b].append((time.perf_counter() - t0) * 1000)
for b in (1, 4, 16):
    base = statistics.median(ms["sdpa enable_gqa", b])
    cells = [f"{p} {statistics.median(ms[p, b]):7.1f} ms ({statistics.median(ms[p, b]) / base:.2f}x)" for p in paths]
    print(f"batch {b:2d}: " + "  ".join(cells))
