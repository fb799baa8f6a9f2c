"""`ragkv bench decode`: decode speed and its fidelity cost, per (dtype, decode weights), on real RAG prompts.

Each request is a MuSiQue question over 4 of its passages (~1.3K tokens), prefilled with `reuse`. Measured:
- single-stream decode tokens/s (the median step time over `steps` steps, configurations interleaved per round,
  so machine noise hits all of them alike);
- batched decode tokens/s at each batch size (one batched forward per step, all sequences advancing);
- the bandwidth bound: the bytes a step reads over the machine's read bandwidth, probed before every round and
  after the last (the median probe; the JSON keeps them all);
- a profile of one decode step by kind of work (weight matmuls, attention, the rest: launch overhead);
- fidelity against the exact fp32 path: the reference's greedy tokens are fed to every configuration (teacher
  forcing) and each step's distribution is compared: mean KL(ref || cfg) and top-1 agreement.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ragkv.bench.common import markdown_table, save_json
from ragkv.config import cpu_name
from ragkv.engine.decode.sampling import greedy_token


@dataclass(frozen=True)
class DecodeBenchConfig:
    model: str = "smollm2"
    configs: tuple[tuple[str, str], ...] = (("float32", "exact"), ("float32", "onednn"), ("bfloat16", "exact"),
                                            ("bfloat16", "auto"), ("float32", "int8"), ("bfloat16", "int4"))
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    steps: int = 32
    rounds: int = 3
    fidelity_examples: int = 8
    passages: int = 4


def _requests(engine, n: int, k: int):
    from ragkv.engine.request.segments import Passage
    from ragkv.eval.datasets import load_dataset

    out = []
    for ex in load_dataset("musique", limit=n):
        out.append(engine.segments(ex.question, [Passage(p.text, p.title) for p in ex.passages[:k]]))
    return out


def _prefill(engine, segs, steps):
    from ragkv.engine.options import FusionOptions

    return engine.prefill(segs, FusionOptions(mode="reuse"), steps + 1)[0]


def _step_ms(engine, segs, steps: int) -> list[float]:
    from ragkv.engine.kv.state import decode_step

    state = _prefill(engine, segs, steps)
    tok, times = greedy_token(state.logits), []
    for _ in range(steps):
        t0 = time.perf_counter()
        tok = greedy_token(decode_step(engine.decode_model, state, tok))
        times.append((time.perf_counter() - t0) * 1000)
    return times


def _batched_tok_s(engine, reqs, batch: int, steps: int) -> float:
    from ragkv.engine.kv.state import decode_batch

    states = [_prefill(engine, reqs[i % len(reqs)], steps) for i in range(batch)]
    decode_batch(engine.decode_model, states, [greedy_token(s.logits) for s in states])  # warm-up step
    t0 = time.perf_counter()
    for _ in range(steps - 1):  # each sequence's token chosen as the server's greedy sampler does
        decode_batch(engine.decode_model, states, [greedy_token(s.logits) for s in states])
    return batch * (steps - 1) / (time.perf_counter() - t0)


def _profile(engine, segs, steps: int = 8) -> dict:
    """Milliseconds per decode step by kind of work (torch profiler, self CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    from ragkv.engine.kv.state import decode_step

    state = _prefill(engine, segs, steps + 2)
    tok = int(state.logits.argmax())
    decode_step(engine.decode_model, state, tok)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            decode_step(engine.decode_model, state, tok)
    kinds = {"weight matmuls": 0.0, "attention": 0.0, "other ops": 0.0}
    ops = 0
    for ev in prof.key_averages():
        name, ms = ev.key, ev.self_cpu_time_total / 1000 / steps
        ops += ev.count
        if any(s in name for s in ("int4pack", "int8pack", "aten::mm", "aten::addmm", "ragkv::gemv",
                                   "ragkv::amx_product", "_linear_pointwise")):
            kinds["weight matmuls"] += ms
        elif any(s in name for s in ("attention", "aten::bmm", "softmax")):  # ragkv::decode_attention too
            kinds["attention"] += ms
        else:
            kinds["other ops"] += ms
    out = {k: round(v, 2) for k, v in kinds.items()}
    out["ops per step"] = round(ops / steps)
    return out


def probe_buffer(gib: float = 1.0) -> torch.Tensor:
    """`gib` GiB to sum, in pages of the size the packed weights lie in (2 MB under RAGKV_HUGE_PAGES=1,
    ops/huge_pages), touched once: made once for a bench's several probes (2 MB pages fault in at ~5 s a GiB)."""
    from ragkv.ops.huge_pages import on_huge_pages

    buf = on_huge_pages(torch.ones(int(gib * 2 ** 30) // 4, dtype=torch.float32))
    buf.sum()
    return buf


def read_bandwidth_gbs(gib: float = 1.0, repeats: int = 5, buf: torch.Tensor | None = None) -> float:
    """The machine's read bandwidth, STREAM-like: the best of `repeats` sums over `gib` GiB (far beyond any cache;
    `buf`, a `probe_buffer`, if given), on torch's threads, in GB/s. What a decode step's weight reads are bound by:
    read from pages of the packed weights' size, so the bound and the step compare alike."""
    if buf is None:
        buf = probe_buffer(gib)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best / 1e9


WEIGHT_BYTES = {"int8": 1.0, "int4": 0.5}  # bytes a decode step reads per weight; other kinds: the dtype's size


def decode_bytes(engine, kind: str, prompt_tokens: float) -> dict:
    """Bytes one batch-1 decode step must read: every linear's weight (the LM head included) at the copy's width,
    one embedding row, and the KV cache of the prompt."""
    a = engine.model.args
    per_weight = WEIGHT_BYTES.get(kind, torch.finfo(engine.model.dtype).bits / 8)
    linears = sum(m.weight.numel() for name, m in engine.model.named_modules()
                  if isinstance(m, torch.nn.Linear))
    kv = 2 * a.num_layers * a.num_kv_heads * a.head_dim * torch.finfo(engine.model.dtype).bits / 8
    return {"weights": round(linears * per_weight), "kv": round(prompt_tokens * kv)}


def _teacher_forced(engine, segs, tokens: list[int]) -> list[torch.Tensor]:
    from ragkv.engine.kv.state import decode_step

    state = _prefill(engine, segs, len(tokens))
    out = []
    for t in tokens:
        out.append(decode_step(engine.decode_model, state, t).float().log_softmax(-1))
    return out


def run_decode_bench(cfg: DecodeBenchConfig, out_dir: Path, progress=print) -> dict:
    from ragkv.engine.engine import Engine
    from ragkv.engine.kv.state import decode_step

    engines = {c: Engine.load(cfg.model, dtype=c[0], device="cpu", decode_weights=c[1]) for c in cfg.configs}
    ref_engine = engines.get(("float32", "exact")) or Engine.load(cfg.model, dtype="float32", device="cpu")
    reqs = _requests(ref_engine, max(cfg.fidelity_examples, max(cfg.batch_sizes)), cfg.passages)
    prompt_mean = sum(s.num_tokens for s in reqs) / len(reqs)
    progress(f"[bench decode] {len(reqs)} MuSiQue requests, {prompt_mean:.0f} tokens on average; CPU {cpu_name()}, "
             f"{torch.get_num_threads()} threads")

    # a shared host's bandwidth moves (a 2-core Zen 4: 32 to 65 GB/s within minutes), so it is probed before
    # every round and after the last, and the bound uses the median probe: one probe would judge every round by
    # whatever moment it fell on
    probes: list[float] = []
    buf = probe_buffer()
    step_times = {c: [] for c in cfg.configs}
    for r in range(cfg.rounds):
        probes.append(read_bandwidth_gbs(buf=buf))
        for c, eng in engines.items():
            step_times[c] += _step_ms(eng, reqs[r % len(reqs)], cfg.steps)
        progress(f"[bench decode] round {r + 1}/{cfg.rounds}: " + ", ".join(
            f"{c[0]}/{c[1]} {1000 / statistics.median(step_times[c]):.1f} tok/s" for c in cfg.configs)
            + f"; read bandwidth {probes[-1]:.1f} GB/s before it")
    probes.append(read_bandwidth_gbs(buf=buf))
    del buf
    bandwidth = statistics.median(probes)

    # fidelity: the exact fp32 greedy tokens fed to every configuration
    refs = []
    for segs in reqs[:cfg.fidelity_examples]:
        state = _prefill(ref_engine, segs, cfg.steps)
        toks = [int(state.logits.argmax())]
        for _ in range(cfg.steps - 1):
            toks.append(int(decode_step(ref_engine.model, state, toks[-1]).argmax()))
        refs.append((segs, toks, _teacher_forced(ref_engine, segs, toks)))

    rows = []
    for c, eng in engines.items():
        kls, agree, n = [], 0, 0
        for segs, toks, ref_lp in refs:
            for a, b in zip(ref_lp, _teacher_forced(eng, segs, toks)):
                kls.append(float((a.exp() * (a - b)).sum()))
                agree += int(a.argmax() == b.argmax())
                n += 1
        batched = {b: round(_batched_tok_s(eng, reqs, b, cfg.steps), 1) for b in cfg.batch_sizes}
        prof = _profile(eng, reqs[0])
        med = statistics.median(step_times[c])
        reads = decode_bytes(eng, c[1], prompt_mean)
        bound = bandwidth * 1e9 / (reads["weights"] + reads["kv"])  # tok/s if every byte came at the probe's speed
        rows.append({"dtype": c[0], "decode_weights": eng.decode_weights, "step_ms_median": round(med, 2),
                     "tokens_per_s": round(1000 / med, 1), "bytes_per_step": reads,
                     "bandwidth_bound_tokens_per_s": round(bound, 1),
                     "fraction_of_bound": round(1000 / med / bound, 3), "batched_tokens_per_s": batched,
                     # --fidelity-examples 0: speed only, no fidelity measured
                     "kl_to_fp32_exact": round(statistics.mean(kls), 5) if kls else None,
                     "top1_agreement": round(agree / n, 4) if n else None,
                     "profile_ms": prof})
        progress(f"[bench decode] {c[0]}/{c[1]}: {rows[-1]['tokens_per_s']} tok/s, batched {batched}, "
                 f"KL {rows[-1]['kl_to_fp32_exact']}, top-1 {rows[-1]['top1_agreement']}, profile {prof}")
    result = {"config": asdict(cfg), "cpu": cpu_name(), "threads": torch.get_num_threads(),
              "read_bandwidth_gbs": round(bandwidth, 1), "read_bandwidth_probes_gbs": [round(b, 1) for b in probes],
              "prompt_tokens_mean": round(prompt_mean, 1), "rows": rows}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_json(out_dir / "decode.json", result)
    (out_dir / "decode.md").write_text(render_markdown(result))
    return result


def render_markdown(result: dict) -> str:
    base = next((r for r in result["rows"] if r["dtype"] == "float32" and r["decode_weights"] == "exact"), None)
    bs = result["config"]["batch_sizes"]
    headers = ["dtype", "decode weights", "tok/s (1 stream)", "vs fp32 exact", "bandwidth bound tok/s",
               "of the bound"] + [f"tok/s batch {b}" for b in bs] + [
        "KL to fp32 exact", "top-1 agree", "step ms: matmuls / attention / other (ops)"]
    rows = []
    for r in result["rows"]:
        p = r["profile_ms"]
        rows.append([r["dtype"], r["decode_weights"], r["tokens_per_s"],
                     f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-",
                     r.get("bandwidth_bound_tokens_per_s", "-"),
                     f"{r['fraction_of_bound']:.0%}" if "fraction_of_bound" in r else "-"]
                    + [r["batched_tokens_per_s"][b] if b in r["batched_tokens_per_s"] else
                       r["batched_tokens_per_s"].get(str(b)) for b in bs]
                    + [r["kl_to_fp32_exact"], r["top1_agreement"],
                       f"{p['weight matmuls']} / {p['attention']} / {p['other ops']} ({p['ops per step']})"])
    probes = result.get("read_bandwidth_probes_gbs")
    spread = f", the median of {len(probes)} probes, one before each round and one after: {min(probes)}-" \
        f"{max(probes)} GB/s" if probes else ""
    return (f"# Decode speed and fidelity\n\nCPU: {result['cpu']}, {result['threads']} threads; "
            f"{result['prompt_tokens_mean']} prompt tokens on average (MuSiQue, 4 passages, reuse); "
            f"{result['config']['steps']} steps x {result['config']['rounds']} rounds. Read bandwidth "
            f"{result.get('read_bandwidth_gbs', '?')} GB/s (a sum over 1 GiB{spread}); the bound is that over the "
            f"bytes a step reads (weights at the copy's width, the prompt's KV).\n\n"
            + markdown_table(headers, rows) + "\n")
