"""`ragkv bench engine`: our full prefill vs transformers' own forward on the same tokens (target ratio <= 1.1)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ragkv.bench.common import markdown_table, median_ms, real_passages, save_json


@dataclass(frozen=True)
class EngineBenchConfig:
    model: str = "smollm2"
    lengths: tuple[int, ...] = (512, 1024, 2048, 4096)
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    repeats: int = 3


def run_engine_bench(cfg: EngineBenchConfig = EngineBenchConfig(), out_dir: Path = Path("bench_out"),
                     progress=print) -> dict:
    model_name, lengths, dtypes, repeats = cfg.model, cfg.lengths, cfg.dtypes, cfg.repeats
    from transformers import AutoModelForCausalLM

    from ragkv.config import torch_dtype
    from ragkv.models.loader import load_model

    passages, _ = real_passages(100)
    rows = []
    for dt in dtypes:
        dtype = torch_dtype(dt)
        ours = load_model(model_name, dtype=dtype, device="cpu")
        hf = AutoModelForCausalLM.from_pretrained(str(ours.path), dtype=dtype).eval()
        text = "\n".join(p.text for p in passages)
        all_ids = ours.tokenizer(text, add_special_tokens=False)["input_ids"]
        for n in lengths:
            ids = torch.tensor([all_ids[:n]])
            with torch.inference_mode():
                ours_ms, _ = median_ms(lambda: ours.model(ids), repeats)
                hf_ms, _ = median_ms(lambda: hf(ids, use_cache=False, logits_to_keep=1), repeats)
            rows.append({"dtype": dt, "tokens": n, "ragkv_ms": round(ours_ms, 1), "transformers_ms": round(hf_ms, 1),
                         "ratio": round(ours_ms / hf_ms, 3)})
            progress(f"  {dt:9s} {n:>5} tokens  ragkv {ours_ms:8.1f} ms  transformers {hf_ms:8.1f} ms  "
                     f"ratio {ours_ms / hf_ms:.3f}")
        del hf
    result = {"model": model_name, "threads": torch.get_num_threads(), "repeats": repeats, "rows": rows}
    out_dir = Path(out_dir)
    save_json(out_dir / "engine_vs_hf.json", result)
    (out_dir / "engine_vs_hf.md").write_text(markdown_table(
        ["dtype", "tokens", "ragkv ms", "transformers ms", "ratio"],
        [[r["dtype"], r["tokens"], r["ragkv_ms"], r["transformers_ms"], r["ratio"]] for r in rows]) + "\n")
    return result
