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

import torch

from ragkv.config import cache_dir, dtype_name
from ragkv.store.base import CacheKey
from ragkv.store.controller import (PROFILE_FILE, TierProfile, _read_json, _write_json, plan_load, profile_id,
                                    profile_tiers)

NO_PROFILE = "no load profile yet for this store and model (measured at server start-up or by `ragkv store profile`)"


class StoreProfiles:
    """Saved measurements: load bytes/s per tier instance (`profile_id`), prefill s/token/layer per model."""

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
        entry = self.data.get(profile_id(tier))
        ok = isinstance(entry, dict) and isinstance(entry.get("bytes_per_s"), (int, float))
        return float(entry["bytes_per_s"]) if ok else None

    def recompute(self, model_key: str) -> float | None:
        entry = self.data.get(model_key)
        ok = isinstance(entry, dict) and isinstance(entry.get("s_per_token_layer"), (int, float))
        return float(entry["s_per_token_layer"]) if ok else None


class LoadingPlanner:
    def __init__(self, model, store, profiles: StoreProfiles | None = None, fingerprint: str = ""):
        self.model, self.store = model, store
        self.profiles = profiles if profiles is not None else StoreProfiles(Path("/nonexistent"), {})
        self.model_key = f"recompute:{fingerprint}:{dtype_name(model.dtype)}:{model.device.type}"

    def _tiers(self):
        from ragkv.store.tiered import TieredStore

        return self.store.tiers if isinstance(self.store, TieredStore) else []

    def profile(self, refresh: bool = False) -> dict:
        """Measure what is missing (everything with `refresh`), save it, and return the profile in use."""
        if self._tiers():  # measures the tiers missing from the file (all with `refresh`) and saves them
            profile_tiers(self._tiers(), self.profiles.path, refresh)
            self.profiles.data.update(StoreProfiles.load(self.profiles.path).data)
        if refresh or self.profiles.recompute(self.model_key) is None:
            self.profiles.data[self.model_key] = {"s_per_token_layer": self._measure_recompute(),
                                                  "measured_at": time.time()}
        self.profiles.save()
        return {"tiers": {t.describe(): self.profiles.bandwidth(t) for t in self._tiers()},
                "s_per_token_layer": self.profiles.recompute(self.model_key), "saved_to": str(self.profiles.path)}

    def _measure_recompute(self, tokens: int = 256) -> float:
        """Prefill seconds per token and layer, on a `tokens`-long forward (after one warm-up)."""
        model = self.model
        ids = torch.randint(10, model.args.vocab_size - 1, (1, tokens), device=model.device)
        with torch.inference_mode():
            model(ids)
            t0 = time.perf_counter()
            model(ids)
        return (time.perf_counter() - t0) / (tokens * model.args.num_layers)

    def plan(self, keys: list[CacheKey], r_min: float):
        """The plan for a request's blocks, a string saying why there is none, or None (no tiered store)."""
        tiers = self._tiers()
        if not tiers or not keys:
            return None
        s_token_layer = self.profiles.recompute(self.model_key)
        holding = {self.store.locate(k) for k in keys} - {None}
        profiles = [TierProfile(t.name, bw) for t in tiers if (bw := self.profiles.bandwidth(t)) is not None
                    and (t.name in holding or not holding)]
        if s_token_layer is None or not profiles:
            return NO_PROFILE
        a = self.model.args
        tokens = sum(k.num_tokens for k in keys)
        bytes_per_layer = 2 * a.num_kv_heads * a.head_dim * tokens * self.model.dtype.itemsize
        return plan_load(profiles, bytes_per_layer, tokens, s_token_layer, r_min)
