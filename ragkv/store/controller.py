"""CacheBlend's loading controller (Yao et al., EuroSys'25, sec. 5.1): pick the recompute ratio that loading
hides and the cheapest storage tier whose loading does not add latency.

Per layer, loading a block's KV from a tier takes T_load = latency(tier) + bytes_per_layer / bandwidth(tier) (one
read per block and layer: a remote tier's round trip or a disk seek counts once per read) and recomputing a
fraction r of its tokens takes T_recompute(r) = r * n_tokens * t_token_layer (linear prefill model; the caller
measures t_token_layer, seconds per token per layer, on its own model and device). With pipelining (sec. 5) the
two overlap, so a layer costs max(T_load, T_recompute):
  - ratio: r = max(r_min, largest r with T_recompute(r) <= T_load): extra recompute that loading hides is free;
  - tier: the slowest (cheapest) tier with T_load <= T_recompute(r_min); if none, the fastest.
Latency and bandwidth are profiled once per tier with real reads of a tiny and of a large synthetic entry and kept
in a JSON file.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Union

import torch

from ragkv.config import cache_dir
from ragkv.store.base import BlockKV, CacheKey, KVStore
from ragkv.store.compress import layer_nbytes
from ragkv.store.errors import StoreError

log = logging.getLogger(__name__)

PROFILE_FILE = "store_bandwidth.json"
PROBE_NAMESPACE = "ragkv-profile"
MAX_BANDWIDTH = 1e15  # bytes/s reported for reads too fast to time (in-memory views)


@dataclass(frozen=True)
class TierProfile:
    name: str           # tier kind: memory, disk, redis
    bytes_per_s: float  # measured per-layer load bandwidth
    latency_s: float = 0.0  # fixed cost of one layer read of one block (round trip, seek), on top of the bytes


@dataclass(frozen=True)
class LoadPlan:
    ratio: float                   # fraction of block tokens to recompute
    tier: str | None               # tier to load from (None: no tier given)
    load_ms_per_layer: float
    recompute_ms_per_layer: float
    reason: str

    def as_dict(self) -> dict:
        return asdict(self)


def load_seconds(bytes_per_layer: float, bytes_per_s: float, latency_s: float = 0.0) -> float:
    """T_load for one layer read: the tier's fixed latency plus the bytes at its bandwidth."""
    if bytes_per_s <= 0 or latency_s < 0:
        raise ValueError(f"bandwidth must be positive and latency non-negative, got {bytes_per_s}, {latency_s}")
    return latency_s + bytes_per_layer / bytes_per_s


def recompute_seconds(ratio: float, num_tokens: int, s_per_token_layer: float) -> float:
    """T_recompute(r) for one layer: r * n_tokens * t_token_layer."""
    return ratio * num_tokens * s_per_token_layer


def hidden_ratio(load_s: float, num_tokens: int, s_per_token_layer: float) -> float:
    """Largest r in [0, 1] whose recompute time fits within `load_s`."""
    work = num_tokens * s_per_token_layer
    return 1.0 if work <= 0 else min(1.0, max(0.0, load_s / work))


def choose_ratio(load_s: float, num_tokens: int, s_per_token_layer: float, r_min: float = 0.15) -> float:
    """r = max(r_min, r that loading hides) (CacheBlend sec. 5.1)."""
    if not 0.0 <= r_min <= 1.0:
        raise ValueError(f"r_min must be in [0, 1], got {r_min}")
    return max(r_min, hidden_ratio(load_s, num_tokens, s_per_token_layer))


def choose_tier(tiers: list[TierProfile], bytes_per_layer: float, recompute_s: float) -> tuple[TierProfile, bool]:
    """The slowest (cheapest) tier whose per-layer load fits within `recompute_s`, and True; else the fastest
    tier and False (loading will add latency)."""
    if not tiers:
        raise ValueError("choose_tier needs at least one tier")
    by_speed = sorted(tiers, key=lambda t: -load_seconds(bytes_per_layer, t.bytes_per_s, t.latency_s))
    for t in by_speed:
        if load_seconds(bytes_per_layer, t.bytes_per_s, t.latency_s) <= recompute_s:
            return t, True
    return by_speed[-1], False


def plan_load(tiers: list[TierProfile], bytes_per_layer: float, num_tokens: int, s_per_token_layer: float,
              r_min: float = 0.15) -> LoadPlan:
    """Tier and recompute ratio for blocks of `num_tokens` tokens (all blocks of a request together) whose KV is
    `bytes_per_layer` per layer, among `tiers` (those holding the blocks)."""
    if s_per_token_layer < 0 or num_tokens < 0 or bytes_per_layer < 0:
        raise ValueError("plan_load wants non-negative sizes and times")
    budget = recompute_seconds(r_min, num_tokens, s_per_token_layer)
    tier, hidden = choose_tier(tiers, bytes_per_layer, budget)
    load = load_seconds(bytes_per_layer, tier.bytes_per_s, tier.latency_s)
    ratio = choose_ratio(load, num_tokens, s_per_token_layer, r_min)
    recompute = recompute_seconds(ratio, num_tokens, s_per_token_layer)
    if hidden:  # then the hidden ratio is at most r_min, so r = r_min
        reason = (f"{tier.name} is the cheapest tier whose loading ({load * 1e3:.3f} ms/layer) hides behind "
                  f"recompute at r_min={r_min}")
    else:
        reason = (f"no tier loads within recompute at r_min={r_min}; the fastest, {tier.name}, takes "
                  f"{load * 1e3:.3f} ms/layer, so r is raised to {ratio:.3f}")
        if load > recompute:
            reason += f" and loading still adds {(load - recompute) * 1e3:.3f} ms/layer"
    return LoadPlan(ratio, tier.name, load * 1e3, recompute * 1e3, reason)


