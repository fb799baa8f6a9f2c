"""Issue 28, session 21: where a `reuse` prefill's time goes (the output-rate ceiling), on the serve bench's
workload (4 MuSiQue passages of 210 words, one question). Every block is stored (and pooled) before timing.

    .venv/bin/python docs/results/serve_vllm/profile_reuse_s21.py [copied|shared] [repeats] [decode weights]
"""
import statistics
import sys
import time

import torch

from ragkv.bench.common import real_passages
from ragkv.engine.engine import Engine
from ragkv.engine.options import FusionOptions
from ragkv.config import machine

layout = sys.argv[1] if len(sys.argv) > 1 else "copied"
repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 5
weights = sys.argv[3] if len(sys.argv) > 3 else "exact"
eng = Engine.load("qwen2.5-coder-0.5b", dtype="float32", decode_weights=weights)
passages, questions = real_passages(12)
segs = eng.segments(questions[0], passages[:4])
fusion = FusionOptions(mode="reuse", kv_layout=layout)
print(machine(), f"threads={torch.get_num_threads()}", f"layout={layout}", f"decode_weights={weights}")
print(f"tokens: prefix {len(segs.prefix)}, blocks {[len(b) for b in segs.blocks]}, query {len(segs.query)}")
eng.prefill(segs, fusion)
eng.prefill(segs, fusion)
runs = []
for _ in range(repeats):
    t0 = time.perf_counter()
    state, stats = eng.prefill(segs, fusion)
    runs.append(((time.perf_counter() - t0) * 1000, stats))
    state.release()
wall = statistics.median(ms for ms, _ in runs)
_, st = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
print(f"reuse prefill wall ms: median {wall:.1f}  runs {[round(ms) for ms, _ in runs]}")
print({k: round(v, 1) for k, v in st.to_dict().items() if k.endswith("_ms")})
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    state, _ = eng.prefill(segs, fusion)
state.release()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
