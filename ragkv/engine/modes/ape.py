"""`ape`: Adaptive Parallel Encoding (Yang, Chen, Chen). Blocks encoded after the shared prefix share one position
range; the query's attention over the blocks takes a temperature T and a scale S (appendix C.4's joint merge,
engine/fusion/ape.py), in prefill and in every decode step. T = S = 1 on the sequential layout equals `reuse` (invariant 7)."""

from __future__ import annotations

from ragkv.engine.blocks.encode import prefix_conditioning
from ragkv.engine.fusion.ape import ApeAttention
from ragkv.engine.fusion.context import prefill_over_context
from ragkv.engine.fusion.shared_attention import prefill_shared
from ragkv.engine.measure.estimates import population_estimate
from ragkv.engine.modes.base import BlockMode
from ragkv.engine.modes.registry import register


@register
class Ape(BlockMode):
    name = "ape"
    summary = "blocks encoded after a shared prefix, sharing one position range; context attention scaled by T, S"
    option_fields = ("ape_temperature", "ape_scale", "kv_layout")
    shares_positions = True

    def conditioning(self, segs, fusion):
        return prefix_conditioning(segs.prefix)  # always: the paper's shared prefix

    def layout_kind(self, fusion):
        return "shared"

    def fidelity(self, fusion, stats):
        return {"mode": self.name, "exact": False, "temperature": stats.extra.get("ape_temperature"),
                "scale": stats.extra.get("ape_scale"), "kv_layout": fusion.kv_layout, "signal": None,
                "estimate": population_estimate("ape")}

    def _params(self, ctx, fusion, stats) -> tuple[float, float]:
        T = fusion.ape_temperature if fusion.ape_temperature is not None else ctx.ape_temperature
        S = fusion.ape_scale if fusion.ape_scale is not None else ctx.ape_scale
        stats.extra.update(ape_temperature=T, ape_scale=S)
        return T, S

    def fuse(self, ctx, segs, fusion, layout, layer_iter, capacity, stats):
        T, S = self._params(ctx, fusion, stats)
        attention = ApeAttention(len(segs.prefix), layout.context_len - len(segs.prefix), T, S)
        return (yield from prefill_over_context(ctx.forward_model, layer_iter, layout, segs.query, capacity, stats,
                                                attention))

    def fuse_in_place(self, ctx, segs, fusion, layout, pooled, capacity, stats):
        T, S = self._params(ctx, fusion, stats)
        return (yield from prefill_shared(ctx.forward_model, pooled, layout, segs.query, capacity, stats,
                                          context_from=1 if segs.prefix else 0, temperature=T, scale=S))
