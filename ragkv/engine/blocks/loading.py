"""CacheBlend's loading controller (Yao et al., EuroSys'25, sec. 5.1), in one place: the cost model, the load
profiles and their file, the load schedule of a request's blocks and the placement of new blocks.

Per layer, loading a block's KV from a tier takes T_load = latency(tier) + bytes_per_layer / bandwidth(tier) (one
read per block and layer: a remote tier's round trip or a disk seek counts once per read) and recomputing a
fraction r of its tokens takes T_recompute(r) = r * n_tokens * t_token_layer (t_token_layer: prefill seconds per
token and layer, measured on this model and device). With pipelining (sec. 5) the two overlap, so a layer costs
max(T_load, T_recompute):
  - schedule (`LoadingPlanner.schedule`, every blend request): each block is read from the holder that loads it
    soonest, and r = max(r_min, r whose recompute the summed loading hides): extra recompute that loading hides is
    free. The schedule is reported in the request's stats;
  - placement (`LoadingPlanner.placement`, a newly encoded block): the cheapest tier whose loading still hides
    behind the recompute at r_min, else the fastest.

The profiles (each tier's latency and bandwidth, measured by ragkv/store/probe.py, and this model's recompute
cost) live in one JSON file, `cache_dir()/store_bandwidth.json`, written only by `StoreProfiles`. Nothing is
measured inside a request: the profiles are read at start-up (`StoreProfiles.load`) and measured by
`Engine.profile_store()` (the server runs it in the background at start-up; `ragkv store profile` on demand).
Until a profile exists, blend runs at r_min and its stats say why there is no schedule.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Union

import numpy as np
import torch

from ragkv.config import cache_dir, dtype_name
from ragkv.store.base import CacheKey
from ragkv.store.probe import TierProfile, measure_tier, profile_id, tier_layer_nbytes
from ragkv.store.spec import DEFAULT_COSTS

log = logging.getLogger(__name__)

PROFILE_FILE = "store_bandwidth.json"
RECOMPUTE_LENGTHS = (128, 512, 2048)  # prompt lengths the recompute cost is measured at, then interpolated
MAX_AGE_S = 7 * 24 * 3600             # a profile older than this is measured again at the next start-up
NO_PROFILE = "no load profile yet for this store and model (measured at server start-up or by `ragkv store profile`)"


# --- the cost model ---------------------------------------------------------------------------------------

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


def recompute_cost(points: list, tokens: int | None = None) -> float:
    """Seconds per token and layer at `tokens` from measured [length, cost] points (see StoreProfiles.recompute);
    at the middle length when `tokens` is None."""
    xs, ys = zip(*sorted(points))
    n = tokens if tokens is not None else xs[len(xs) // 2]
    if n > xs[-1] and len(xs) >= 2 and xs[-1] > xs[-2]:
        slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
        return float(ys[-1] + slope * (n - xs[-1]))
    return float(np.interp(n, xs, ys))


# --- the load schedule of a request's blocks --------------------------------------------------------------

@dataclass(frozen=True)
class LoadSchedule:
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


def schedule_loads(blocks: list[tuple[int, float | dict[str, float], dict[str, Speed]]], s_per_token_layer: float,
                   r_min: float = 0.15) -> LoadSchedule:
    """Per block (tokens, bytes per layer, {holding tier: bytes/s or (bytes/s, latency s)}): read each block from
    the holder that loads it soonest, then r = max(r_min, the r whose recompute time equals the summed per-layer
    load time) (CacheBlend sec. 5.1: extra recompute that loading hides is free). The bytes per layer may be
    {holding tier: bytes} where the holders keep the block in different sizes (compressed tiers)."""
    if not blocks or any(not holders for _, _, holders in blocks):
        raise ValueError("schedule_loads wants every block held by at least one profiled tier")
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
    return LoadSchedule(ratio, tuple(tiers), load * 1e3, recompute * 1e3, reason)


# --- the profiles and their file --------------------------------------------------------------------------

class StoreProfiles:
    """Saved measurements: load bytes/s and per-read latency per tier instance (`profile_id`), prefill
    s/token/layer per model. The only writer of the profile file; `path` None keeps them in memory only."""

    def __init__(self, path: Path | None, data: dict | None = None):
        self.path, self.data = (Path(path) if path is not None else None), dict(data or {})

    @classmethod
    def load(cls, path: Path | None = None) -> "StoreProfiles":
        path = Path(path) if path is not None else cache_dir() / PROFILE_FILE
        return cls(path, _read_json(path))

    def save(self) -> None:
        if self.path is not None:
            saved = _read_json(self.path)  # keep what other processes measured meanwhile
            _write_json(self.path, {**saved, **self.data})

    def restore(self, before: dict, keys) -> None:
        """Put the file's entries `keys` back to what they were in `before` (an earlier `data`; absent there:
        removed), keeping every other entry, also those other processes wrote meanwhile. A file that `before`
        found empty and that would be left empty is removed."""
        if self.path is None:
            return
        now = _read_json(self.path)
        keys = {k for k in keys if now.get(k) != before.get(k)}
        if not keys:
            return
        for k in keys:
            if k in before:
                now[k] = before[k]
            else:
                now.pop(k, None)
        self.data = dict(now)
        if now or before:
            _write_json(self.path, now)
        else:
            self.path.unlink(missing_ok=True)

    def forget(self, keys) -> None:
        """Remove the entries `keys` from the file (throwaway tiers of a benchmark)."""
        self.restore({}, keys)

    def measure_tiers(self, tiers: list, refresh: bool = False) -> list[TierProfile]:
        """Each tier's bandwidth and latency: from the file, or measured now and saved (those missing, saved
        before latency was measured, or stale; all with `refresh`)."""
        if self.path is not None:
            self.data.update(_read_json(self.path))  # what other processes measured meanwhile
        profiles, changed = [], False
        for tier in tiers:
            pid = profile_id(tier)
            entry = self.data.get(pid)
            if refresh or not _complete(entry) or self.stale(pid):
                measured = measure_tier(tier)
                entry = {"bytes_per_s": measured.bytes_per_s, "latency_s": measured.latency_s,
                         "measured_at": time.time()}
                self.data[pid], changed = entry, True
                log.info("profiled %s: %.2f GB/s, %.3f ms per read", pid, entry["bytes_per_s"] / 1e9,
                         entry["latency_s"] * 1e3)
            profiles.append(TierProfile(tier.name, float(entry["bytes_per_s"]), float(entry["latency_s"])))
        if changed:
            self.save()
        return profiles

    def bandwidth(self, tier) -> float | None:
        speed = self.speed(tier)
        return None if speed is None else speed[0]

    def speed(self, tier) -> tuple[float, float] | None:
        """(bytes/s, seconds of latency per layer read) of a profiled tier; None when not profiled."""
        entry = self.data.get(profile_id(tier))
        if not (isinstance(entry, dict) and isinstance(entry.get("bytes_per_s"), (int, float))):
            return None
        latency = entry.get("latency_s")
        return float(entry["bytes_per_s"]), float(latency) if isinstance(latency, (int, float)) else 0.0

    def recompute(self, model_key: str, tokens: int | None = None) -> float | None:
        """Prefill seconds per token and layer at `tokens`: linear between the measured lengths, the shortest's
        below them, and past the longest along the last two points' line, since attention keeps adding cost per
        token with length (clamped, a 3K prompt was priced at 2K's cost: 20% under, and r came out too high).
        None when never measured."""
        entry = self.data.get(model_key)
        points = entry.get("points") if isinstance(entry, dict) else None
        if not (isinstance(points, list) and points and all(isinstance(p, list) and len(p) == 2 for p in points)):
            return None
        return recompute_cost(points, tokens)

    def stale(self, key: str, max_age_s: float = MAX_AGE_S) -> bool:
        entry = self.data.get(key)
        return not isinstance(entry, dict) or time.time() - float(entry.get("measured_at", 0)) > max_age_s


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
        log.warning("ignoring unreadable load profile %s (%s); measuring again", path, e)
        return {}


def _write_json(path: Path, data: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not save the load profile to %s (%s); it will be measured again next time", path, e)


# --- the controller the engine calls ----------------------------------------------------------------------

class LoadingPlanner:
    """The engine's loading controller: measures the profiles (`profile`), schedules a request's loads
    (`schedule`) and places new blocks (`placement`)."""

    def __init__(self, model, store, profiles: StoreProfiles | None = None, fingerprint: str = ""):
        self.model, self.store = model, store
        self.profiles = profiles if profiles is not None else StoreProfiles(None)
        self.model_key = f"recompute:{fingerprint}:{dtype_name(model.dtype)}:{model.device.type}"

    def _tiers(self):
        from ragkv.store.tiered import TieredStore

        return self.store.tiers if isinstance(self.store, TieredStore) else []

    def profile(self, refresh: bool = False) -> dict:
        """Measure what is missing or stale (everything with `refresh`), save it, return the profile in use."""
        self.profile_tiers(refresh)
        for n in self.recompute_lengths(refresh):
            self.measure_recompute_at(n)
        return self.summary()

    def profile_tiers(self, refresh: bool = False) -> None:
        """Each tier's load bandwidth (missing or stale ones; all with `refresh`): no model needed."""
        tiers = self._tiers()
        if tiers:
            self.profiles.measure_tiers(tiers, refresh)

    def recompute_lengths(self, refresh: bool = False) -> list[int]:
        """Prompt lengths whose recompute cost is still to measure."""
        lengths = sorted({min(n, self.model.args.max_positions) for n in RECOMPUTE_LENGTHS})
        entry = self.profiles.data.get(self.model_key)
        if refresh or self.profiles.stale(self.model_key) or not isinstance(entry, dict):
            self.profiles.data[self.model_key] = {"points": [], "measured_at": time.time()}
            return lengths
        have = {p[0] for p in entry.get("points", []) if isinstance(p, list) and p}
        return [n for n in lengths if n not in have]

    def measure_recompute_at(self, tokens: int) -> None:
        """One point of the recompute cost: prefill seconds per token and layer at `tokens` (attention grows with
        length, so one short forward extrapolated linearly would understate long prompts); best of two after a
        warm-up."""
        for _ in self.measuring_recompute_at(tokens):
            pass

    def measuring_recompute_at(self, tokens: int):
        """`measure_recompute_at` as a generator that yields after each forward: a server runs each forward as its
        own unit of model work, so a request arriving meanwhile waits for one forward at most."""
        model = self.model
        ids = torch.randint(10, model.args.vocab_size - 1, (1, tokens), device=model.device)
        best = float("inf")
        with torch.inference_mode():
            model(ids[:, :min(tokens, 64)])
        yield
        for _ in range(2):
            with torch.inference_mode():
                t0 = time.perf_counter()
                model(ids)
                best = min(best, time.perf_counter() - t0)
            yield
        entry = self.profiles.data.setdefault(self.model_key, {"points": [], "measured_at": time.time()})
        entry["points"] = [p for p in entry.get("points", []) if p[0] != tokens] + \
            [[tokens, best / (tokens * model.args.num_layers)]]
        self.profiles.save()

    def summary(self) -> dict:
        entry = self.profiles.data.get(self.model_key) or {}
        return {"tiers": {t.describe(): self.profiles.bandwidth(t) for t in self._tiers()},
                "tier_latency_s": {t.describe(): (s or (None, None))[1]
                                   for t in self._tiers() for s in [self.profiles.speed(t)]},
                "s_per_token_layer": self.profiles.recompute(self.model_key),
                "recompute_points": sorted(entry.get("points", [])),
                "saved_to": str(self.profiles.path) if self.profiles.path is not None else None}

    def placement(self, num_tokens: int, r_quality: float) -> list[int] | None:
        """Where a newly encoded block goes (CacheBlend sec. 5.1, storage side): the cheapest tier whose loading
        still hides behind the recompute at r_quality, else the fastest; None (every tier) when no tier names a
        cost or nothing is profiled yet."""
        tiers = self._tiers()
        if not tiers or all(t.cost is None for t in tiers):
            return None
        s_token_layer = self.profiles.recompute(self.model_key, num_tokens)
        if s_token_layer is None:
            return None
        a = self.model.args
        budget = r_quality * num_tokens * s_token_layer
        best = None
        for i, t in enumerate(tiers):
            speed = self.profiles.speed(t)
            cost = t.cost if t.cost is not None else DEFAULT_COSTS.get(t.name, 1.0)
            nbytes = tier_layer_nbytes(t, a.num_kv_heads, num_tokens, a.head_dim, self.model.dtype)
            if speed is not None and load_seconds(nbytes, *speed) <= budget and (best is None or cost < best[0]):
                best = (cost, i)
        return [best[1] if best else 0]

    def schedule(self, keys: list[CacheKey], r_min: float) -> LoadSchedule | str | None:
        """The load schedule of a request's blocks (the tier each is read from, and r), a string saying why there
        is none, or None (no tiered store). Every block must be held by a profiled tier."""
        if not self._tiers() or not keys:
            return None
        s_token_layer = self.profiles.recompute(self.model_key, sum(k.num_tokens for k in keys))
        if s_token_layer is None:
            return NO_PROFILE
        a = self.model.args
        blocks = []
        for key in keys:
            held = [t for t in self.store.holders(key) if self.profiles.speed(t) is not None]
            if not held:
                return NO_PROFILE
            holders = {t.describe(): self.profiles.speed(t) for t in held}
            sizes = {t.describe(): tier_layer_nbytes(t, a.num_kv_heads, key.num_tokens, a.head_dim, self.model.dtype)
                     for t in held}  # a compressed tier loads fewer bytes
            blocks.append((key.num_tokens, sizes, holders))
        return schedule_loads(blocks, s_token_layer, r_min)
