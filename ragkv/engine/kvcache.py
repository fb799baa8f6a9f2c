"""The KV cache of one sequence being decoded: per-layer rotated K and V, preallocated and grown."""

from __future__ import annotations

import torch


class KVCache:
    """Keys (RoPE applied) and values per layer, shaped [B, Hkv, capacity, D]; `length` tokens are valid.

    Layers are appended one after another during a forward, then `commit(T)` advances `length`.
    Growth doubles the capacity so that decoding costs amortized O(1) copies per token.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, capacity: int = 256, batch: int = 1):
        shape = (batch, num_kv_heads, max(capacity, 1), head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.length = 0

    @classmethod
    def for_model(cls, model, capacity: int = 256) -> "KVCache":
        a = model.args
        return cls(a.num_layers, a.num_kv_heads, a.head_dim, model.dtype, model.device, capacity)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def _ensure(self, layer: int, need: int) -> None:
        cap = self.keys[layer].shape[2]
        if need <= cap:
            return
        new_cap = max(need, 2 * cap)
        for store in (self.keys, self.values):
            old = store[layer]
            grown = old.new_empty(old.shape[:2] + (new_cap,) + old.shape[3:])
            grown[:, :, : self.length] = old[:, :, : self.length]
            store[layer] = grown

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, Hkv, T, D] after the committed tokens; return views of all tokens so far."""
        end = self.length + k.shape[2]
        self._ensure(layer, end)
        self.keys[layer][:, :, self.length:end] = k
        self.values[layer][:, :, self.length:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def commit(self, n: int) -> None:
        self.length += n

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer][:, :, : self.length], self.values[layer][:, :, : self.length]

    def overwrite(self, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Replace the K/V of tokens at `index` [N] (CacheBlend writes recomputed tokens in place)."""
        self.keys[layer][:, :, index] = k
        self.values[layer][:, :, index] = v

    @property
    def nbytes(self) -> int:
        return sum(t[:, :, : self.length].numel() * t.element_size() for t in self.keys + self.values)
