"""Cache keys, the block KV record, and the store interface every tier implements.

A key names exactly what a cached KV depends on (docs/invariants.md, invariant 8): the model fingerprint (weights,
tokenizer, dtype, RoPE), the conditioning (what the block attended to), the block's token ids, and the
tenant namespace. A miss is `None`, never an exception.
"""

from __future__ import annotations

import hashlib
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterator

import torch

from ragkv.store.errors import InvalidNamespaceError, MissingBlockError

# Namespaces become part of file names and Redis keys: keep them to a safe alphabet (no '/', '*', leading '.').
NAMESPACE_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


def hash_tokens(ids: list[int] | tuple[int, ...], parent: str = "") -> str:
    """sha256 of token ids, optionally chained to a parent hash (prefix caching, as vLLM/SGLang)."""
    h = hashlib.sha256(parent.encode())
    h.update(torch.tensor(list(ids), dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class CacheKey:
    fingerprint: str     # LoadedModel.fingerprint
    conditioning: str    # "none" | "prefix:<hash>" (APE) | "chain" (prefix-cache chunk, K already rotated)
    token_hash: str      # hash_tokens(block ids) or the chained chunk hash
    num_tokens: int
    namespace: str = "default"

    def digest(self) -> str:
        """Stable id used as file name / Redis key (namespace kept readable in front)."""
        body = f"{self.fingerprint}|{self.conditioning}|{self.token_hash}|{self.num_tokens}"
        return f"{self.namespace}-{hashlib.sha256(body.encode()).hexdigest()[:40]}"


def check_namespace(namespace: str) -> str:
    """Return `namespace` if it is usable in file names and Redis keys, else raise InvalidNamespaceError."""
    if not isinstance(namespace, str) or not NAMESPACE_RE.fullmatch(namespace):
        raise InvalidNamespaceError(
            f"invalid namespace {namespace!r}: use 1-64 characters from letters, digits, '_', '.', '-' "
            "(not starting with '.' or '-')")
    return namespace


def storage_name(key: CacheKey) -> str:
    """The key's digest after checking its namespace: the file name stem / Redis key suffix of an entry."""
    check_namespace(key.namespace)
    return key.digest()


def namespace_of(name: str) -> str:
    """Namespace part of a storage name made by `storage_name` (the digest is `<namespace>-<hex>`)."""
    return name.rsplit("-", 1)[0]


@dataclass
class BlockKV:
    """KV of one block: keys [L, Hkv, T, D] raw (before RoPE, position standardized to 0) and values."""
    keys: torch.Tensor
    values: torch.Tensor

    def __post_init__(self):
        if self.keys.shape != self.values.shape or self.keys.dim() != 4:
            raise ValueError(f"BlockKV wants keys/values [L, Hkv, T, D] of equal shape, got "
                             f"{tuple(self.keys.shape)} and {tuple(self.values.shape)}")

    @property
    def num_layers(self) -> int:
        return self.keys.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[i], self.values[i]


class LayerReader:
    """Reads one cached block layer by layer (see KVStore.open_layers). `read` returns None when the entry
    vanished or failed validation part-way; `instant` readers serve in-memory views (nothing to prefetch)."""

    instant = False

    def __init__(self, key: CacheKey, num_layers: int):
        self.key, self.num_layers = key, num_layers

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        raise NotImplementedError

    def batch_group(self) -> object:
        """Readers returning equal groups can be served together by `read_many` (e.g. one Redis round trip)."""
        return id(self)

    @staticmethod
    def read_many(readers: list["LayerReader"], layer: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        return [r.read(layer) for r in readers]

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class BlockLayerReader(LayerReader):
    """Layer views of a BlockKV already in memory."""

    instant = True

    def __init__(self, key: CacheKey, kv: BlockKV):
        super().__init__(key, kv.num_layers)
        self.kv = kv

    def read(self, layer):
        return self.kv.layer(layer)


class KVStore(ABC):
    """A key -> BlockKV map. Tiers (memory, disk, redis) and their composition implement it."""

    name = "store"  # tier kind shown in statistics
    cost: float | None = None  # price per GB kept here (store spec ?cost=), for the loading controller

    def describe(self) -> str:
        """Identity of this tier (spec-like), e.g. for the bandwidth profile cache."""
        return self.name

    def open_layers(self, key: CacheKey) -> LayerReader | None:
        """A reader for `key`'s layers, or None on a miss; tiers that can read one layer alone override this."""
        kv = self.get(key)
        return None if kv is None else BlockLayerReader(key, kv)

    def clear(self, namespace: str | None = None) -> int:
        """Delete every entry (of `namespace` only, if given); return how many were deleted."""
        raise NotImplementedError(f"{type(self).__name__} cannot be cleared")

    @abstractmethod
    def get(self, key: CacheKey) -> BlockKV | None: ...

    @abstractmethod
    def put(self, key: CacheKey, kv: BlockKV) -> None: ...

    @abstractmethod
    def contains(self, key: CacheKey) -> bool: ...

    @abstractmethod
    def delete(self, key: CacheKey) -> bool: ...

    def get_layer(self, key: CacheKey, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One layer's (raw K [Hkv, T, D], V), through `open_layers` (which tiers specialize)."""
        reader = self.open_layers(key)
        if reader is None:
            return None
        with reader:
            return reader.read(layer)

    def iter_layers(self, keys: list[CacheKey], num_layers: int) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Yield, per layer, every key's (K, V). Pipelined tiers override this to prefetch layer i+1
        while the caller computes on layer i (CacheBlend sec. 5)."""
        for i in range(num_layers):
            layer = []
            for key in keys:
                kv = self.get_layer(key, i)
                if kv is None:
                    raise MissingBlockError(f"block {key.digest()} vanished from the store during a request")
                layer.append(kv)
            yield layer

    def stats(self) -> dict:
        return {}
