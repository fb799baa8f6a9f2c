"""The one layer loop: every forward over the decoder layers (plain causal, block encoding, every fusion mode's
prefill, batched decode, fine-tuning) is `run_layers(model, x, plan)`.

What varies between those lives in the `LayerPlan` the loop is handed (as mlx-lm keeps its variation in the
per-layer cache object): which rows are computed (`begin`, which may load context or drop rows), at which
positions, where their K/V go and what keys they see (`store`), and how they attend (`attend`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ragkv.ops.attention import SegmentedMask, causal_attention, prefill_mask, sdpa
from ragkv.ops.rope import apply_rope


class LayerPlan(Protocol):
    positions: torch.Tensor  # [T] or [B, T] int64 positions of the rows now in x

    def begin(self, layer: int, decoder_layer, x: torch.Tensor) -> torch.Tensor:
        """Before layer `layer` (the module `decoder_layer`): may load its context KV or select the rows that go
        on (returns them)."""

    def store(self, layer: int, raw_k: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Keep this layer's K/V (raw K before RoPE and rotated K); return what the rows attend to (for
        `attend`), or None to stop after storing (block encoding: the last layer's output is not needed)."""

    def attend(self, layer: int, q: torch.Tensor, kv) -> torch.Tensor:
        """Attention output [B, Hq, T, D] of the rows' rotated queries over what `store` returned."""


def run_layers(model, x: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
    """x: embedded rows [B, T, H] -> the residual stream after the last layer plan let run."""
    pos = tables = None
    for i, decoder_layer in enumerate(model.layers):
        x = plan.begin(i, decoder_layer, x)
        q, k, v = decoder_layer.project_qkv(x)
        if plan.positions is not pos:  # cos/sin looked up once per set of rows, not per layer
            pos = plan.positions
            tables = model.rope_tables(pos)
        kv = plan.store(i, k, apply_rope(k, *tables), v)
        if kv is None:
            break
        x = decoder_layer.finish(x, plan.attend(i, apply_rope(q, *tables), kv))
    return x


class CausalPlan:
    """Ordinary causal attention over a KVCache (or none): new rows see the cache and the new rows before them.

    Covers the model's plain forward, `full` and `prefix` prefill and fine-tuning (an explicit `mask`, e.g.
    the Block-Attention mask, replaces the causal one). `window` is Mistral's sliding window: a row at
    position p sees keys at positions > p - window only (cache index == position here).
    """

    def __init__(self, positions: torch.Tensor, cache=None, mask: torch.Tensor | SegmentedMask | None = None,
                 window: int | None = None):
        self.positions, self.cache, self.segments = positions, cache, None
        T = positions.shape[-1]
        past = cache.length if cache is not None else 0
        plain = mask is None and (window is None or window >= past + T)  # nothing but causality limits the rows
        if isinstance(mask, SegmentedMask):  # fine-tuning's Block-Attention mask, attended block by block
            if past == 0 and (window is None or window >= T):
                self.segments, mask = mask, None
            else:
                mask = mask.dense(positions.device)
        if T > 1:
            causal = prefill_mask(T, past + T, window, positions.device)
            mask = causal if mask is None else (mask if causal is None else mask & causal)
        elif window is not None and window < past + T:  # one row: only the window limits it
            mask = prefill_mask(T, past + T, window, positions.device) if mask is None else mask
        self.mask, self.causal = mask, mask is None and T > 1 and self.segments is None
        self.causal_after = past if T > 1 and plain else None  # ops.attention.causal_attention takes these

    def begin(self, layer, decoder_layer, x):
        return x

    def store(self, layer, raw_k, k, v):
        return self.cache.append(layer, k, v) if self.cache is not None else (k, v)

    def attend(self, layer, q, kv):
        if self.segments is not None:
            return self.segments.attend(q, *kv)
        if self.causal_after is not None:
            return causal_attention(q, *kv, self.causal_after, self.mask)
        return sdpa(q, *kv, mask=self.mask, causal=self.causal)
