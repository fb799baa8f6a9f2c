"""`ragkv bench engine`: our full prefill vs transformers' own forward on the same tokens (target ratio <= 1.1).

The sides run in turn, one run of each per round (`repeats` rounds), so the machine's drift falls on all of them;
the JSON keeps every round's ratio. Two ragkv columns: the model's plain forward (torch's kernels: what every forward ran on before the exact copies),
and the prefill as the engine runs it (`full`: the `auto` copy, models/quant.py, in forwards of its `forward_rows`
rows into a KV cache). `--weights auto,w8a8` times each kind of copy in the same run, against the same
transformers time (w8a8's prefill is approximate: int8 products, models/quant.py)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from ragkv.bench.common import interleaved_ms, markdown_table, real_passages, save_json


@dataclass(frozen=True)
class EngineBenchConfig:
    model: str = "smollm2"
    lengths: tuple[int, ...] = (512, 1024, 2048, 4096)
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    repeats: int = 3
    weights: tuple[str, ...] = ("auto",)  # decode copies whose prefill is timed (auto: the CLI's default)


def run_engine_bench(cfg: EngineBenchConfig = EngineBenchConfig(), out_dir: Path = Path("bench_out"),
                     progress=print) -> dict:
    model_name, lengths, dtypes, repeats = cfg.model, cfg.lengths, cfg.dtypes, cfg.repeats
    from transformers import AutoModelForCausalLM

    from ragkv.config import torch_dtype
    from ragkv.engine.kv.kvcache import KVCache
    from ragkv.engine.kv.prefill import prefill_chunks
    from ragkv.engine.kv.stepwise import drain
    from ragkv.models.loader import load_model
    from ragkv.models.quant import decode_copy, resolve_decode_weights

    passages, _ = real_passages(100)
    rows = []
    for dt in dtypes:
        dtype = torch_dtype(dt)
        ours = load_model(model_name, dtype=dtype, device="cpu")
        copies = {}
        for w in cfg.weights:
            kind = resolve_decode_weights(w, ours.model)[0]
            copies.setdefault(kind, decode_copy(ours.model, kind))
        hf = AutoModelForCausalLM.from_pretrained(str(ours.path), dtype=dtype).eval()
        text = "\n".join(p.text for p in passages)
        all_ids = ours.tokenizer(text, add_special_tokens=False)["input_ids"]
        for n in lengths:
            ids = torch.tensor([all_ids[:n]])
            prompt = ids[0].tolist()
            fns = {"transformers": lambda: hf(ids, use_cache=False, logits_to_keep=1),
                   "plain": lambda: ours.model(ids)}
            for kind, served in copies.items():
                fns[kind] = lambda served=served: drain(prefill_chunks(served, KVCache.for_model(served, n), prompt,
                                                                       None))
            with torch.inference_mode():
                times = interleaved_ms(fns, repeats)
            hf_ms, plain_ms = statistics.median(times["transformers"]), statistics.median(times["plain"])
            for kind in copies:
                engine_ms = statistics.median(times[kind])
                # each round's own ratio: its spread says how far the machine's drift moves the figure
                per_round = sorted(e / h for e, h in zip(times[kind], times["transformers"]))
                rows.append({"dtype": dt, "tokens": n, "ragkv_ms": round(engine_ms, 1),
                             "ragkv_plain_ms": round(plain_ms, 1), "weights": kind,
                             "transformers_ms": round(hf_ms, 1), "ratio": round(engine_ms / hf_ms, 3),
                             "plain_ratio": round(plain_ms / hf_ms, 3),
                             "round_ratios": [round(r, 3) for r in per_round], "times_ms": {
                                 k: [round(t, 1) for t in times[k]] for k in ("transformers", "plain", kind)}})
                progress(f"  {dt:9s} {n:>5} tokens  ragkv {engine_ms:8.1f} ms ({kind})  plain forward "
                         f"{plain_ms:8.1f} ms  transformers {hf_ms:8.1f} ms  ratio {engine_ms / hf_ms:.3f} "
                         f"(plain {plain_ms / hf_ms:.3f}; rounds {per_round[0]:.3f}-{per_round[-1]:.3f})")
        hf = None  # frees the model before the next dtype loads (a `del` would leave the lambdas a free name)
    from ragkv.config import cpu_name

    result = {"model": model_name, "cpu": cpu_name(), "threads": torch.get_num_threads(), "repeats": repeats,
              "rows": rows}
    out_dir = Path(out_dir)
    save_json(out_dir / "engine_vs_hf.json", result)
    (out_dir / "engine_vs_hf.md").write_text(markdown_table(
        ["dtype", "tokens", "ragkv ms (engine's prefill)", "weights", "ragkv plain forward ms", "transformers ms",
         "ratio", "rounds' ratios", "plain ratio"],
        [[r["dtype"], r["tokens"], r["ragkv_ms"], r["weights"], r["ragkv_plain_ms"], r["transformers_ms"], r["ratio"],
          f"{r['round_ratios'][0]:.3f}-{r['round_ratios'][-1]:.3f}", r["plain_ratio"]] for r in rows]) + f"\n\nCPU: {result['cpu']}, {result['threads']} threads.\n")
    return result
