"""Issue 28, session 22: every prefill forward on the exact oneDNN copy (each linear choosing its kernel by rows)
against the model's MKL linears, alternated in one process: `full`, a block's encoding (a cold `reuse`: every
passage encoded, then the question), CacheBlend's deviation recompute and the query-aware selection (warm).

    .venv/bin/python docs/results/serve_vllm/ab_modes_s22.py [rounds] [passages]
"""
import json
import statistics
import sys
import time

import torch

from ragkv.bench.common import real_passages
from ragkv.config import machine
from ragkv.engine.engine import Engine
from ragkv.engine.options import FusionOptions

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
n_pass = int(sys.argv[2]) if len(sys.argv) > 2 else 4
engines = {w: Engine.load("qwen2.5-coder-0.5b", dtype="float32", decode_weights=w) for w in ("exact", "onednn")}
passages, questions = real_passages(4 * n_pass * (rounds + 1))
cases = {"full": FusionOptions(mode="full"), "encode+reuse (cold)": FusionOptions(mode="reuse"),
         "blend r=0.15 (deviation)": FusionOptions(mode="blend", ratio=0.15),
         "blend r=0.15 (query)": FusionOptions(mode="blend", select="query", ratio=0.15)}
segs0 = engines["exact"].segments(questions[0], passages[:n_pass])
print(machine(), f"threads={torch.get_num_threads()}", f"prompt tokens {segs0.num_tokens}, query {len(segs0.query)}")
ms = {(w, c): [] for w in engines for c in cases}
for r in range(rounds + 1):  # round 0 warms each path
    for c, fusion in cases.items():
        for w, eng in engines.items():
            # a cold reuse needs passages no engine has seen: each round and engine its own, the same count
            first = (4 * r + (w == "onednn")) * n_pass if c.startswith("encode") else 0
            segs = eng.segments(questions[r % len(questions)], passages[first:first + n_pass])
            if not c.startswith("encode"):
                eng.prefill(segs, fusion)[0].release()  # blocks cached: the timed run is the mode's own work
            t0 = time.perf_counter()
            state, _ = eng.prefill(segs, fusion)
            if r:
                ms[(w, c)].append((time.perf_counter() - t0) * 1000)
            state.release()
rows = {}
for c in cases:
    e, o = statistics.median(ms[("exact", c)]), statistics.median(ms[("onednn", c)])
    rows[c] = {"exact_ms": round(e, 1), "onednn_ms": round(o, 1), "ratio": round(o / e, 3)}
    print(f"{c:26s} exact {e:8.1f} ms   onednn {o:8.1f} ms   onednn/exact {o / e:.2f}x")
print(json.dumps({"machine": machine(), "prompt_tokens": segs0.num_tokens, "rounds": rounds, "cases": rows}))
