"""`ragkv bench profile`: where one mode's warm prefill spends its time, on the serve bench's workload (a question
over a few MuSiQue passages). Every block is stored (and pooled, with kv=shared) before the timed runs, so they
measure the mode's own work; the median run's statistics (fetch, re-rotation, recompute, query prefill) and torch's
profile of one more run, op by op."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ragkv.bench.common import markdown_table, save_json, sync_device
from ragkv.eval.modes import parse_mode_key


@dataclass(frozen=True)
class ProfileBenchConfig:
    mode: str = "reuse"      # a mode key, e.g. reuse:kv=shared or blend:sel=query,r=0.15
    repeats: int = 5
    top: int = 25            # ops listed


def run_profile_bench(engine, cfg: ProfileBenchConfig, segs, out_dir: Path, say=print) -> dict:
    fusion = parse_mode_key(cfg.mode)
    for _ in range(2):  # stores the blocks, then a warm run
        engine.prefill(segs, fusion)[0].release()
    runs = []
    for _ in range(cfg.repeats):
        sync_device()
        t0 = time.perf_counter()
        state, stats = engine.prefill(segs, fusion)
        sync_device()
        runs.append(((time.perf_counter() - t0) * 1000, stats))
        state.release()
    wall = statistics.median(ms for ms, _ in runs)
    _, median_stats = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        engine.prefill(segs, fusion)[0].release()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events) or 1
    ops = [{"op": e.key, "self_ms": round(e.self_cpu_time_total / 1000, 3), "calls": e.count,
            "share": round(e.self_cpu_time_total / total, 4)} for e in events[:cfg.top]]
    d = median_stats.to_dict()
    result = {"config": asdict(cfg), "engine": engine.info(), "threads": torch.get_num_threads(),
              "tokens": {"prefix": len(segs.prefix), "blocks": [len(b) for b in segs.blocks],
                         "query": len(segs.query)},
              "wall_ms_median": round(wall, 3), "wall_ms_runs": [round(ms, 3) for ms, _ in runs],
              "stats_ms": {k: round(v, 3) for k, v in d.items() if k.endswith("_ms")},
              "reused_tokens": d.get("reused_tokens"), "recomputed_tokens": d.get("recomputed_tokens"),
              "profiled_ms": round(total / 1000, 3), "ops": ops}
    say(f"[profile] {cfg.mode}: median {wall:.1f} ms over {cfg.repeats} runs; top op {ops[0]['op'] if ops else '-'}")
    save_json(out_dir / "profile.json", result)
    (out_dir / "profile.md").write_text(markdown(result))
    return result


def markdown(res: dict) -> str:
    e, t = res["engine"], res["tokens"]
    stats = ", ".join(f"{k} {v:.1f}" for k, v in res["stats_ms"].items() if v)
    return "\n".join([
        f"# ragkv bench profile: `{res['config']['mode']}`, {e['model']} {e['dtype']}, decode weights "
        f"{e.get('decode_weights')}", "",
        f"Tokens: prefix {t['prefix']}, blocks {t['blocks']}, query {t['query']}; {res['threads']} threads. Warm "
        f"prefill: median {res['wall_ms_median']:.1f} ms (runs {res['wall_ms_runs']}); the median run's ms: "
        f"{stats}.", "",
        markdown_table(["op", "self ms", "calls", "share"],
                       [[o["op"], o["self_ms"], o["calls"], f"{o['share']:.1%}"] for o in res["ops"]]), ""])
