"""Prefill onto a KV cache: the exact causal forward of a token sequence after what the cache holds, in units a
scheduler can interleave with other requests' steps. `full` is this over the whole prompt; the prefix cache and the
fusion modes run it over what they reuse."""

from __future__ import annotations

import time

import torch

from ragkv.engine.kv.kvcache import KVCache
from ragkv.engine.kv.state import DecodeState
from ragkv.engine.kv.stepwise import Steps
from ragkv.engine.measure.stats import RequestStats
from ragkv.models.loop import computed


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def prefill_chunks(model, cache: KVCache, ids: list[int], chunk) -> Steps[torch.Tensor]:
    """Causal prefill of `ids` after what `cache` holds, in units of `chunk` tokens (an int, None for all at
    once, or a function giving the size for the next unit: a scheduler chunks only while others decode);
    returns the last token's logits [V]. A model with `forward_rows` (an exact decode copy, models/quant.py) runs
    each unit in forwards of at most that many rows: its kernels are fastest there, and the activations stay in
    cache (a 1.5K-token prefill 0.73x one forward's time on Zen 3, docs/results/serve_vllm/s22)."""
    a, rows = 0, getattr(model, "forward_rows", None)
    while a < len(ids):
        step = min((chunk() if callable(chunk) else chunk) or len(ids) - a, len(ids) - a)
        unit = rows or step
        for b in range(a, a + step, unit):
            part = ids[b:min(a + step, b + unit)]
            with torch.inference_mode():
                fwd = model.causal_forward(torch.tensor([part], device=model.device), cache=cache)
            x = yield from computed(fwd)  # run alone, or in one pass with the decode rows (a server's step)
            cache.commit(len(part))
            with torch.inference_mode():
                logits = model.logits(x[:, -1:])[0, -1]
        a += step
        if a < len(ids):
            yield
    return logits


def prefill_full(model, ids: list[int], capacity: int, stats: RequestStats, chunk=None) -> Steps[DecodeState]:
    """Ordinary prefill of the whole sequence: the quality reference."""
    t0 = time.perf_counter()
    cache = KVCache.for_model(model, capacity)
    logits = yield from prefill_chunks(model, cache, ids, chunk)
    stats.recompute_ms += _ms(t0)
    stats.recomputed_tokens += len(ids)
    return DecodeState(cache, len(ids), logits)
