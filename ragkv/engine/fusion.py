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
from ragkv.ops.rope import apply_rope


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
                        cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Copy the segments' raw K/V [Hkv, T, D] into cache order and rotate K to the context positions."""
    n = cos.shape[0]
    raw = torch.cat([k for k, _ in parts], dim=1).unsqueeze(0) if len(parts) > 1 else parts[0][0].unsqueeze(0)
    cache.keys[layer][:, :, :n] = apply_rope(raw.to(cache.keys[layer].device), cos, sin)
    vals = torch.cat([v for _, v in parts], dim=1) if len(parts) > 1 else parts[0][1]
    cache.values[layer][0, :, :n] = vals


@torch.inference_mode()
def prefill_over_context(model, layer_iter, layout: Layout, query_ids: list[int], capacity: int,
                         stats: RequestStats, attention: AttentionPolicy | None = None) -> DecodeState:
    """Query prefill over cached context fetched layer by layer from `layer_iter` (one list of (K, V) per layer,
    in cache order). Fetching layer i+1 can overlap computing layer i when the store pipelines."""
    dev = model.device
    N, Tq = layout.context_len, len(query_ids)
    cache = KVCache.for_model(model, max(capacity, N + Tq))
    cos, sin = model.rotary.lookup(layout.context_positions.to(dev))
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
