"""CacheBlend's loading controller (Yao et al., EuroSys'25, sec. 5.1): pick the recompute ratio that loading
hides and the cheapest storage tier whose loading does not add latency.

Per layer, loading a block's KV from a tier takes T_load = bytes_per_layer / bandwidth(tier) and recomputing a
fraction r of its tokens takes T_recompute(r) = r * n_tokens * t_token_layer (linear prefill model; the caller
measures t_token_layer, seconds per token per layer, on its own model and device). With pipelining (sec. 5) the
two overlap, so a layer costs max(T_load, T_recompute):
  - ratio: r = max(r_min, largest r with T_recompute(r) <= T_load): extra recompute that loading hides is free;
  - tier: the slowest (cheapest) tier with T_load <= T_recompute(r_min); if none, the fastest.
Bandwidths are profiled once per tier with a real read of a synthetic entry and kept in a JSON file.
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

import torch

from ragkv.config import cache_dir
from ragkv.store.base import BlockKV, CacheKey, KVStore
from ragkv.store.errors import StoreError

log = logging.getLogger(__name__)

PROFILE_FILE = "store_bandwidth.json"
PROBE_NAMESPACE = "ragkv-profile"
MAX_BANDWIDTH = 1e15  # bytes/s reported for reads too fast to time (in-memory views)


@dataclass(frozen=True)
class TierProfile:
    name: str           # tier kind: memory, disk, redis
    bytes_per_s: float  # measured per-layer load bandwidth


@dataclass(frozen=True)
class LoadPlan:
    ratio: float                   # fraction of block tokens to recompute
    tier: str | None               # tier to load from (None: no tier given)
    load_ms_per_layer: float
    recompute_ms_per_layer: float
    reason: str

    def as_dict(self) -> dict:
        return asdict(self)


def load_seconds(bytes_per_layer: float, bytes_per_s: float) -> float:
    """T_load for one layer."""
    if bytes_per_s <= 0:
        raise ValueError(f"bandwidth must be positive, got {bytes_per_s}")
    return bytes_per_layer / bytes_per_s


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
    by_speed = sorted(tiers, key=lambda t: t.bytes_per_s)
    for t in by_speed:
        if load_seconds(bytes_per_layer, t.bytes_per_s) <= recompute_s:
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
    load = load_seconds(bytes_per_layer, tier.bytes_per_s)
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


def plan_blocks(blocks: list[tuple[int, float, dict[str, float]]], s_per_token_layer: float,
                r_min: float = 0.15) -> BlockPlan:
    """Per block (tokens, bytes per layer, {holding tier: bytes/s}): read each block from the holder that loads it
    fastest, then r = max(r_min, the r whose recompute time equals the summed per-layer load time) (CacheBlend
    sec. 5.1: extra recompute that loading hides is free)."""
    if not blocks or any(not holders for _, _, holders in blocks):
        raise ValueError("plan_blocks wants every block held by at least one profiled tier")
    tiers, load = [], 0.0
    for _, nbytes, holders in blocks:
        best = max(holders, key=holders.get)
        tiers.append(best)
        load += load_seconds(nbytes, holders[best])
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
    """What the bandwidth depends on: the medium and where it is, not its capacity."""
    if tier.name == "memory":
        return "memory"
    if tier.name == "disk":
        return f"disk:{tier.root}"
    return tier.describe()


def measure_bandwidth(tier: KVStore, nbytes: int = 16 << 20, num_layers: int = 8, repeats: int = 3) -> float:
    """Bytes/s of reading a synthetic entry layer by layer from `tier` (best of `repeats`, page cache dropped
    first where the tier allows it). The probe entry is written and deleted again.

    Raises:
        StoreError: the tier would not keep the probe entry (capacity below `nbytes`).
    """
    heads, dim, dtype = 2, 64, torch.float16
    capacity = getattr(tier, "capacity_bytes", None)
    if capacity:  # leave room: the probe must not be refused nor evict much
        nbytes = min(nbytes, capacity // 4)
    tokens = max(1, nbytes // (2 * num_layers * heads * dim * 2))
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
    return MAX_BANDWIDTH if best <= 0 else min(MAX_BANDWIDTH, kv.nbytes / best)


def profile_tiers(tiers: list[KVStore], path: Path | None = None, refresh: bool = False) -> list[TierProfile]:
    """Measured bandwidth of each tier, from the JSON cache (`cache_dir()/store_bandwidth.json`) or measured
    now and saved there."""
    path = Path(path) if path is not None else cache_dir() / PROFILE_FILE
    saved = {} if refresh else _read_json(path)
    profiles, changed = [], False
    for tier in tiers:
        pid = profile_id(tier)
        entry = saved.get(pid)
        if not isinstance(entry, dict) or not isinstance(entry.get("bytes_per_s"), (int, float)):
            entry = {"bytes_per_s": measure_bandwidth(tier), "measured_at": time.time()}
            saved[pid], changed = entry, True
            log.info("profiled %s: %.2f GB/s", pid, entry["bytes_per_s"] / 1e9)
        profiles.append(TierProfile(tier.name, float(entry["bytes_per_s"])))
    if changed:
        _write_json(path, saved)
    return profiles


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
