"""The block pool: blocks resident on the compute device, K rotated once at the block's own positions 0..n-1,
read in place by every sequence that holds the block, whatever its offset (shared block attention,
ragkv.engine.fusion.shared_attention). A block enters the pool from the store once; later requests neither fetch nor
copy nor re-rotate it.

Bounded by bytes, least recently used first out. An evicted block stays alive as long as a sequence still reads it
(its tensors are referenced, not copied): the bound is on what the pool keeps, not on what live sequences hold.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from ragkv.ops.rope import half_tables, rope_into
from ragkv.settings import DEFAULT_BLOCK_POOL_BYTES
from ragkv.store.base import CacheKey

# keys -> per layer, each key's raw (K, V) [Hkv, n, D] (the store's layer stream)
LayerStream = Callable[[list[CacheKey]], Iterator[list[tuple[torch.Tensor, torch.Tensor]]]]


@dataclass(frozen=True)
class PooledBlock:
    keys: tuple[torch.Tensor, ...]    # per layer [1, Hkv, n, D], RoPE at positions 0..n-1
    values: tuple[torch.Tensor, ...]  # per layer [1, Hkv, n, D]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


class BlockPool:
    def __init__(self, model, max_bytes: int = DEFAULT_BLOCK_POOL_BYTES):
        self.model, self.max_bytes = model, max_bytes
        self._blocks: OrderedDict[CacheKey, PooledBlock] = OrderedDict()
        self._lock = threading.Lock()  # the model thread fills it, /health and /metrics read its size
        self.nbytes = self.hits = self.misses = 0

    def blocks(self, keys: list[CacheKey], stream: LayerStream) -> list[PooledBlock]:
        """The pooled blocks of `keys` (in order); the missing ones are read from `stream` once, all layers, and
        rotated at their own positions."""
        with self._lock:
            found = {k: self._blocks[k] for k in keys if k in self._blocks}
            for k in found:
                self._blocks.move_to_end(k)
        missing = list(dict.fromkeys(k for k in keys if k not in found))
        self.hits += len(keys) - len(missing)
        self.misses += len(missing)
        if missing:
            found.update(zip(missing, self._build(missing, stream)))
        return [found[k] for k in keys]

    def _build(self, keys: list[CacheKey], stream: LayerStream) -> list[PooledBlock]:
        dev = self.model.device
        longest = max(k.num_tokens for k in keys)
        cos, sin = half_tables(*self.model.rotary.lookup(torch.arange(longest, device=dev)))
        per_block = [([], []) for _ in keys]
        for layer in stream(keys):
            for (ks, vs), (k, v) in zip(per_block, layer):
                n = k.shape[1]
                rotated = torch.empty((1, *k.shape), dtype=self.model.dtype, device=dev)
                rope_into(rotated, k.unsqueeze(0).to(dev), cos[:n], sin[:n])
                ks.append(rotated)
                vs.append(v.unsqueeze(0).to(dev, self.model.dtype))
        built = [PooledBlock(tuple(ks), tuple(vs)) for ks, vs in per_block]
        with self._lock:
            for key, blk in zip(keys, built):
                if key not in self._blocks:
                    self._blocks[key] = blk
                    self.nbytes += blk.nbytes
            while self.nbytes > self.max_bytes and len(self._blocks) > 1:
                _, old = self._blocks.popitem(last=False)
                self.nbytes -= old.nbytes
        return built

    def discard(self, keys) -> None:
        """Drop `keys` (the store forgot them); sequences still reading them keep their references."""
        with self._lock:
            for k in keys:
                blk = self._blocks.pop(k, None)
                if blk is not None:
                    self.nbytes -= blk.nbytes

    def stats(self) -> dict:
        with self._lock:
            return {"blocks": len(self._blocks), "bytes": self.nbytes, "max_bytes": self.max_bytes,
                    "hits": self.hits, "misses": self.misses}
