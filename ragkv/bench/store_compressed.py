"""`ragkv bench store --compare-kv int8,int4,fp8`: compressed KV in the store against the uncompressed store.

Per codec: the bytes a disk tier stores per token (beside fp32 and bf16), the time to load a request's blocks, and
the first-token distribution of each reading mode on real HotpotQA prompts, as KL divergence and top-1 agreement
against `full` and against the same mode over the uncompressed store. The blocks are encoded once, by the exact
engine, and the same KV is written into one disk tier per codec, so the codec is the only difference.
Target: <= 0.5x the bytes of bf16, and KL to `full` within 10% of the uncompressed store's.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

NAMESPACE = "bench-store-kv"
BYTES_TARGET = 0.5   # of bf16's bytes
KL_TARGET = 1.10     # KL to full, relative to the uncompressed store's


def run_compressed_bench(cfg, out_dir: Path = Path("bench_out"), progress=print) -> dict:
    """`cfg` is a StoreBenchConfig with `compare_kv` set; writes store_compressed.json and .md to `out_dir`."""
    from ragkv.bench.common import bench_dir, save_json
    from ragkv.engine.engine import Engine
    from ragkv.engine.options import FusionOptions
    from ragkv.eval.datasets import load_dataset
    from ragkv.store.spec import open_store

    exact = Engine.load(cfg.model, dtype=cfg.dtype, device=cfg.device, store=open_store("memory:64GiB"),
                        namespace=NAMESPACE)
    examples = load_dataset("hotpotqa", limit=cfg.examples)
    codecs = ("none",) + tuple(cfg.compare_kv)
    rows = {kv: {m: [] for m in cfg.modes} for kv in codecs}  # per example: (KL to full, top-1 to full, ...)
    with bench_dir("store-kv") as root:
        stores = {kv: open_store(f"disk:{root / kv}:64GiB?kv={kv}", pipelined=False) for kv in codecs}
        engines = {kv: exact.with_store(store, NAMESPACE) for kv, store in stores.items()}
        keys, tokens = [], 0
        for n, ex in enumerate(examples):
            segs = exact.segments(ex.question, ex.passages)
            full = exact.prefill(segs, FusionOptions(mode="full"))[0].logits
            for mode in cfg.modes:
                fusion = replace(cfg.fusion, mode=mode)
                new = [k for k in exact.warm(segs, fusion).keys if k not in keys]
                for k in new:  # the same KV into every tier: the codec is the only difference
                    kv = exact.store.get(k)
                    for store in stores.values():
                        store.put(k, kv)
                keys += new
                tokens += sum(k.num_tokens for k in new)
                logits = {kv: e.prefill(segs, fusion)[0].logits for kv, e in engines.items()}
                for kv in codecs:
                    rows[kv][mode].append(_fidelity(full, logits["none"], logits[kv]))
            progress(f"  example {n + 1}/{len(examples)}: {segs.num_tokens} tokens, {len(segs.blocks)} passages")
        row = {kv: exact.dtype_name if kv == "none" else kv for kv in codecs}  # a codec's row in the bytes table
        sizes = _stored_bytes(stores, keys, exact, row)
        loads = _load_ms({row[kv]: store for kv, store in stores.items()}, keys, exact.num_layers, cfg.repeats)
    bf16 = sizes["bfloat16"]
    result = {**exact.info(), "cpu": _cpu_model(), "load_average": [round(x, 1) for x in os.getloadavg()],
              "examples": len(examples), "blocks": len(keys),
              "stored_tokens": tokens, "modes": list(cfg.modes), "ratio": cfg.fusion.ratio, "argv": sys.argv[1:],
              "bytes": [{"kv": name, "bytes": b, "bytes_per_token": round(b / tokens, 1), "vs_bf16": round(b / bf16, 4),
                         "load_ms": loads.get(name)} for name, b in sizes.items()],
              "quality": _summarize(rows, codecs, cfg.modes)}
    for q in result["quality"]:
        q["vs_bf16"] = round(sizes[row[q["kv"]]] / bf16, 4)
        q["meets_target"] = (q["kv"] != "none" and q["vs_bf16"] <= BYTES_TARGET
                             and q["kl_vs_uncompressed_kl"] <= KL_TARGET)
    out = Path(out_dir)
    save_json(out / "store_compressed.json", result)
    (out / "store_compressed.md").write_text(render_markdown(result))
    return result


def _fidelity(full, uncompressed, other) -> dict:
    from ragkv.eval.metrics import first_token_kl, top1_agreement

    return {"kl_full": first_token_kl(full, other), "top1_full": top1_agreement(full, other),
            "kl_uncompressed": first_token_kl(uncompressed, other),
            "top1_uncompressed": top1_agreement(uncompressed, other)}


def _summarize(rows: dict, codecs, modes) -> list[dict]:
    out = []
    for mode in modes:
        base = statistics.mean(r["kl_full"] for r in rows["none"][mode])
        for kv in codecs:
            rs = rows[kv][mode]
            kl = statistics.mean(r["kl_full"] for r in rs)
            out.append({"mode": mode, "kv": kv, "kl_full": kl, "top1_full": statistics.mean(r["top1_full"] for r in rs),
                        "kl_uncompressed": statistics.mean(r["kl_uncompressed"] for r in rs),
                        "top1_uncompressed": statistics.mean(r["top1_uncompressed"] for r in rs),
                        "kl_vs_uncompressed_kl": kl / base if base > 0 else float("nan"),
                        "per_example_kl_full": [r["kl_full"] for r in rs]})
    return out


def _stored_bytes(stores: dict, keys, exact, row: dict) -> dict[str, int]:
    """Bytes of the blocks as each disk tier stored them (its files), and as an fp32 or a bf16 engine would store
    them where this run has no such tier (the same blocks cast: equal shapes, so equal entries)."""
    from ragkv.store import serde

    sizes = {row[kv]: sum(size for _, size in store.tiers[0].entries()) for kv, store in stores.items()}
    for dtype in ("float32", "bfloat16"):
        if dtype not in sizes:
            sizes[dtype] = sum(len(serde.encode(k, _cast(exact.store.get(k), dtype))) for k in keys)
    return {k: sizes[k] for k in dict.fromkeys(["float32", "bfloat16"] + [row[kv] for kv in stores])}


def _cast(kv, dtype: str):
    import torch

    from ragkv.store.base import BlockKV

    dt = getattr(torch, dtype)
    return BlockKV(kv.keys.to(dt), kv.values.to(dt))


def _load_ms(stores: dict, keys, num_layers: int, repeats: int) -> dict[str, float]:
    """Per store, the median ms to read every layer of every block (page cache warm: reading and decompressing, not
    the disk), the stores taken round-robin so that a shared machine's drift hits them alike; one untimed round."""
    times: dict[str, list[float]] = {name: [] for name in stores}
    for _ in range(repeats + 1):
        for name, store in stores.items():
            t0 = time.perf_counter()
            for _layer in store.iter_layers(keys, num_layers):
                pass
            times[name].append((time.perf_counter() - t0) * 1000)
    return {name: round(statistics.median(ts[1:]), 2) for name, ts in times.items()}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


