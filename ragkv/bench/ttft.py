"""`ragkv bench ttft`: time to first token per fusion mode and context length (Block-Attention table 2 analog).

Context = prefix + real MuSiQue passages (the last one cut to hit the target exactly), a fixed-size query.
Blocks are cached beforehand (as in serving); `prefix` finds the same passages cached by an earlier question.
The floor is the query's own prefill over an exact cached context: the least any reuse mode can cost.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ragkv.bench.common import markdown_table, median_ms, real_passages, save_json
from ragkv.bench.plots import plot_lines
from ragkv.engine.kv.kvcache import KVCache
from ragkv.engine.modes import MODES, get_mode
from ragkv.engine.options import FusionOptions
from ragkv.engine.request.segments import Segments
from ragkv.errors import InvalidRequestError


def build_request(engine, passages, question: str, context_tokens: int, query_tokens: int) -> Segments:
    base = engine.segments(question, passages[:1])
    prefix, query = base.prefix, base.query
    filler = engine.passage_ids(passages[-1])
    if len(query) < query_tokens:  # pad in front of the question with real text
        query = filler[: query_tokens - len(query)] + query
    query = query[-query_tokens:]
    blocks, total, i = [], len(prefix), 0
    while total < context_tokens:
        ids = engine.passage_ids(passages[i])[: context_tokens - total]
        blocks.append(ids)
        total += len(ids)
        i += 1
    return Segments(prefix, blocks, query)


def query_floor_ms(engine, segs: Segments, repeats: int) -> float:
    """Prefill of the query alone over an exact KV cache of the context (the least any reuse mode can cost)."""
    model = engine.forward_model  # what the modes' query rows run on
    ctx = segs.prefix + [t for b in segs.blocks for t in b]
    cache = KVCache.for_model(model, len(ctx) + len(segs.query))
    with torch.inference_mode():
        model(torch.tensor([ctx], device=model.device), cache=cache)
        q = torch.tensor([segs.query], device=model.device)

        def run():
            model(q, cache=cache)
            cache.length = len(ctx)  # drop the query again
        return median_ms(run, repeats)[0]


@dataclass(frozen=True)
class TtftBenchConfig:
    contexts: tuple[int, ...] = (512, 1024, 2048, 4096, 8192)
    modes: tuple[str, ...] = MODES
    query_tokens: int = 50
    repeats: int = 3
    fusion: FusionOptions = FusionOptions()  # parameters of the modes (blend's r, APE's T and S, ...)

    def __post_init__(self):
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise InvalidRequestError(f"unknown or no mode(s) {bad}; choose from {', '.join(MODES)}")
        if self.repeats < 1 or not self.contexts or min(self.contexts) < 1:
            raise InvalidRequestError("repeats and every context length must be >= 1")

    @property
    def ordered_modes(self) -> list[str]:
        """The reference (`full`) first: the other modes' ratios are against it."""
        return sorted(self.modes, key=lambda m: not get_mode(m).is_reference)


def run_ttft_bench(engine, cfg: TtftBenchConfig = TtftBenchConfig(), out_dir: Path = Path("bench_out"),
                   progress=print) -> dict:
    passages, questions = real_passages()
    a = engine.model.args
    rows = []
    query_tokens, repeats, ratio = cfg.query_tokens, cfg.repeats, cfg.fusion.ratio
    result = {**engine.info(), "query_tokens": query_tokens, "repeats": repeats, "ratio": ratio, "rows": rows}
    contexts, modes = cfg.contexts, cfg.ordered_modes
    for requested in contexts:
        n = min(requested, engine.max_positions - query_tokens)  # "8K" on an 8192-position model: context + query fit
        if n != requested:
            progress(f"  context {requested} + {query_tokens}-token query exceeds {engine.max_positions} positions; "
                     f"measuring {n} context tokens")
        segs = build_request(engine, passages, questions[0], n, query_tokens)
        floor = query_floor_ms(engine, segs, repeats)
        full_ms = None
        for mode in modes:
            fusion = replace(cfg.fusion, mode=mode)
            engine.warm(segs, fusion)  # what an earlier question over the same passages leaves in the cache
            last = {}

            def run():
                last["stats"] = engine.prefill(segs, fusion)[1]
            ms, runs = median_ms(run, repeats)
            ctx = len(segs.prefix) + sum(len(b) for b in segs.blocks)
            flops = get_mode(mode).first_token_flops(a, fusion, ctx, len(segs.query), prefix_len=len(segs.prefix),
                                                     reused=last["stats"].reused_tokens)
            if get_mode(mode).is_reference:
                full_ms, full_flops = ms, flops
            row = {"mode": mode, "context_tokens": n, "requested_context": requested,
                   "query_tokens": len(segs.query), "ttft_ms": round(ms, 2),
                   "runs_ms": [round(t, 2) for t in runs], "floor_ms": round(floor, 2),
                   "ratio_to_floor": round(ms / floor, 3), "flops": flops, "stats": last["stats"].to_dict()}
            rows.append(row)
            progress(f"  {n:>6} tokens  {mode:7s} {ms:9.1f} ms  (floor {floor:.1f} ms)")
        for row in rows:
            if row["context_tokens"] == n and full_ms:
                row["ttft_vs_full"] = round(row["ttft_ms"] / full_ms, 4)
                row["flops_vs_full"] = round(row["flops"] / full_flops, 5)
        save_ttft(result, Path(out_dir))  # after every context: a long run that dies keeps what it measured
    return result


def save_ttft(result: dict, out_dir: Path) -> None:
    rows = result["rows"]
    save_json(out_dir / "ttft.json", result)
    (out_dir / "ttft.md").write_text(render_ttft_markdown(result))
    series = {}
    for r in rows:
        series.setdefault(r["mode"], []).append((r["context_tokens"], r["ttft_ms"]))
    series["floor (query over exact cache)"] = sorted({(r["context_tokens"], r["floor_ms"]) for r in rows})
    plot_lines(out_dir / "ttft.png", series, "context tokens", "TTFT (ms)",
               f"TTFT vs context, {result['model']} {result['dtype']} {result['device']}")


def render_ttft_markdown(result: dict) -> str:
    headers = ["context", "mode", "TTFT ms", "vs full", "floor ms", "vs floor", "TFLOPs", "FLOPs vs full",
               "reused", "recomputed"]
    body = []
    for r in result["rows"]:
        s = r["stats"]
        body.append([r["context_tokens"], r["mode"], f"{r['ttft_ms']:.1f}", f"{100 * r.get('ttft_vs_full', 0):.1f}%",
                     f"{r['floor_ms']:.1f}", f"{r['ratio_to_floor']:.2f}x", f"{r['flops'] / 1e12:.4f}",
                     f"{100 * r.get('flops_vs_full', 0):.2f}%", s["reused_tokens"], s["recomputed_tokens"]])
    head = (f"TTFT on {result['model']} ({result['dtype']}, {result['device']}, {result['threads']} threads), "
            f"{result['query_tokens']}-token query, median of {result['repeats']} runs, blend r={result['ratio']}.\n\n")
    return head + markdown_table(headers, body) + "\n"
