"""Issue 28, session 23: `--decode-weights onednn` on the model's own weights (q/k/v and gate/up moved into one
buffer each, which the parameters view: no copy) against session 22's copy of
every linear reordered into oneDNN's blocked layout: a 1.5K-token `full` prefill in 512-row forwards and decode
steps at batch 1, 4 and 16, alternated in one process; logits compared bitwise.

    .venv/bin/python docs/results/serve_vllm/ab_zero_copy_s23.py [rounds]
"""
import statistics
import sys
import time

import torch

from ragkv.bench.common import real_passages
from ragkv.config import machine
from ragkv.engine.engine import Engine
from ragkv.engine.fusion import prefill_chunks
from ragkv.engine.kvcache import KVCache
from ragkv.engine.options import FusionOptions
from ragkv.engine.state import decode_batch
from ragkv.engine.stepwise import drain
from ragkv.models import quant


class PackedOneDnn(quant.OneDnnLinear):
    """Session 22's path: a copy of W (fused linears joined) reordered for oneDNN with a batch-size hint of 1."""

    def __init__(self, linear):
        super().__init__(linear)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(self.weight, 1)


rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
eng = Engine.load("qwen2.5-coder-0.5b", dtype="float32", decode_weights="onednn")
own = eng.decode_model
quant.OneDnnLinear, plain = PackedOneDnn, quant.OneDnnLinear
packed = quant.decode_copy(eng.model, "onednn")
quant.OneDnnLinear = plain
models = {"packed copy (s22)": packed, "joined in place (s23)": own}
passages, questions = real_passages(12)
ids = eng.segments(questions[0], passages[:8]).all_ids()[:1500]
states = [eng.prefill(eng.segments(q, passages[:4]), FusionOptions(mode="reuse"), 4 * (rounds + 1) * 3 + 8)[0]
          for q in (questions * 2)[:16]]
print(machine(), f"threads={torch.get_num_threads()}",
      f"prefill tokens {len(ids)}, decode keys ~{states[0].next_position}")
ms = {}
logits = {}
for r in range(rounds + 1):
    for name, model in models.items():
        cache = KVCache.for_model(eng.model, len(ids) + 1)
        t0 = time.perf_counter()
        logits[name] = drain(prefill_chunks(model, cache, ids, quant.FEW_ROWS))
        t = (time.perf_counter() - t0) * 1000
        if r:
            ms.setdefault((name, "full 1.5K"), []).append(t)
        for b in (1, 4, 16):
            t0 = time.perf_counter()
            decode_batch(model, states[:b], [13] * b)
            if r:  # round 0 warms every shape
                ms.setdefault((name, f"step b={b}"), []).append((time.perf_counter() - t0) * 1000)
bitwise = torch.equal(*logits.values())
for work in ("full 1.5K", "step b=1", "step b=4", "step b=16"):
    a, b = (statistics.median(ms[n, work]) for n in models)
    print(f"{work:10s} packed copy {a:8.1f} ms  joined in place {b:8.1f} ms  ratio {b / a:.2f}x")
print("prefill logits bitwise equal:", bitwise)
