"""What every fusion mode hands to decoding: the fused KV cache, the next position, and the attention policy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ragkv.engine.kvcache import KVCache
from ragkv.ops.attention import sdpa

# (layer, q [B,Hq,1,D], all K, all V) -> attention output; None means plain attention over the whole cache.
AttentionPolicy = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class DecodeState:
    cache: KVCache
    next_position: int
    logits: torch.Tensor  # [V] fp32: distribution of the first generated token
    attention: AttentionPolicy | None = None


@torch.inference_mode()
def decode_step(model, state: DecodeState, token: int) -> torch.Tensor:
    """Feed one token at state.next_position; returns its next-token logits [V] and advances the state."""
    dev = model.device
    x = model.embed(torch.tensor([[token]], device=dev))
    pos = torch.tensor([state.next_position], device=dev)
    for i, layer in enumerate(model.layers):
        q, k, v = layer.project_qkv(x)
        q, k = model.rope(q, pos), model.rope(k, pos)
        k_all, v_all = state.cache.append(i, k, v)
        attn = state.attention(i, q, k_all, v_all) if state.attention else sdpa(q, k_all, v_all)
        x = layer.finish(x, attn)
    state.cache.commit(1)
    state.next_position += 1
    state.logits = model.logits(x)[0, -1]
    return state.logits
