"""`full`: prefill the whole token sequence, no reuse. The reference every other mode is measured against."""

from __future__ import annotations

from ragkv.engine.kv.prefill import prefill_full
from ragkv.engine.measure.flops import head_flops, rows_flops
from ragkv.engine.modes.base import FusionMode
from ragkv.engine.modes.registry import register


@register
class Full(FusionMode):
    name = "full"
    summary = "a normal prefill of the whole prompt (the reference)"
    is_reference = True
    always_exact = True

    def fidelity(self, fusion, stats):
        return {"mode": self.name, "exact": True}

    def prefill(self, ctx, segs, fusion, capacity, stats, ns, chunk, blocks):
        ctx.check_length(segs.num_tokens, "prompt")
        return (yield from prefill_full(ctx.forward_model, segs.all_ids(), capacity, stats, chunk))

    def first_token_flops(self, a, fusion, context, query, prefix_len=0, reused=0):
        return rows_flops(a, 0, context + query, a.num_layers) + head_flops(a)
