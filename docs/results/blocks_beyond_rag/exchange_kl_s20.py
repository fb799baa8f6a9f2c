# Session 20 experiment; runs on branch exchange-blocks-s20 only (it needs request.exchange_starts and settle's reply).
# first-token KL of the compacted turn 20 under block groupings
import sys
import torch
import ragkv.engine.request as rq
from ragkv.engine.engine import Engine
from ragkv.bench.chat import ChatBenchConfig, conversation, notes, acknowledgement
from ragkv.eval.modes import parse_mode_key
from ragkv.engine.options import FusionOptions
from ragkv.engine.stepwise import drain
from ragkv.store.memory import MemoryStore
from ragkv.ops.divergence import first_token_kl
eng0 = Engine.load("smollm2", dtype="float32")
cfg = ChatBenchConfig(turns=20, edit_at=20)
texts = notes(20, 80)
scen = sys.argv[1] if len(sys.argv) > 1 else "compacted"
orig = rq.exchange_starts
def run(name, per_message, last_reply, paths):
    rq.exchange_starts = (lambda roles: list(range(len(roles)))) if per_message else orig
    engs = {p: eng0.with_store(MemoryStore()) for p in paths}
    for t in range(1, 20):
        segs = eng0.history_segments(conversation(cfg, scen, t, texts), cfg.system)
        for p, eng in engs.items():
            f = parse_mode_key(p)
            eng.prefill(segs, f)
            with eng.lock:
                drain(eng.settle_history_steps(segs, prefix_chunk=f.prefix_chunk,
                      reply=acknowledgement(t) if (t < 19 or last_reply) else None))
    segs = eng0.history_segments(conversation(cfg, scen, 20, texts), cfg.system)
    full = eng0.prefill(segs, FusionOptions(mode="full"))[0].logits.float()
    for p, eng in engs.items():
        st, stats = eng.prefill(segs, parse_mode_key(p))
        print(f"{name:28s} {p:28s} kl {first_token_kl(full, st.logits.float()):.4f} ttft {stats.ttft_ms:.0f} hist {stats.extra['history']['exact_turns']}/{stats.extra['history']['fused_turns']} recomputed {stats.recomputed_tokens}", flush=True)
paths = ["blend:sel=sinks,sink=8", "reuse", "blend:sel=query,r=0.15", "blend:sel=sinks,sink=16"]
run("exchange", False, True, paths)
run("exchange-lastexact", False, False, paths)
run("per-message", True, True, paths)
