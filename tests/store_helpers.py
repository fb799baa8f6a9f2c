"""Small synthetic KV blocks and keys for the store tests, plus workers for the multi-process test."""

from __future__ import annotations

import torch

from ragkv.store.base import BlockKV, CacheKey

L, H, T, D = 4, 2, 16, 8


def make_kv(seed: int = 0, dtype: torch.dtype = torch.float32, layers: int = L, tokens: int = T) -> BlockKV:
    g = torch.Generator().manual_seed(seed)
    return BlockKV(torch.randn(layers, H, tokens, D, generator=g).to(dtype),
                   torch.randn(layers, H, tokens, D, generator=g).to(dtype))


def make_key(i: int = 0, namespace: str = "default", fingerprint: str = "fp-a", conditioning: str = "none",
             tokens: int = T) -> CacheKey:
    return CacheKey(fingerprint, conditioning, f"tokens-{i}", tokens, namespace)


def same(a: BlockKV, b: BlockKV) -> bool:
    return a.dtype == b.dtype and torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def disk_work(store, worker: int, n_keys: int, rounds: int) -> list[str]:
    """Write and read the shared keys of a disk store; return problems (torn or wrong reads)."""
    problems = []
    for r in range(rounds):
        for i in range(n_keys):
            j = (i + worker * 7 + r) % n_keys
            key, want = make_key(j), make_kv(j)
            if (r + worker) % 2 == 0:
                store.put(key, want)
            got = store.get(key)
            if got is not None and not same(got, want):
                problems.append(f"worker {worker}: wrong tensors for key {j}")
            layer = store.get_layer(key, j % L)
            if layer is not None and not (torch.equal(layer[0], want.keys[j % L])
                                          and torch.equal(layer[1], want.values[j % L])):
                problems.append(f"worker {worker}: wrong layer for key {j}")
    return problems


def disk_worker(root: str, worker: int, n_keys: int, rounds: int, ready, queue) -> None:
    """Child-process side of the two-process test: signals `ready` once imported, then works."""
    from ragkv.store.disk import DiskStore

    store = DiskStore(root, 1 << 30)
    ready.set()
    queue.put(disk_work(store, worker, n_keys, rounds))
