"""`ragkv bench ceiling`: how far the exact forward is from this machine's compute ceiling. A `full` prefill as the
engine runs it (on the decode weights' path where they are the model's own) under torch's profiler: time and
GFLOP/s of the linears and of attention against the best square sgemm this machine shows in the same run; then
batched decode steps over `reuse` prompts: time, GFLOP/s and the weight bytes read per second (a decode step of a
small batch is bound by memory, not compute). FLOPs are the engine's analytic counts (engine/measure/flops.py)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ragkv.bench.common import markdown_table, save_json, sync_device
from ragkv.engine.kv.state import decode_batch
from ragkv.engine.measure.flops import attention_flops, linear_flops
from ragkv.engine.options import FusionOptions
from ragkv.engine.request.segments import Segments


@dataclass(frozen=True)
class CeilingBenchConfig:
    tokens: int = 2400                        # the `full` prompt's length
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    sgemm_sizes: tuple[int, ...] = (2048, 3072, 4096)
    rounds: int = 2                           # timed runs of each (the best counts: the clock moves)


def _timed(fn) -> float:
    sync_device()
    t0 = time.perf_counter()
    fn()
    sync_device()
    return time.perf_counter() - t0


def sgemm_peak(sizes: tuple[int, ...], rounds: int, dtype=torch.float32, device="cpu") -> float:
    """The best GFLOP/s of square products (one warm-up each)."""
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
        a @ b
        best = max(best, 2 * n ** 3 / min(_timed(lambda: a @ b) for _ in range(rounds)) / 1e9)
    return best


def op_seconds(prof) -> dict[str, float]:
    """Self time (s) of the profiled ops, in three groups by name; `top`: the eight largest ops."""
    ops = {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}
    linear = sum(v for k, v in ops.items() if "linear" in k or k in ("aten::addmm", "aten::mm"))
    attention = sum(v for k, v in ops.items() if "attention" in k)
    return {"linear_s": linear, "attention_s": attention, "other_s": sum(ops.values()) - linear - attention,
            "total_s": sum(ops.values()),
            "top": sorted(((k, round(v * 1000, 1)) for k, v in ops.items()), key=lambda kv: -kv[1])[:8]}


def run_ceiling_bench(engine, cfg: CeilingBenchConfig, prompt_ids: list[int], decode_segs: list[Segments],
                      out_dir: Path, say=print) -> dict:
    """`prompt_ids`: the `full` prompt (cut to cfg.tokens); `decode_segs`: the `reuse` prompts, max(batch) of them."""
    a, ids = engine.model.args, prompt_ids[:cfg.tokens]
    T, L = len(ids), a.num_layers
    segs, full = Segments([], [], ids), FusionOptions(mode="full")

    def prefill():
        engine.prefill(segs, full)[0].release()

    prefill()  # warm
    walls = [_timed(prefill) for _ in range(cfg.rounds)]
    with torch.profiler.profile() as prof:
        prefill()
    ops = op_seconds(prof)
    lin_flop, attn_flop = T * L * linear_flops(a), L * attention_flops(a, T * (T + 1) // 2)
    say(f"[ceiling] full prefill of {T} tokens: {min(walls):.2f} s; measuring the sgemm peak")
    peak = sgemm_peak(cfg.sgemm_sizes, cfg.rounds, engine.model.dtype, engine.device)
    res = {"config": asdict(cfg), "engine": engine.info(), "tokens": T, "threads": torch.get_num_threads(),
           "wall_s": [round(w, 6) for w in walls], "profiled_self_s": round(ops["total_s"], 6),
           "linear_s": round(ops["linear_s"], 6), "attention_s": round(ops["attention_s"], 6),
           "other_s": round(ops["other_s"], 6), "linear_flop": lin_flop, "attention_flop": attn_flop,
           "linear_gflops": round(lin_flop / max(ops["linear_s"], 1e-9) / 1e9, 2),
           "attention_gflops": round(attn_flop / max(ops["attention_s"], 1e-9) / 1e9, 2),
           "sgemm_peak_gflops": round(peak, 6), "ceiling_s": round((lin_flop + attn_flop) / peak / 1e9, 6),
           "prefill_top_ms": ops["top"], "decode_steps": {}}
    res["decode_steps"] = decode_steps(engine, cfg, decode_segs, say)
    save_json(out_dir / "ceiling.json", res)
    (out_dir / "ceiling.md").write_text(markdown(res))
    return res


def decode_steps(engine, cfg: CeilingBenchConfig, decode_segs: list[Segments], say=print) -> dict:
    a, L = engine.model.args, engine.model.args.num_layers
    steps = 2 * cfg.rounds * len(cfg.batch_sizes) + 2  # cache rows each state needs for the steps below
    states = [engine.prefill(s, FusionOptions(mode="reuse"), steps)[0] for s in decode_segs[:max(cfg.batch_sizes)]]
    # per sequence: every layer's linears and the LM head, read once per step whatever the batch
    weights = L * linear_flops(a) // 2 + a.hidden_size * a.vocab_size
    weight_bytes = weights * engine.model.dtype.itemsize
    out = {}
    for b in cfg.batch_sizes:
        decode_batch(engine.decode_model, states[:b], [13] * b)  # warms this shape
        t = min(_timed(lambda: decode_batch(engine.decode_model, states[:b], [13] * b)) for _ in range(cfg.rounds))
        keys = sum(s.next_position for s in states[:b])
        flop = b * 2 * weights + L * attention_flops(a, keys)
        out[b] = {"step_ms": round(t * 1000, 2), "keys_per_sequence": keys // b,
                  "gflops": round(flop / t / 1e9, 2), "weight_gb_per_s": round(weight_bytes / t / 1e9, 2)}
    for b in (min(cfg.batch_sizes), max(cfg.batch_sizes)):  # where a step's time goes
        with torch.profiler.profile() as prof:
            decode_batch(engine.decode_model, states[:b], [13] * b)
        ops = op_seconds(prof)
        out[b]["profile_ms"] = {k.removesuffix("_s"): round(ops[k] * 1000, 2)
                                for k in ("linear_s", "attention_s", "other_s")} | {"top": ops["top"]}
    for s in states:
        s.release()
    say("[ceiling] decode steps: " + ", ".join(f"b{b} {v['step_ms']:.1f} ms" for b, v in out.items()))
    return out


def markdown(res: dict) -> str:
    e, m = res["engine"], res["machine"]
    best = min(res["wall_s"])
    rows = [["whole prefill (wall, best)", f"{best:.2f} s", ""],
            ["linears", f"{res['linear_s']:.2f} s", f"{res['linear_gflops']:.1f}"],
            ["attention", f"{res['attention_s']:.2f} s", f"{res['attention_gflops']:.1f}"],
            ["everything else", f"{res['other_s']:.2f} s", ""],
            ["sgemm peak, square products", "", f"{res['sgemm_peak_gflops']:.1f}"],
            ["the prefill at that peak", f"{res['ceiling_s']:.2f} s", ""]]
    steps = [[b, v["keys_per_sequence"], v["step_ms"], v["gflops"], v["weight_gb_per_s"],
              v.get("profile_ms", {}).get("linear", "-"), v.get("profile_ms", {}).get("attention", "-")]
             for b, v in res["decode_steps"].items()]
    return "\n".join([
        f"# ragkv bench ceiling: {e['model']} {e['dtype']}, decode weights {e.get('decode_weights')}", "",
        f"{m.get('cpu')} ({m.get('cpus')} CPUs, {res['threads']} threads); a {res['tokens']}-token `full` prefill, "
        "profiled", "", markdown_table(["", "time", "GFLOP/s"], rows), "",
        "## Decode steps over `reuse` prompts", "",
        markdown_table(["batch", "keys per sequence", "step ms", "GFLOP/s", "weight GB/s", "linears ms (profiled)",
                        "attention ms"], steps), ""])
