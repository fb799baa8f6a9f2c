"""CacheBlend's loading controller in the request path (Yao et al. 2025, sec. 5.1).

Given the tiers holding a request's blocks (bandwidth profiled once per tier) and the engine's measured
prefill cost per token and layer, pick the cheapest tier whose per-layer loading hides behind the recompute
and the ratio r = max(r_min, r that the loading hides). The plan is reported in every blend request's stats.
"""

from __future__ import annotations

import time

import torch

from ragkv.store.base import CacheKey


class LoadingPlanner:
    def __init__(self, engine):
        self.engine = engine
        self._s_per_token_layer: float | None = None
        self._profiles = None

    def s_per_token_layer(self) -> float:
        """Prefill seconds per token and layer, measured once on a 256-token forward."""
        if self._s_per_token_layer is None:
            model = self.engine.model
            ids = torch.randint(10, model.args.vocab_size - 1, (1, 256), device=model.device)
            with torch.inference_mode():
                model(ids)
                t0 = time.perf_counter()
                model(ids)
            self._s_per_token_layer = (time.perf_counter() - t0) / (256 * model.args.num_layers)
        return self._s_per_token_layer

    def plan(self, keys: list[CacheKey], r_min: float):
        from ragkv.store.controller import plan_load, profile_tiers
        from ragkv.store.tiered import TieredStore

        store = self.engine.store
        if not isinstance(store, TieredStore) or not keys:
            return None
        if self._profiles is None:
            self._profiles = {p.name: p for p in profile_tiers(store.tiers)}
        holding = {store.locate(k) for k in keys} - {None}
        tiers = [p for name, p in self._profiles.items() if name in holding or not holding]
        a = self.engine.model.args
        elem = self.engine.model.dtype.itemsize
        tokens = sum(k.num_tokens for k in keys)
        bytes_per_layer = 2 * a.num_kv_heads * a.head_dim * tokens * elem
        return plan_load(tiers, bytes_per_layer, tokens, self.s_per_token_layer(), r_min)
