"""`ragkv bench kernels`: every candidate kernel of every bf16 product of a model, timed per row class on this
machine (ragkv.ops.kernel_choice), and the one the engine uses; JSON + markdown."""

from __future__ import annotations

from pathlib import Path

from ragkv.config import machine


def run_kernels_bench(model: str, out_dir: Path, progress=print, refresh: bool = True) -> dict:
    """Measure (refresh: again, replacing the cache's choices) and report each product's table."""
    import torch

    from ragkv.bench.common import markdown_table, save_json
    from ragkv.models.loader import load_model
    from ragkv.models.onednn import KERNELS
    from ragkv.models.quant import decode_copy, onednn_refusal
    from ragkv.ops.attention import PREFILL_ATTENTION
    from ragkv.ops.kernel_choice import COPY_MARGIN, PROBE_ROWS, REPEATS, KernelChooser

    loaded = load_model(model, torch.bfloat16, torch.device("cpu"))
    why = onednn_refusal(loaded.model)
    if why:
        raise SystemExit(f"ragkv bench kernels: {why}")
    chooser = KernelChooser(refresh=refresh)
    progress(f"[bench kernels] timing every product of {loaded.name} at {list(PROBE_ROWS)} rows "
             f"({'measuring' if refresh else 'cache first'})")
    decode_copy(loaded.model, "onednn", chooser)
    rows, attention, decode = [], [], []
    products = [e for e in chooser.table.values() if e["machine"].endswith("bfloat16")]
    for e in products:
        for probe, ms, choice in zip(e["probe_rows"], e["ms"], e["choice"]):
            if e["product"].startswith("decode attention"):
                if ms:  # one sequence count is timed: a step's path must not depend on its batch size
                    decode.append([e["product"], probe, ms.get("avx512", "-"), ms.get("amx", "-"), choice,
                                   f"{min(ms.values()) / ms['avx512']:.2f}x" if ms.get("avx512") else "-"])
                continue
            if e["product"].startswith("causal attention"):
                attention.append([e["product"], probe, *(ms.get(k, "-") for k in PREFILL_ATTENTION), choice,
                                  f"{min(ms.values()) / ms['sdpa']:.2f}x" if ms.get("sdpa") else "-"])
                continue
            rows.append([e["product"], probe, *(ms.get(k, "-") for k in KERNELS),
                         choice, f"{min(ms.values()) / ms['onednn']:.2f}x" if ms.get("onednn") else "-"])
    result = {"benchmark": "kernels", "model": loaded.name, "machine": machine(), "cache": str(chooser.path),
              "measured": chooser.measured, "products": products}
    save_json(out_dir / "kernels.json", result)
    md = (f"Kernels per product and row class on {machine()['cpu']} (bf16, median ms of {REPEATS} rounds "
          "timing each candidate in turn, after one untimed call each; a kernel on a copy of its own must win by "
          f"{COPY_MARGIN:.0%} unless another row class already runs on that copy, else the fastest is chosen; last "
          "column: its time over oneDNN's):\n\n"
          + markdown_table(["product", "rows", *(f"{k} ms" for k in KERNELS), "chosen", "vs onednn"], rows)
          + "\n\nPrefill attention (square causal rows; kernel and amx: ragkv's kernel on AVX-512 BF16 and on AMX "
          "tiles, sdpa: torch's; last column: the chosen one's time over SDPA's):\n\n"
          + markdown_table(["attention", "rows", *(f"{k} ms" for k in PREFILL_ATTENTION), "chosen", "vs sdpa"],
                           attention)
          + "\n\nDecode attention (one step of that many sequences; avx512 and amx: the bf16 decode kernel's two "
          "paths; last column: the chosen one's time over the AVX-512 path's):\n\n"
          + markdown_table(["attention", "sequences", "avx512 ms", "amx ms", "chosen", "vs avx512"], decode))
    (out_dir / "kernels.md").write_text(md + "\n")
    return result
