"""What every fusion mode hands to decoding (the fused KV cache, the next position, the attention policy), and
batched decode: every running sequence advances one token in one forward, whatever its mode or length."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch

from ragkv.engine.kvcache import KVCache
from ragkv.models.loop import run_layers
from ragkv.ops.attention import decode_attention

# (layer, q [1,Hq,T,D], all K, all V) -> attention output; None means plain attention over the whole cache.
AttentionPolicy = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class DecodeState:
    cache: KVCache
    next_position: int
    logits: torch.Tensor  # [V] fp32: distribution of the next token
    attention: AttentionPolicy | None = None

    def fork(self) -> "DecodeState":
        """An independent copy to decode another continuation of the same prompt from (n > 1 choices): the
        prefill is shared, the KV is copied, the attention policy (stateless) is shared."""
        cache = copy.copy(self.cache)
        cache.keys = [k.clone() for k in self.cache.keys]
        cache.values = [v.clone() for v in self.cache.values]
        return DecodeState(cache, self.next_position, self.logits.clone(), self.attention)


class DecodePlan:
    """One new token per sequence: rows are sequences, each with its own cache, position and attention policy.

    The projections and MLP run batched over all rows (the weights are read once per step); attention runs per
    sequence over its own cache, so lengths, layouts and policies (APE) can differ within a batch.
    """

    def __init__(self, states: list[DecodeState], device, window: int | None):
        self.states, self.window = states, window
        self.positions = torch.tensor([[s.next_position] for s in states], device=device)

    def begin(self, layer, decoder_layer, x):
        return x

    def store(self, layer, raw_k, k, v):
        return [s.cache.append(layer, k[b:b + 1], v[b:b + 1]) for b, s in enumerate(self.states)]

    def attend(self, layer, q, kv):
        outs = []
        for b, (s, (keys, values)) in enumerate(zip(self.states, kv)):
            qb = q[b:b + 1]
            if s.attention is not None:
                outs.append(s.attention(layer, qb, keys, values))
            else:
                if self.window is not None:  # sequential layouts: cache index == position
                    keys, values = keys[:, :, -self.window:], values[:, :, -self.window:]
                outs.append(decode_attention(qb, keys, values))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


@torch.inference_mode()
def decode_batch(model, states: list[DecodeState], tokens: list[int]) -> torch.Tensor:
    """Feed tokens[b] to states[b] at its next position; returns next-token logits [B, V] fp32 and advances
    every state (its `logits` included)."""
    dev = model.device
    x = model.embed(torch.tensor(tokens, device=dev).unsqueeze(1))
    x = run_layers(model, x, DecodePlan(states, dev, model.args.sliding_window))
    logits = model.logits(x)[:, -1]
    for b, s in enumerate(states):
        s.cache.commit(1)
        s.next_position += 1
        s.logits = logits[b]
    return logits


def decode_step(model, state: DecodeState, token: int) -> torch.Tensor:
    """Feed one token to one sequence; returns its next-token logits [V]."""
    return decode_batch(model, [state], [token])[0]
