"""Issue 28, session 21: a `reuse` question prefill (46 rows over 2.4K cached tokens) and batched decode steps,
exact MKL linears against the oneDNN copy (`--decode-weights onednn`), alternated in one process so that the
machine's drift hits both alike.

    .venv/bin/python docs/results/serve_vllm/ab_prefill_s21.py [rounds]
"""
import statistics
import sys
import time

import torch

from ragkv.bench.common import real_passages
from ragkv.config import machine
from ragkv.engine.engine import Engine
from ragkv.engine.options import FusionOptions
from ragkv.engine.state import decode_batch

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 8
engines = {w: Engine.load("qwen2.5-coder-0.5b", dtype="float32", decode_weights=w) for w in ("exact", "onednn")}
passages, questions = real_passages(12)
segs = [engines["exact"].segments(questions[i], passages[i % 8:i % 8 + 4]) for i in range(16)]
fusion = FusionOptions(mode="reuse")
print(machine(), f"threads={torch.get_num_threads()}", f"query rows {len(segs[0].query)}, "
      f"context {segs[0].num_tokens - len(segs[0].query)}")
for eng in engines.values():
    for s in segs:
        eng.prefill(s, fusion)[0].release()
ttft = {w: [] for w in engines}
step = {(w, b): [] for w in engines for b in (1, 4, 16)}
for r in range(rounds):
    for w, eng in engines.items():
        t0 = time.perf_counter()
        state, _ = eng.prefill(segs[r % len(segs)], fusion)
        ttft[w].append((time.perf_counter() - t0) * 1000)
        state.release()
        for b in (1, 4, 16):
            states = [eng.prefill(s, fusion)[0] for s in segs[:b]]
            with torch.inference_mode():
                t0 = time.perf_counter()
                decode_batch(eng.decode_model, states, [17] * b)
                step[(w, b)].append((time.perf_counter() - t0) * 1000)
            for s in states:
                s.release()
for w in engines:
    print(f"{w:7s} reuse prefill ms median {statistics.median(ttft[w]):7.1f}   step ms " +
          "  ".join(f"b{b} {statistics.median(step[(w, b)]):6.1f}" for b in (1, 4, 16)))
e, o = "exact", "onednn"
print("onednn / exact: prefill %.2f, step b1 %.2f, b4 %.2f, b16 %.2f" % (
    statistics.median(ttft[o]) / statistics.median(ttft[e]),
    *[statistics.median(step[(o, b)]) / statistics.median(step[(e, b)]) for b in (1, 4, 16)]))
