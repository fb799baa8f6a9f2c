"""Fusion modes `full`, `reuse` and `ape`: turn cached blocks into the KV the query attends to.

`reuse` is Block-Attention inference (Ma et al. 2025, sec. 3.3): each block's cached raw K is re-rotated to its
position in the fused prompt and the query is prefilled over all of it. `ape` uses the same loop with a shared
prefix, the shared layout and APE's attention (ragkv.engine.ape).
"""

from __future__ import annotations

import time

import torch

from ragkv.engine.kvcache import KVCache
from ragkv.engine.layout import Layout
from ragkv.engine.options import RequestStats
from ragkv.engine.state import AttentionPolicy, DecodeState
from ragkv.ops.attention import causal_mask, sdpa
from ragkv.ops.rope import half_tables, rope_into


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


@torch.inference_mode()
def prefill_full(model, ids: list[int], capacity: int, stats: RequestStats) -> DecodeState:
    """Ordinary prefill of the whole sequence: the quality reference."""
    t0 = time.perf_counter()
    cache = KVCache.for_model(model, capacity)
    logits = model(torch.tensor([ids], device=model.device), cache=cache)[0, -1]
    stats.recompute_ms += _ms(t0)
    stats.recomputed_tokens += len(ids)
    return DecodeState(cache, len(ids), logits)


def write_context_layer(cache: KVCache, layer: int, parts: list[tuple[torch.Tensor, torch.Tensor]],
                        cos_h: torch.Tensor, sin_h: torch.Tensor) -> None:
    """Write each segment's raw K/V [Hkv, T, D] into its cache slot, K rotated to the context positions
    (cos_h/sin_h: half tables [N, D/2] of those positions, ragkv.ops.rope.half_tables)."""
    off = 0
    dev = cache.keys[layer].device
    for k, v in parts:
        n = k.shape[1]
        rope_into(cache.keys[layer][:, :, off:off + n], k.unsqueeze(0).to(dev), cos_h[off:off + n],
                  sin_h[off:off + n])
        cache.values[layer][0, :, off:off + n] = v
        off += n


@torch.inference_mode()
def prefill_over_context(model, layer_iter, layout: Layout, query_ids: list[int], capacity: int,
                         stats: RequestStats, attention: AttentionPolicy | None = None) -> DecodeState:
    """Query prefill over cached context fetched layer by layer from `layer_iter` (one list of (K, V) per layer,
    in cache order). Fetching layer i+1 can overlap computing layer i when the store pipelines."""
    dev = model.device
    N, Tq = layout.context_len, len(query_ids)
    cache = KVCache.for_model(model, max(capacity, N + Tq))
    cos, sin = half_tables(*model.rotary.lookup(layout.context_positions.to(dev)))
    qpos = torch.arange(layout.query_start, layout.query_start + Tq, device=dev)
    mask = causal_mask(Tq, N + Tq, dev)
    x = model.embed(torch.tensor([query_ids], device=dev))
    layers = iter(layer_iter)
    for i, layer in enumerate(model.layers):
        t0 = time.perf_counter()
        parts = next(layers) if N else []
        stats.fetch_ms += _ms(t0)
        t0 = time.perf_counter()
        if N:
            write_context_layer(cache, i, parts, cos, sin)
        stats.rerotate_ms += _ms(t0)
        t0 = time.perf_counter()
        q, k, v = layer.project_qkv(x)
        q, k = model.rope(q, qpos), model.rope(k, qpos)
        cache.keys[i][:, :, N:N + Tq] = k
        cache.values[i][:, :, N:N + Tq] = v
        k_all, v_all = cache.keys[i][:, :, :N + Tq], cache.values[i][:, :, :N + Tq]
        attn = attention(i, q, k_all, v_all) if attention else sdpa(q, k_all, v_all, mask=mask)
        x = layer.finish(x, attn)
        stats.query_prefill_ms += _ms(t0)
    cache.commit(N + Tq)
    logits = model.logits(x[:, -1:])[0, -1]
    stats.reused_tokens += N
    stats.recomputed_tokens += Tq
    return DecodeState(cache, layout.query_start + Tq, logits, attention)
