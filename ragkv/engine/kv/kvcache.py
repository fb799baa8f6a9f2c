"""The KV cache of one sequence being decoded: per-layer rotated K and V, grown on demand; the n choices of one
prompt read its rows from one SharedPrefix instead of each holding a copy; and what every live cache holds
(`live_bytes`, the server's "KV in use")."""

from __future__ import annotations

import threading
import weakref

import torch

# Rows a prefill allocates beyond its prompt for the answer. Later rows are grown into (doubling, up to the
# sequence's `max_rows`): a cache holds what its answer used, not prompt + max_tokens from the start.
DECODE_HEADROOM = 256
OWN_ROWS_START = 32  # a choice's own rows at first, over its shared prompt (doubled as it decodes)

_live: "weakref.WeakSet[KVCache]" = weakref.WeakSet()
_live_lock = threading.Lock()  # caches are made on the model thread while /health reads them on another


def live_bytes() -> int:
    """Bytes of KV buffers held by every cache alive in this process, a shared prefix counted once: a cache counts
    until it is released or collected, so a leaked one shows here."""
    with _live_lock:
        caches = list(_live)
    storages = {}
    for cache in caches:
        for t in cache.buffers():
            if not isinstance(t, torch.Tensor):
                continue
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def bytes_per_token(model) -> int:
    """KV bytes one token takes in a cache of `model` (K and V, every layer)."""
    a = model.args
    return 2 * a.num_layers * a.num_kv_heads * a.head_dim * torch.empty((), dtype=model.dtype).element_size()