@dataclass(frozen=True)
class BlockPlan:
    ratio: float                   # fraction of block tokens to recompute
    tiers: tuple[str, ...]         # per block, the tier (description) it is read from
    load_ms_per_layer: float
    recompute_ms_per_layer: float
    reason: str

    def as_dict(self) -> dict:
        return asdict(self)


Speed = Union[float, tuple[float, float]]  # a holder's bytes/s, or (bytes/s, latency s per read)


def _read_seconds(nbytes: float, speed) -> float:
    bw, latency = speed if isinstance(speed, tuple) else (speed, 0.0)
    return load_seconds(nbytes, bw, latency)


def tier_layer_nbytes(tier: KVStore, heads: int, tokens: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes `tier` moves to load one layer of a block: its codec's size in a compressed tier (?kv=int8: about
    half of bf16's), else K and V in `dtype`."""
    return layer_nbytes(getattr(tier, "kv_codec", None), heads, tokens, head_dim, dtype)


def plan_blocks(blocks: list[tuple[int, float | dict[str, float], dict[str, Speed]]], s_per_token_layer: float,
                r_min: float = 0.15) -> BlockPlan:
    """Per block (tokens, bytes per layer, {holding tier: bytes/s or (bytes/s, latency s)}): read each block from
    the holder that loads it soonest, then r = max(r_min, the r whose recompute time equals the summed per-layer
    load time) (CacheBlend sec. 5.1: extra recompute that loading hides is free). The bytes per layer may be
    {holding tier: bytes} where the holders keep the block in different sizes (compressed tiers)."""
    if not blocks or any(not holders for _, _, holders in blocks):
        raise ValueError("plan_blocks wants every block held by at least one profiled tier")
    tiers, load = [], 0.0
    for _, nbytes, holders in blocks:
        size = nbytes if isinstance(nbytes, dict) else dict.fromkeys(holders, nbytes)
        best = min(holders, key=lambda t: _read_seconds(size[t], holders[t]))
        tiers.append(best)
        load += _read_seconds(size[best], holders[best])
    tokens = sum(n for n, _, _ in blocks)
    ratio = choose_ratio(load, tokens, s_per_token_layer, r_min)
    recompute = recompute_seconds(ratio, tokens, s_per_token_layer)
    if ratio > r_min:
        reason = f"loading takes {load * 1e3:.3f} ms/layer, so r rises to {ratio:.3f}, which it hides"
    else:
        reason = f"loading ({load * 1e3:.3f} ms/layer) hides behind recompute at r_min={r_min}"
    if load > recompute:
        reason += f"; loading still adds {(load - recompute) * 1e3:.3f} ms/layer"
    return BlockPlan(ratio, tuple(tiers), load * 1e3, recompute * 1e3, reason)


# --- bandwidth profiling ----------------------------------------------------------------------------------

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


def measure_bandwidth(tier: KVStore, nbytes: int = 16 << 20, num_layers: int = 8, repeats: int = 3) -> float:
    """Bytes/s of reading `tier` (see `measure_tier`, which also gives the per-read latency)."""
    return measure_tier(tier, nbytes, num_layers, repeats).bytes_per_s


def profile_tiers(tiers: list[KVStore], path: Path | None = None, refresh: bool = False) -> list[TierProfile]:
    """Measured bandwidth and latency of each tier, from the JSON cache (`cache_dir()/store_bandwidth.json`) or
    measured now and saved there (also an entry saved before latency was measured)."""
    path = Path(path) if path is not None else cache_dir() / PROFILE_FILE
    saved = {} if refresh else _read_json(path)
    profiles, changed = [], False
    for tier in tiers:
        pid = profile_id(tier)
        entry = saved.get(pid)
        if not _complete(entry):
            measured = measure_tier(tier)
            entry = {"bytes_per_s": measured.bytes_per_s, "latency_s": measured.latency_s, "measured_at": time.time()}
            saved[pid], changed = entry, True
            log.info("profiled %s: %.2f GB/s, %.3f ms per read", pid, entry["bytes_per_s"] / 1e9,
                     entry["latency_s"] * 1e3)
        profiles.append(TierProfile(tier.name, float(entry["bytes_per_s"]), float(entry["latency_s"])))
    if changed:
        _write_json(path, saved)
    return profiles


def _complete(entry) -> bool:
    """A saved tier profile with both figures (older files have no latency: measured again)."""
    return isinstance(entry, dict) and all(isinstance(entry.get(k), (int, float)) for k in ("bytes_per_s", "latency_s"))


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("ignoring unreadable bandwidth profile %s (%s); measuring again", path, e)
        return {}


def _write_json(path: Path, data: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not save the bandwidth profile to %s (%s); it will be measured again next time", path, e)
