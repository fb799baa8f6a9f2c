"""What loading a tier costs, measured with real reads: its per-read latency and its bandwidth (the inputs of the
engine's loading controller, engine/blocks/loading.py, which keeps them in its profile file; nothing here writes files).

Per layer, loading a block's KV from a tier takes latency(tier) + bytes_per_layer / bandwidth(tier): one read per
block and layer, so a remote tier's round trip or a disk seek counts once per read. Both figures come from reads of
a tiny and of a large synthetic entry.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from ragkv.store.base import BlockKV, CacheKey, KVStore
from ragkv.store.compress import layer_nbytes
from ragkv.store.errors import StoreError

PROBE_NAMESPACE = "ragkv-profile"
MAX_BANDWIDTH = 1e15  # bytes/s reported for reads too fast to time (in-memory views)


@dataclass(frozen=True)
class TierProfile:
    name: str           # tier kind: memory, disk, redis
    bytes_per_s: float  # measured per-layer load bandwidth
    latency_s: float = 0.0  # fixed cost of one layer read of one block (round trip, seek), on top of the bytes


def profile_id(tier: KVStore) -> str:
    """What the bandwidth depends on: the medium, where it is and its codec (decompression is part of a load),
    not its capacity."""
    codec = getattr(tier, "kv_codec", None)
    suffix = f"?kv={codec.name}" if codec else ""
    if tier.name == "memory":
        return "memory" + suffix
    if tier.name == "disk":
        return f"disk:{tier.root}" + suffix
    return tier.describe()


def tier_layer_nbytes(tier: KVStore, heads: int, tokens: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes `tier` moves to load one layer of a block: its codec's size in a compressed tier (?kv=int8: about
    half of bf16's), else K and V in `dtype`."""
    return layer_nbytes(getattr(tier, "kv_codec", None), heads, tokens, head_dim, dtype)


def _probe_read_seconds(tier: KVStore, tokens: int, num_layers: int, repeats: int) -> tuple[float, int]:
    """Best-of-`repeats` seconds to read a synthetic `tokens`-token entry layer by layer from `tier` (page cache
    dropped first where the tier allows it), and the bytes the tier keeps for it (less in a compressed tier).
    The probe is written and deleted again.

    Raises:
        StoreError: the tier would not keep the probe entry (capacity too small).
    """
    heads, dim, dtype = 2, 64, torch.float16
    g = torch.Generator().manual_seed(0)
    kv = BlockKV(torch.randn(num_layers, heads, tokens, dim, generator=g).to(dtype),
                 torch.randn(num_layers, heads, tokens, dim, generator=g).to(dtype))
    key = CacheKey("bandwidth-probe", "none", f"probe-{kv.nbytes}", tokens, PROBE_NAMESPACE)
    tier.put(key, kv)
    try:
        if not tier.contains(key):
            raise StoreError(f"cannot profile {tier.describe()}: it did not keep a {kv.nbytes}-byte probe entry "
                             "(capacity too small?)")
        best = math.inf
        for _ in range(repeats):
            if hasattr(tier, "drop_page_cache"):
                tier.drop_page_cache(key)
            t0 = time.perf_counter()
            reader = tier.open_layers(key)
            with reader:
                for i in range(num_layers):
                    reader.read(i)
            best = min(best, time.perf_counter() - t0)
    finally:
        tier.delete(key)
    return best, num_layers * tier_layer_nbytes(tier, heads, tokens, dim, dtype)  # what it stored: its codec's size


def measure_tier(tier: KVStore, nbytes: int = 16 << 20, num_layers: int = 8, repeats: int = 3) -> TierProfile:
    """A tier's per-read latency (reads of a 1-token entry: almost no bytes) and its bandwidth (an `nbytes` entry,
    its time less that latency per layer read). One big probe alone would miss the latency that every block's
    every layer read pays, and price a tier holding many small blocks too low."""
    small_s, _ = _probe_read_seconds(tier, 1, num_layers, repeats)
    latency = small_s / num_layers
    capacity = getattr(tier, "capacity_bytes", None)
    if capacity:  # leave room: the probe must not be refused nor evict much
        nbytes = min(nbytes, capacity // 4)
    tokens = max(1, nbytes // (2 * num_layers * 2 * 64 * 2))
    big_s, big_bytes = _probe_read_seconds(tier, tokens, num_layers, repeats)
    transfer = max(big_s - num_layers * latency, 0.05 * big_s)  # noise may leave (almost) nothing of the bytes
    bw = MAX_BANDWIDTH if transfer <= 0 else min(MAX_BANDWIDTH, big_bytes / transfer)
    return TierProfile(tier.name, bw, latency)