class SharedPrefix:
    """The committed rows of a prompt's cache, read (never written) by the caches of its n choices."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]):
        self.keys, self.values = keys, values
        self.length = keys[0].shape[2] if keys else 0


class KVCache:
    """Keys (RoPE applied) and values per layer, shaped [B, Hkv, capacity, D]; `length` tokens are valid.

    Layers are appended one after another during a forward, then `commit(T)` advances `length`.
    Growth doubles the capacity (up to `max_rows`) so that decoding costs amortized O(1) copies per token.
    A forked cache (`fork`) reads rows 0..prefix.length from its SharedPrefix and keeps only its own rows after
    them in `keys`/`values`.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, capacity: int = 256, batch: int = 1):
        shape = (batch, num_kv_heads, max(capacity, 1), head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.length = 0
        self.max_rows: int | None = None  # rows this cache will ever need (a sequence's prompt + token budget)
        self.prefix: SharedPrefix | None = None
        with _live_lock:
            _live.add(self)

    @classmethod
    def for_model(cls, model, capacity: int = 256) -> "KVCache":
        a = model.args
        return cls(a.num_layers, a.num_kv_heads, a.head_dim, model.dtype, model.device, capacity)

    @property
    def offset(self) -> int:
        """Rows read from the shared prefix; own rows start there."""
        return self.prefix.length if self.prefix is not None else 0

    @property
    def capacity(self) -> int:
        return self.offset + self.keys[0].shape[2]

    def _ensure(self, layer: int, need: int) -> None:
        own_need, cap = need - self.offset, self.keys[layer].shape[2]
        if own_need <= cap:
            return
        new_cap = max(own_need, 2 * cap)
        if self.max_rows is not None:
            new_cap = max(own_need, min(new_cap, self.max_rows - self.offset))
        own = self.length - self.offset
        for store in (self.keys, self.values):
            old = store[layer]
            grown = old.new_empty(old.shape[:2] + (new_cap,) + old.shape[3:])
            grown[:, :, :own] = old[:, :, :own]
            store[layer] = grown

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> int:
        end = self.length + k.shape[2]
        self._ensure(layer, end)
        o = self.offset
        self.keys[layer][:, :, self.length - o:end - o] = k
        self.values[layer][:, :, self.length - o:end - o] = v
        return end

    def reserve(self, need: int) -> None:
        """Room for `need` rows in every layer (grown as `append` would grow it)."""
        if any(k.shape[2] < need - self.offset for k in self.keys):
            for layer in range(len(self.keys)):
                self._ensure(layer, need)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, Hkv, T, D] after the committed tokens; return views of all tokens so far (joined into one
        tensor when the cache reads a shared prefix: decoding uses `append_parts` instead)."""
        end = self._write(layer, k, v)
        if self.prefix is None:
            return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]
        return self._joined(layer, end)

    def append_parts(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`append`, returning all tokens so far as segments [(K, V), ...]: the shared prefix, then the own rows,
        not joined (decode attention reads both in place)."""
        end = self._write(layer, k, v)
        own = (self.keys[layer][:, :, :end - self.offset], self.values[layer][:, :, :end - self.offset])
        if self.prefix is None:
            return [own]
        return [(self.prefix.keys[layer], self.prefix.values[layer]), own]

    def _joined(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        o, p = self.offset, self.prefix
        return (torch.cat([p.keys[layer], self.keys[layer][:, :, :end - o]], dim=2),
                torch.cat([p.values[layer], self.values[layer][:, :, :end - o]], dim=2))

    def commit(self, n: int) -> None:
        self.length += n

    def truncate(self, length: int) -> None:
        """Forget the rows from `length` on (a draft decoded only to be scored); later writes replace them."""
        if not self.offset <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} rows ({self.offset} shared) to {length}")
        self.length = length

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.prefix is not None:
            return self._joined(layer, self.length)
        return self.keys[layer][:, :, : self.length], self.values[layer][:, :, : self.length]

    def overwrite(self, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Replace the K/V of tokens at `index` [N] (CacheBlend writes recomputed tokens in place)."""
        if self.prefix is not None:
            raise RuntimeError("a cache reading a shared prefix cannot overwrite its rows")
        self.keys[layer][:, :, index] = k
        self.values[layer][:, :, index] = v

    def fork(self) -> "KVCache":
        """Another cache continuing from this one's committed rows without copying them (n choices of a prompt).
        The first fork moves those rows into a SharedPrefix of their exact length; this cache and every fork then
        read it and append their own tokens to small buffers of their own."""
        if self.prefix is None:
            self._share_committed_rows()
        child = KVCache.__new__(KVCache)
        child.prefix, child.length, child.max_rows = self.prefix, self.length, self.max_rows
        child.keys, child.values = self._own_buffers(), self._own_buffers()
        with _live_lock:
            _live.add(child)
        return child

    def _own_buffers(self) -> list[torch.Tensor]:
        rows = OWN_ROWS_START if self.max_rows is None else min(OWN_ROWS_START, self.max_rows - self.offset)
        ref = self.prefix.keys[0]
        return [ref.new_empty(ref.shape[:2] + (max(rows, 1),) + ref.shape[3:]) for _ in self.prefix.keys]

    def _share_committed_rows(self) -> None:
        # layer by layer: the exact-length copy of one layer exists beside the old buffer only while it is made
        keys, values = [], []
        for i in range(len(self.keys)):
            keys.append(self.keys[i][:, :, :self.length].clone())
            values.append(self.values[i][:, :, :self.length].clone())
            self.keys[i], self.values[i] = keys[i], values[i]  # the old, longer buffer goes now
        self.prefix = SharedPrefix(keys, values)
        self.keys, self.values = self._own_buffers(), self._own_buffers()

    def release(self) -> None:
        """Drop the buffers now (a finished or cancelled sequence): memory comes back even if this object lives
        on in a reference cycle until the garbage collector runs."""
        self.keys, self.values, self.prefix = [], [], None

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor this cache holds (its own buffers and its shared prefix's)."""
        shared = (self.prefix.keys + self.prefix.values) if self.prefix is not None else []
        return list(self.keys) + list(self.values) + shared

    @property
    def nbytes(self) -> int:
        """Bytes of the valid tokens (shared rows included)."""
        own = self.length - self.offset
        total = sum(t[:, :, :own].numel() * t.element_size() for t in self.keys + self.values)
        if self.prefix is not None:
            total += sum(t.numel() * t.element_size() for t in self.prefix.keys + self.prefix.values)
        return total
