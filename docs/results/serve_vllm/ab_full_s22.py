"""Issue 28, session 22: can the exact forward of many rows (`full`, block encoding) gain from oneDNN's packed fp32
kernel, which wins below ~500 rows on this CPU? A `full` prefill of one prompt in one MKL forward against the same
prompt in units of C rows, on the MKL model and on the oneDNN copy, alternated in one process.

    .venv/bin/python docs/results/serve_vllm/ab_full_s22.py [rounds] [tokens]
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
from ragkv.engine.stepwise import drain

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 1500
eng = Engine.load("qwen2.5-coder-0.5b", dtype="float32", decode_weights="onednn")
passages, questions = real_passages(12)
ids = eng.segments(questions[0], passages[:8]).all_ids()[:tokens]
print(machine(), f"threads={torch.get_num_threads()}", f"prompt tokens {len(ids)}")
cases = {"mkl whole": (eng.model, None), "mkl 512": (eng.model, 512), "onednn 512": (eng.decode_model, 512),
         "onednn 256": (eng.decode_model, 256), "onednn whole": (eng.decode_model, None)}
ref = None
times = {c: [] for c in cases}
for r in range(rounds + 1):
    for name, (model, chunk) in cases.items():
        cache = KVCache.for_model(eng.model, len(ids) + 1)
        t0 = time.perf_counter()
        logits = drain(prefill_chunks(model, cache, ids, chunk))
        ms = (time.perf_counter() - t0) * 1000
        if r:
            times[name].append(ms)   # round 0 warms every path
        ref = logits if ref is None else ref
        assert (logits - ref).abs().max().item() < 1e-3, name
for name in cases:
    print(f"{name:13s} ms median {statistics.median(times[name]):8.1f}  "
          f"vs mkl whole {statistics.median(times[name]) / statistics.median(times['mkl whole']):.2f}x")
