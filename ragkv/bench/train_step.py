"""`ragkv bench train-step`: the time of one fine-tuning example (forward and backward) per attention variant.

Variants, on the same real examples (HotpotQA train, all 10 passages, as `ragkv finetune` builds them):
- `vanilla`: the causal mask (SDPA's causal kernel), the baseline of the ratios;
- `block-dense`: the Block-Attention mask as a dense [T, T] boolean mask (how fine-tuning attended before);
- `block`: the same mask attended block by block (`SegmentedMask`, what `ragkv finetune --method block` runs).
Each round runs every variant on every example, the variants' order rotating per round, so machine noise hits all
of them alike. The loss is checked equal (fp32) between the two block variants before anything is timed.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ragkv.bench.common import markdown_table, save_json
from ragkv.config import cpu_name
from ragkv.train.loop import answer_loss_sum

VARIANTS = ("vanilla", "block-dense", "block")


@dataclass(frozen=True)
class TrainStepBenchConfig:
    model: str = "smollm2"
    examples: int = 4
    rounds: int = 3
    max_length: int = 2048
    bf16: bool = True
    device: str = "cpu"


def _batches(cfg: TrainStepBenchConfig, tokenizer) -> dict[str, list]:
    from ragkv.train.data import Batch, build_examples, collate, load_training_examples

    raw = load_training_examples("hotpotqa-train", None, None, cfg.examples)
    examples, _ = build_examples(raw, tokenizer, cfg.max_length)
    out: dict[str, list] = {"vanilla": [], "block-dense": [], "block": []}
    for ex in examples:
        block = collate([ex], "block").to(cfg.device)
        out["vanilla"].append(collate([ex], "vanilla").to(cfg.device))
        out["block"].append(block)
        out["block-dense"].append(Batch(block.ids, block.labels, block.mask.dense(cfg.device)))
    return out


def _step_ms(model, batch, bf16: bool, device: str) -> tuple[float, float]:
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
        loss = answer_loss_sum(model, batch)
    loss.backward()
    if device != "cpu":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1000, loss.item()


def run_train_step_bench(cfg: TrainStepBenchConfig, out_dir: Path, progress=print) -> dict:
    from ragkv.models.loader import load_model

    loaded = load_model(cfg.model, torch.float32, torch.device(cfg.device))  # fp32 master weights, as finetune
    model = loaded.model.requires_grad_(True)
    batches = _batches(cfg, loaded.tokenizer)
    n = len(batches["block"])
    tokens = [int(b.ids.shape[1]) for b in batches["block"]]
    progress(f"[bench train-step] {cfg.model}, {n} HotpotQA train examples of {min(tokens)}-{max(tokens)} tokens, "
             f"{'bf16 autocast' if cfg.bf16 else 'fp32'}; CPU {cpu_name()}, {torch.get_num_threads()} threads")
    with torch.no_grad():  # the two block paths compute one loss (checked in fp32: bf16 rounding differs by path)
        for dense, seg in zip(batches["block-dense"], batches["block"]):
            a, b = answer_loss_sum(model, dense).item(), answer_loss_sum(model, seg).item()
            if abs(a - b) > 1e-4 * max(1.0, abs(a)):
                raise AssertionError(f"block-by-block loss {b} differs from the dense mask's {a}")
    for v in VARIANTS:  # warm-up
        _step_ms(model, batches[v][0], cfg.bf16, cfg.device)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(cfg.rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        for i in range(n):
            for v in order:
                times[v].append(_step_ms(model, batches[v][i], cfg.bf16, cfg.device)[0])
        progress(f"[bench train-step] round {r + 1}/{cfg.rounds}: " + ", ".join(
            f"{v} {statistics.median(times[v]) / 1000:.2f} s" for v in VARIANTS))
    base = statistics.median(times["vanilla"])
    rows = [{"variant": v, "median_s": statistics.median(t) / 1000, "min_s": min(t) / 1000,
             "max_s": max(t) / 1000, "vs_vanilla": statistics.median(t) / base} for v, t in times.items()]
    table = markdown_table(["variant", "median s / example", "min", "max", "vs vanilla"],
                           [[r["variant"], f"{r['median_s']:.2f}", f"{r['min_s']:.2f}", f"{r['max_s']:.2f}",
                             f"{r['vs_vanilla']:.2f}x"] for r in rows])
    result = {"config": asdict(cfg), "cpu": cpu_name(), "threads": torch.get_num_threads(), "tokens": tokens,
              "rows": rows, "samples_ms": times, "markdown": table}
    result["saved_to"] = str(save_json(out_dir / "train_step.json", result))
    (out_dir / "train_step.md").write_text(
        f"# One fine-tuning example, forward and backward ({cfg.model}, {n} HotpotQA train examples of "
        f"{min(tokens)}-{max(tokens)} tokens, {'bf16 autocast' if cfg.bf16 else 'fp32'}, {cfg.rounds} rounds)\n\n"
        f"CPU: {result['cpu']}, {result['threads']} threads.\n\n{table}\n")
    return result
