"""Exact prefix caching: hash-chained fixed-size token chunks (as vLLM's and SGLang's prefix caches).

Chunk j's key hashes chunk j's tokens chained to chunk j-1's hash, so a hit implies the whole prefix matches.
Chunks hold K already rotated (their positions never change). The longest cached prefix is reused and the
rest prefilled over it; then the new full chunks are stored. Equal to `full` (docs/invariants.md, invariant 3).
"""

from __future__ import annotations

import time

import torch

from ragkv.engine.kv.kvcache import KVCache
from ragkv.engine.kv.prefill import prefill_chunks
from ragkv.engine.kv.state import DecodeState
from ragkv.engine.kv.stepwise import Steps
from ragkv.engine.measure.stats import RequestStats
from ragkv.store.base import BlockKV, CacheKey, KVStore, hash_tokens

CHAIN = "chain"


def chunk_keys(ids: list[int], chunk: int, fingerprint: str, namespace: str) -> list[CacheKey]:
    keys, parent = [], ""
    for start in range(0, len(ids) - chunk + 1, chunk):
        parent = hash_tokens(ids[start:start + chunk], parent)
        keys.append(CacheKey(fingerprint, CHAIN, parent, chunk, namespace))
    return keys


def prefill_prefix(model, store: KVStore, fingerprint: str, namespace: str, ids: list[int], chunk: int,
                   capacity: int, stats: RequestStats, prefill_chunk=None) -> Steps[DecodeState]:
    keys = chunk_keys(ids, chunk, fingerprint, namespace)
    usable = (len(ids) - 1) // chunk  # keep at least one token to prefill: it yields the logits
    t0 = time.perf_counter()
    hit_kvs = []
    for key in keys[:usable]:
        kv = store.get(key)
        if kv is None:
            break
        hit_kvs.append(kv)
    stats.fetch_ms += (time.perf_counter() - t0) * 1000
    stats.cache_hits += len(hit_kvs)
    stats.cache_misses += len(keys) - len(hit_kvs)
    cache = KVCache.for_model(model, max(capacity, len(ids)))
    reused = len(hit_kvs) * chunk
    if hit_kvs:
        for i in range(model.args.num_layers):
            cache.keys[i][0, :, :reused] = torch.cat([kv.keys[i] for kv in hit_kvs], dim=1)
            cache.values[i][0, :, :reused] = torch.cat([kv.values[i] for kv in hit_kvs], dim=1)
        cache.commit(reused)
    t0 = time.perf_counter()
    logits = yield from prefill_chunks(model, cache, ids[reused:], prefill_chunk)
    stats.query_prefill_ms += (time.perf_counter() - t0) * 1000
    for j in range(len(hit_kvs), len(keys)):
        a, b = j * chunk, (j + 1) * chunk
        store.put(keys[j], BlockKV(torch.stack([k[0, :, a:b] for k in cache.keys]).clone(),
                                   torch.stack([v[0, :, a:b] for v in cache.values]).clone()))
    stats.reused_tokens += reused
    stats.cached_tokens += reused
    stats.recomputed_tokens += len(ids) - reused
    return DecodeState(cache, len(ids), logits)


def keep_chunks(store: KVStore, fingerprint: str, namespace: str, ids: list[int], cache: KVCache, chunk: int) -> int:
    """Store the whole chunks of `ids` whose rows `cache` holds exactly (a prompt computed as `full` and the answer
    decoded after it: the next turn of a chat sends both back as its start) and the store lacks; returns how many.
    The answer's rows were computed one at a time by the decode step, not by a prefill: the same forward, equal to
    float rounding (vLLM's prefix cache keeps decoded blocks likewise)."""
    rows = min(len(ids), cache.length)
    keys = chunk_keys(ids[:rows], chunk, fingerprint, namespace)
    missing = [j for j, key in enumerate(keys) if not store.contains(key)]
    if not missing:
        return 0
    layers = [cache.layer(i) for i in range(len(cache.keys))]
    for j in missing:
        a, b = j * chunk, (j + 1) * chunk
        store.put(keys[j], BlockKV(torch.stack([k[0, :, a:b] for k, _ in layers]).clone(),
                                   torch.stack([v[0, :, a:b] for _, v in layers]).clone()))
    return len(missing)
