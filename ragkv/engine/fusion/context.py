"""Fusion for `reuse` and `ape`: turn cached blocks into the KV the query attends to (`full`'s plain prefill is
kv/prefill.py).

`reuse` is Block-Attention inference (Ma et al. 2025, sec. 3.3): each block's cached raw K is re-rotated to its
position in the fused prompt and the query is prefilled over all of it. `ape` uses the same loop with a shared
prefix, the shared layout and APE's attention (ragkv.engine.fusion.ape).
"""

from __future__ import annotations

import time

import torch

from ragkv.engine.fusion.layout import Layout
from ragkv.engine.kv.kvcache import KVCache
from ragkv.engine.kv.prefill import _ms
from ragkv.engine.kv.state import AttentionPolicy, DecodeState
from ragkv.engine.kv.stepwise import Steps
from ragkv.engine.measure.stats import RequestStats
from ragkv.errors import InvalidRequestError
from ragkv.models.loop import Forward, computed
from ragkv.ops.attention import causal_attention, prefill_mask, sdpa
from ragkv.ops.rope import half_tables, rope_into


def write_context_layer(cache: KVCache, layer: int, parts: list[tuple[torch.Tensor, torch.Tensor]],
                        cos_h: torch.Tensor, sin_h: torch.Tensor) -> None:
    """Write each segment's raw K/V [Hkv, T, D] into its cache slot, K rotated to the context positions
    (cos_h/sin_h: half tables [N, D/2] of those positions, ragkv.ops.rope.half_tables)."""
    off = 0
    dev = cache.keys[layer].device
    for k, v, *rotated in parts:  # a third element: K already rotated at these positions (an exact prefix)
        n = k.shape[1]
        if rotated:
            cache.keys[layer][0, :, off:off + n] = k
        else:
            rope_into(cache.keys[layer][:, :, off:off + n], k.unsqueeze(0).to(dev), cos_h[off:off + n],
                      sin_h[off:off + n])
        cache.values[layer][0, :, off:off + n] = v
        off += n


class ContextPlan:
    """The query's rows over context KV fetched layer by layer from the store (`reuse`, `ape`).

    Before each layer the blocks' raw K/V are fetched and written into the cache, K rotated to the layout's
    positions; the query rows write after them and attend causally (or through APE's policy)."""

    def __init__(self, model, cache: KVCache, layer_iter, layout: Layout, query_len: int, stats: RequestStats,
                 attention: AttentionPolicy | None):
        dev = model.device
        self.cache, self.layers, self.stats, self.attention = cache, iter(layer_iter), stats, attention
        self.N, self.Tq = layout.context_len, query_len
        self.cos, self.sin = context_rotation(model, layout)
        self.positions = torch.arange(layout.query_start, layout.query_start + query_len, device=dev)
        window = model.args.sliding_window
        if attention is not None and window is not None and window < self.N + query_len:
            raise InvalidRequestError("APE is not supported with a sliding-window model; use reuse or blend")
        # sequential layout: cache index == position, so the window applies to cache indices
        self.mask = prefill_mask(query_len, self.N + query_len, window, dev)
        # nothing but causality after the context limits the rows: ops.attention.causal_attention's kernels take them
        self.causal_after = self.N if window is None or window >= self.N + query_len else None

    def begin(self, layer, decoder_layer, x):
        load_context_layer(self, layer)
        return x

    def store(self, layer, raw_k, k, v):
        N, end = self.N, self.N + self.Tq
        self.cache.keys[layer][:, :, N:end] = k
        self.cache.values[layer][:, :, N:end] = v
        return self.cache.keys[layer][:, :, :end], self.cache.values[layer][:, :, :end]

    def attend(self, layer, q, kv):
        if self.attention:
            return self.attention(layer, q, *kv)
        if self.causal_after is not None:
            return causal_attention(q, *kv, self.causal_after, self.mask)
        return sdpa(q, *kv, mask=self.mask)


def context_rotation(model, layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """The half cos/sin tables that rotate each context token's stored K to its position in this layout."""
    return half_tables(*model.rotary.lookup(layout.context_positions.to(model.device)))


def load_context_layer(plan, layer: int) -> None:
    """Fetch the next layer of cached context from `plan.layers` and write it into `plan.cache`, K rotated with
    `plan.cos/sin` (ContextPlan and BlendPlan before each layer); times go to plan.stats."""
    if plan.N:
        t0 = time.perf_counter()
        parts = next(plan.layers)
        plan.stats.fetch_ms += _ms(t0)
        t0 = time.perf_counter()
        write_context_layer(plan.cache, layer, parts, plan.cos, plan.sin)
        plan.stats.rerotate_ms += _ms(t0)


@torch.inference_mode()
def query_rows_over_context(model, layer_iter, layout: Layout, query_ids: list[int], capacity: int,
                            stats: RequestStats, attention: AttentionPolicy | None = None
                            ) -> Steps[tuple[DecodeState, torch.Tensor]]:
    """The query's rows over cached context fetched layer by layer from `layer_iter` (one list of (K, V) per layer,
    in cache order); fetching layer i+1 can overlap computing layer i when the store pipelines. Returns the state
    with no logits yet and the last row's hidden state [1, 1, H]: a caller that runs the LM head over more rows
    later (query-aware's stage 2) reads its weights once for both."""
    N, Tq = layout.context_len, len(query_ids)
    cache = KVCache.for_model(model, max(capacity, N + Tq))
    t0, before = time.perf_counter(), stats.fetch_ms + stats.rerotate_ms
    plan = ContextPlan(model, cache, layer_iter, layout, Tq, stats, attention)
    x = yield from computed(Forward(model, model.embed(torch.tensor([query_ids], device=model.device)), plan))
    cache.commit(N + Tq)
    stats.query_prefill_ms += _ms(t0) - (stats.fetch_ms + stats.rerotate_ms - before)
    stats.reused_tokens += N
    stats.recomputed_tokens += Tq
    return DecodeState(cache, layout.query_start + Tq, None, attention), x[:, -1:]


def prefill_over_context(model, layer_iter, layout: Layout, query_ids: list[int], capacity: int,
                         stats: RequestStats, attention: AttentionPolicy | None = None) -> Steps[DecodeState]:
    """Query prefill over cached context (`query_rows_over_context`), the next token's distribution computed."""
    state, last = yield from query_rows_over_context(model, layer_iter, layout, query_ids, capacity, stats, attention)
    t0 = time.perf_counter()
    with torch.inference_mode():
        state.logits = model.logits(last)[0, -1]
    stats.query_prefill_ms += _ms(t0)
    return state
