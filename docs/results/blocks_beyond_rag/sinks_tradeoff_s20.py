# Session 20 experiment: the first-token KL and TTFT of the edit turn (20) of `ragkv bench chat` for several sink
# counts, per-message blocks (main). Usage: sinks_tradeoff_s20.py SCENARIOS "PATH;PATH;..."
# first-token KL and TTFT of the edit turn 20 under several sink counts (per-message blocks)
import sys, statistics
from ragkv.engine.engine import Engine
from ragkv.bench.chat import ChatBenchConfig, conversation, notes
from ragkv.eval.modes import parse_mode_key
from ragkv.engine.options import FusionOptions
from ragkv.engine.stepwise import drain
from ragkv.store.memory import MemoryStore
from ragkv.ops.divergence import first_token_kl
eng0 = Engine.load("smollm2", dtype="float32")
cfg = ChatBenchConfig(turns=20, edit_at=20)
texts = notes(20, 80)
paths = sys.argv[2].split(";")
for scen in sys.argv[1].split(","):
    engs = {p: eng0.with_store(MemoryStore()) for p in paths}
    for t in range(1, 20):
        segs = eng0.history_segments(conversation(cfg, scen, t, texts), cfg.system)
        for p, eng in engs.items():
            f = parse_mode_key(p)
            eng.prefill(segs, f)
            with eng.lock:
                drain(eng.settle_history_steps(segs, prefix_chunk=f.prefix_chunk))
    segs = eng0.history_segments(conversation(cfg, scen, 20, texts), cfg.system)
    full = eng0.prefill(segs, FusionOptions(mode="full"))[0].logits.float()
    for p, eng in engs.items():
        snap = eng.store.snapshot(); ts = []
        for r in range(3):
            eng.store.restore(snap)
            st, stats = eng.prefill(segs, parse_mode_key(p)); ts.append(stats.ttft_ms)
        print(f"{scen:10s} {p:28s} kl {first_token_kl(full, st.logits.float()):.4f} ttft {statistics.median(ts):.0f} recomputed {stats.recomputed_tokens}", flush=True)
