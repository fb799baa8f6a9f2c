"""Issue 28, session 23: how far is the exact prefill from this CPU's ceiling? A `full` prefill of Qwen 0.5B (fp32,
the oneDNN copy in 512-row forwards, as `--decode-weights auto` runs it) under torch's profiler: time and GFLOP/s of
the linears and of attention, against the machine's measured sgemm peak (a 4096^3 product); then a batched decode
step at batch 1, 4 and 16 over ~1.3K-token `reuse` prompts: its time, GFLOP/s and the bytes it reads per second.

    .venv/bin/python docs/results/serve_vllm/ceiling_s23.py [tokens] [out.json]
"""
import json
import sys
import time

import torch

from ragkv.bench.common import real_passages
from ragkv.config import machine
from ragkv.engine.engine import Engine
from ragkv.engine.fusion import prefill_chunks
from ragkv.engine.kvcache import KVCache
from ragkv.engine.stepwise import drain

tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 2400
out = sys.argv[2] if len(sys.argv) > 2 else None


def sgemm_peak(sizes=(2048, 3072, 4096), rounds=5) -> float:
    """The best GFLOP/s of square fp32 products (MKL): this machine's clock moves between runs, so several."""
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        best = max(best, 2 * n ** 3 / min(_timed(lambda: a @ b) for _ in range(rounds)) / 1e9)
    return best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


eng = Engine.load("qwen2.5-coder-0.5b", dtype="float32", decode_weights="auto")
a = eng.model.args
passages, questions = real_passages(12)
ids = eng.segments(questions[0], passages[:12]).all_ids()[:tokens]
T = len(ids)


def run():
    cache = KVCache.for_model(eng.model, T + 1)
    drain(prefill_chunks(eng.forward_model, cache, ids, 512))


run()
walls = [_timed(run) for _ in range(2)]
with torch.profiler.profile() as prof:
    run()
ops = {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}
linear_s = sum(v for k, v in ops.items() if "linear" in k or k in ("aten::addmm", "aten::mm"))
attn_s = sum(v for k, v in ops.items() if "attention" in k)
total_s = sum(ops.values())
# FLOPs: every layer's linears on T rows (the LM head on the last row only); attention causal over T keys
lin_params = sum(m.weight.numel() for n, m in eng.model.named_modules()
                 if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head"))
lin_flop = 2 * T * lin_params
attn_flop = a.num_layers * 2 * 2 * a.num_heads * a.head_dim * T * (T + 1) / 2
peak = max(sgemm_peak(), sgemm_peak())  # before and after a pause: the clock moves
res = {"machine": machine(), "threads": torch.get_num_threads(), "tokens": T, "decode_weights": eng.decode_weights,
       "wall_s": [round(w, 2) for w in walls], "profiled_self_s": round(total_s, 2),
       "linear_s": round(linear_s, 2), "linear_gflops": round(lin_flop / linear_s / 1e9, 1),
       "attention_s": round(attn_s, 2), "attention_gflops": round(attn_flop / attn_s / 1e9, 1),
       "other_s": round(total_s - linear_s - attn_s, 2), "sgemm_peak_gflops": round(peak, 1),
       "ceiling_s": round((lin_flop + attn_flop) / peak / 1e9, 2)}

# batched decode steps: 16 sequences of 4 passages and a question each (`reuse` over blocks encoded once)
from ragkv.engine.options import FusionOptions  # noqa: E402
from ragkv.engine.state import decode_batch  # noqa: E402

states = [eng.prefill(eng.segments(q, passages[:4]), FusionOptions(mode="reuse"), 40)[0]
          for q in (questions * 2)[:16]]
all_params = lin_params + eng.model.lm_head.weight.numel()
steps = {}
for b in (1, 4, 16, 1, 4, 16):  # twice: the first pass warms each shape
    ts = [_timed(lambda: decode_batch(eng.decode_model, states[:b], [13] * b)) for _ in range(2)]
    steps[b] = min(ts)
keys = states[0].next_position  # the prompts are about this long; attention is a small share here
res["decode_steps"] = {
    b: {"step_ms": round(t * 1000, 1),
        "gflops": round((b * 2 * all_params + b * a.num_layers * 4 * a.num_heads * a.head_dim * keys) / t / 1e9, 1),
        "weight_gb_per_s": round(all_params * 4 / t / 1e9, 1)} for b, t in steps.items()}
for b in (1, 16):  # where a step's time goes
    with torch.profiler.profile() as prof:
        decode_batch(eng.decode_model, states[:b], [13] * b)
    ops = {e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()}
    res["decode_steps"][b]["profile_ms"] = {
        "linears": round(sum(v for k, v in ops.items() if "linear" in k or k in ("aten::addmm", "aten::mm")), 1),
        "attention": round(sum(v for k, v in ops.items() if "attention" in k or k == "ragkv::decode_attention"), 1),
        "other": round(sum(v for k, v in ops.items() if not ("linear" in k or "attention" in k
                                                                or k in ("aten::addmm", "aten::mm"))), 1),
        "top": sorted(((k, round(v, 1)) for k, v in ops.items()), key=lambda kv: -kv[1])[:8]}
print(json.dumps(res, indent=1))
if out:
    open(out, "w").write(json.dumps(res, indent=1) + "\n")
