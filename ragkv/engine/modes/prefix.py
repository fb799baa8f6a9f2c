"""`prefix`: reuse the longest cached exact token prefix (hash-chained chunks, as vLLM and SGLang), prefill the
rest. Exact: equals `full` (invariant 3)."""

from __future__ import annotations

from ragkv.engine.blocks.encode import EnsureResult
from ragkv.engine.blocks.prefix_cache import chunk_keys, prefill_prefix
from ragkv.engine.kv.stepwise import drain
from ragkv.engine.measure.flops import head_flops, rows_flops
from ragkv.engine.measure.stats import RequestStats
from ragkv.engine.modes.base import FusionMode
from ragkv.engine.modes.registry import register


@register
class Prefix(FusionMode):
    name = "prefix"
    summary = "the longest cached exact token prefix (hash-chained chunks), the rest prefilled; equals full"
    option_fields = ("prefix_chunk",)
    always_exact = True

    def cache_keys(self, ctx, segs, fusion, ns):
        return chunk_keys(segs.all_ids(), fusion.prefix_chunk, ctx.fingerprint, ns)

    def shared_key_count(self, segs, fusion):
        return len(segs.prefix) // fusion.prefix_chunk

    def warm(self, ctx, segs, fusion, ns):
        """Prefill the context (prefix and blocks, no query) once, storing its full chunks."""
        ids = segs.prefix + [t for b in segs.blocks for t in b]
        if not ids:
            return EnsureResult([], 0, 0, 0.0)
        stats = RequestStats(mode=self.name)
        drain(prefill_prefix(ctx.forward_model, ctx.store, ctx.fingerprint, ns, ids, fusion.prefix_chunk,
                             len(ids), stats))
        keys = chunk_keys(ids, fusion.prefix_chunk, ctx.fingerprint, ns)
        return EnsureResult(keys, stats.cache_hits, stats.cache_misses, stats.query_prefill_ms,
                            hit_tokens=stats.cached_tokens)

    def fidelity(self, fusion, stats):
        return {"mode": self.name, "exact": True, "cached_prefix_tokens": stats.reused_tokens}

    def prefill(self, ctx, segs, fusion, capacity, stats, ns, chunk, blocks):
        ctx.check_length(segs.num_tokens, "prompt")
        return (yield from prefill_prefix(ctx.forward_model, blocks.store, ctx.fingerprint, ns, segs.all_ids(),
                                          fusion.prefix_chunk, capacity, stats, chunk))

    def first_token_flops(self, a, fusion, context, query, prefix_len=0, reused=0):
        return rows_flops(a, reused, context + query - reused, a.num_layers) + head_flops(a)
