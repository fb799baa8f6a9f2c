"""CacheBlend selective recompute (Yao et al., EuroSys'25, sec. 4).

Independently cached blocks miss each other's attention. CacheBlend recomputes, layer by layer, only the
tokens whose KV deviates most from a full prefill ("HKVD" tokens, sec. 4.2): layers before the first check
layer are recomputed for every token (the original code: a full layer 0, selection on layer 1's V), at a check
layer the fresh V (or K) of the candidates is compared with the cached one and the top fraction r of block
tokens is kept; later layers recompute only those plus every query token. Gradual filtering (sec. 4.3)
narrows the selection over several check layers; without gradual filtering, several check layers sum their
deviations and select once at the last (every token is recomputed up to it). r = 1 is `full`; r = 0 is `reuse`
with a single check layer or gradual filtering (DESIGN Invariant 6).
"""

from __future__ import annotations

import time

import torch

from ragkv.engine.fusion import write_context_layer
from ragkv.engine.kvcache import KVCache
from ragkv.engine.layout import Layout
from ragkv.engine.options import FusionOptions, RequestStats
from ragkv.engine.state import DecodeState
from ragkv.ops.attention import sdpa
from ragkv.ops.rope import half_tables


def keep_count(ratio: float, n_block: int) -> int:
    return min(n_block, int(round(ratio * n_block)))


def check_ratios(opts: FusionOptions) -> list[float]:
    """Kept fraction after each check layer: constant r, or halving down to r with gradual filtering."""
    m = len(opts.check_layers)
    if opts.gradual:
        return [min(1.0, opts.ratio * 2 ** (m - 1 - j)) for j in range(m)]
    return [opts.ratio] * m


def attend_selected(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor,
                    max_chunks: int = 8, min_rows: int = 64) -> torch.Tensor:
    """Causal attention of the recomputed rows (ascending positions `pos`, cache index == position) over the cache.

    A masked kernel cannot skip the keys after a row, so the rows go in position-ordered chunks, each against
    only the keys up to its last row: ~(1 + 1/chunks)/2 of the rectangle instead of all of it.
    """
    S, total = q.shape[2], keys.shape[2]
    if S == total:  # every row recomputed (layers up to the check): the causal kernel
        return sdpa(q, keys, values, causal=True)
    n = max(1, min(max_chunks, S // min_rows))
    bounds = [round(j * S / n) for j in range(n + 1)]
    ends = pos[[b - 1 for b in bounds[1:]]].tolist()  # one host read per layer
    out = torch.empty_like(q)
    for a, b, end in zip(bounds[:-1], bounds[1:], ends):
        mask = torch.arange(end + 1, device=q.device).unsqueeze(0) <= pos[a:b].unsqueeze(1)
        out[:, :, a:b] = sdpa(q[:, :, a:b], keys[:, :, :end + 1], values[:, :, :end + 1], mask=mask)
    return out


@torch.inference_mode()
def prefill_blend(model, layer_iter, layout: Layout, context_ids: list[int], query_ids: list[int],
                  opts: FusionOptions, capacity: int, stats: RequestStats) -> DecodeState:
    dev = model.device
    N, Tq, P = layout.context_len, len(query_ids), layout.prefix_len
    total = N + Tq
    cache = KVCache.for_model(model, max(capacity, total))
    cos, sin = half_tables(*model.rotary.lookup(layout.context_positions.to(dev)))
    positions = torch.arange(total, device=dev)  # sequential layout: cache index == position
    # position of each context token inside its block, for always-recomputed attention sinks
    within = torch.full((total,), -1, device=dev)
    for off, n in zip(layout.block_offsets(), layout.block_lens):
        within[off:off + n] = torch.arange(n, device=dev)
    n_block = N - P
    ratios = dict(zip(opts.check_layers, check_ratios(opts)))
    last_check = opts.check_layers[-1]

    x = model.embed(torch.tensor([context_ids + query_ids], device=dev))
    sel = torch.arange(total, device=dev)  # cache indices of the rows in x, ascending
    deviation = torch.zeros(total, device=dev, dtype=torch.float32)
    layers = iter(layer_iter)
    kept_block = n_block
    for i, layer in enumerate(model.layers):
        t0 = time.perf_counter()
        parts = next(layers) if N else []
        stats.fetch_ms += (time.perf_counter() - t0) * 1000
        t0 = time.perf_counter()
        if N:
            write_context_layer(cache, i, parts, cos, sin)
        stats.rerotate_ms += (time.perf_counter() - t0) * 1000
        t0 = time.perf_counter()
        if i in ratios and n_block:
            is_cand = (sel >= P) & (sel < N)
            rows = is_cand.nonzero().squeeze(1)
            idx = sel[rows]
            if opts.deviation == "v":
                fresh, cached = layer.project_v(x[:, rows]), cache.values[i][:, :, idx]
            else:  # post-RoPE K deviation equals raw-K deviation (RoPE is a rotation); compare rotated
                _, k, _ = layer.project_qkv(x[:, rows], need_q=False)
                fresh, cached = model.rope(k, positions[idx]), cache.keys[i][:, :, idx]
            deviation[idx] += (fresh.float() - cached.float()).pow(2).sum(dim=(0, 1, 3))
            if opts.gradual or i == last_check:
                keep = torch.zeros(len(sel), dtype=torch.bool, device=dev)
                n_keep = min(keep_count(ratios[i], n_block), len(rows))
                if n_keep:
                    keep[rows[torch.topk(deviation[idx], n_keep).indices]] = True
                if opts.sink_tokens:
                    keep |= is_cand & (within[sel] < opts.sink_tokens)
                keep |= sel >= N  # every query token is always recomputed
                sel, x = sel[keep], x[:, keep]
                deviation.zero_()
                kept_block = int(((sel >= P) & (sel < N)).sum())
        q, k, v = layer.project_qkv(x)
        pos = positions[sel]
        q, k = model.rope(q, pos), model.rope(k, pos)
        cache.overwrite(i, sel, k, v)
        attn = attend_selected(q, cache.keys[i][:, :, :total], cache.values[i][:, :, :total], pos)
        x = layer.finish(x, attn)
        stats.recompute_ms += (time.perf_counter() - t0) * 1000
    cache.commit(total)
    logits = model.logits(x[:, -1:])[0, -1]
    stats.recomputed_tokens += kept_block + Tq
    stats.reused_tokens += N - kept_block
    stats.extra.update(blend_selected=kept_block, blend_block_tokens=n_block,
                       blend_check_layers=list(opts.check_layers))
    return DecodeState(cache, total, logits)