def render_markdown(res: dict) -> str:
    from ragkv.bench.common import markdown_table

    head = (f"Compressed KV in the store, {res['model']} ({res['dtype']}, {res['device']}, {res['threads']} threads, "
            f"CPU: {res['cpu']}, load average {res['load_average'][0]} at the end): {res['examples']} HotpotQA dev "
            f"examples, {res['blocks']} cached blocks ({res['stored_tokens']} tokens), blend r={res['ratio']}.\n\n")
    names = {"float32": "fp32 (uncompressed)", "bfloat16": "bf16 (uncompressed)", "float16": "fp16 (uncompressed)"}
    sizes = markdown_table(
        ["stored as", "bytes per token", "vs bf16", "load ms (all blocks, warm page cache)"],
        [[names.get(r["kv"], r["kv"]), f"{r['bytes_per_token']:.0f}", f"{r['vs_bf16']:.3f}x",
          "" if r["load_ms"] is None else f"{r['load_ms']:.1f}"] for r in res["bytes"]])
    def verdict(ok: bool) -> str:
        return "yes" if ok else "no"

    quality = markdown_table(
        ["mode", "store", "first-token KL to full", "vs uncompressed store's KL", "top-1 = full",
         "KL to uncompressed store", "top-1 = uncompressed store", f"KL within {(KL_TARGET - 1) * 100:.0f}%",
         f"bytes <= {BYTES_TARGET}x bf16"],
        [[q["mode"], q["kv"] if q["kv"] != "none" else "uncompressed", f"{q['kl_full']:.4g}",
          f"{q['kl_vs_uncompressed_kl']:.3f}x", f"{q['top1_full']:.2f}", f"{q['kl_uncompressed']:.3g}",
          f"{q['top1_uncompressed']:.2f}"]
         + (["", ""] if q["kv"] == "none" else [verdict(q["kl_vs_uncompressed_kl"] <= KL_TARGET),
                                                verdict(q["vs_bf16"] <= BYTES_TARGET)])
         for q in res["quality"]])
    notes = (f"\n\nTarget: <= {BYTES_TARGET}x the bytes of bf16 and KL to full within "
             f"{(KL_TARGET - 1) * 100:.0f}% of the uncompressed store's (means over the examples). Bytes are the "
             "disk tier's files (headers included); the bf16 row is the same blocks cast, as a bf16 engine stores "
             "them.\n")
    command = f"\nCommand: `ragkv {' '.join(res['argv'])}`\n" if res.get("argv") else ""
    return head + sizes + "\n\n" + quality + notes + command
