"""CacheBlend's loading controller in the request path (Yao et al. 2025, sec. 5.1).

Given the tiers holding a request's blocks (their load bandwidth) and the model's prefill cost per token and
layer, pick the cheapest tier whose per-layer loading hides behind the recompute and the ratio
r = max(r_min, r that the loading hides). The plan is reported in every blend request's stats.

Nothing is measured inside a request: the profiles are read at start-up (`StoreProfiles.load`) and measured by
`Engine.profile_store()` (the server runs it in the background at start-up; `ragkv store profile` on demand).
Until a profile exists, blend runs at r_min and its stats say why there is no plan.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from ragkv.config import cache_dir, dtype_name
from ragkv.store.base import CacheKey
from ragkv.store.controller import (PROFILE_FILE, _read_json, _write_json, load_seconds, plan_blocks, profile_id,
                                    profile_tiers, tier_layer_nbytes)
from ragkv.store.spec import DEFAULT_COSTS

RECOMPUTE_LENGTHS = (128, 512, 2048)  # prompt lengths the recompute cost is measured at, then interpolated
MAX_AGE_S = 7 * 24 * 3600             # a profile older than this is measured again at the next start-up
NO_PROFILE = "no load profile yet for this store and model (measured at server start-up or by `ragkv store profile`)"


def recompute_cost(points: list, tokens: int | None = None) -> float:
    """Seconds per token and layer at `tokens` from measured [length, cost] points (see StoreProfiles.recompute);
    at the middle length when `tokens` is None."""
    xs, ys = zip(*sorted(points))
    n = tokens if tokens is not None else xs[len(xs) // 2]
    if n > xs[-1] and len(xs) >= 2 and xs[-1] > xs[-2]:
        slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
        return float(ys[-1] + slope * (n - xs[-1]))
    return float(np.interp(n, xs, ys))


class StoreProfiles:
    """Saved measurements: load bytes/s and per-read latency per tier instance (`profile_id`), prefill s/token/layer per model."""

    def __init__(self, path: Path, data: dict | None = None):
        self.path, self.data = Path(path), dict(data or {})

    @classmethod
    def load(cls, path: Path | None = None) -> "StoreProfiles":
        path = Path(path) if path is not None else cache_dir() / PROFILE_FILE
        return cls(path, _read_json(path))

    def save(self) -> None:
        saved = _read_json(self.path)  # keep what other processes measured meanwhile
        _write_json(self.path, {**saved, **self.data})

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


class LoadingPlanner:
    def __init__(self, model, store, profiles: StoreProfiles | None = None, fingerprint: str = ""):
        self.model, self.store = model, store
        self.profiles = profiles if profiles is not None else StoreProfiles(Path("/nonexistent"), {})
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
        if tiers:  # profile_tiers measures the tiers missing from the file and saves them
            # saved but old (a tier missing from the file is measured once, by the first call below)
            stale = [t for t in tiers if profile_id(t) in self.profiles.data and self.profiles.stale(profile_id(t))]
            profile_tiers(tiers, self.profiles.path, refresh)
            if stale and not refresh:
                profile_tiers(stale, self.profiles.path, refresh=True)
            self.profiles.data.update(StoreProfiles.load(self.profiles.path).data)

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
        warm-up. One short unit of model work: a server runs each as its own job."""
        model = self.model
        ids = torch.randint(10, model.args.vocab_size - 1, (1, tokens), device=model.device)
        best = float("inf")
        with torch.inference_mode():
            model(ids[:, :min(tokens, 64)])
            for _ in range(2):
                t0 = time.perf_counter()
                model(ids)
                best = min(best, time.perf_counter() - t0)
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
                "recompute_points": sorted(entry.get("points", [])), "saved_to": str(self.profiles.path)}

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

    def plan(self, keys: list[CacheKey], r_min: float):
        """The plan for a request's blocks (the tier each is read from, and r), a string saying why there is
        none, or None (no tiered store). Every block must be held by a profiled tier."""
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
        return plan_blocks(blocks, s_token_layer, r_min)
