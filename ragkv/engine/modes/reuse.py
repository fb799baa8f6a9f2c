"""`reuse`: every block's independently computed KV, re-rotated to its place, the query prefilled over them
(Block-Attention inference; with a plain model, its "w/o fine-tuning" baseline). Equals one forward under the
block attention mask (invariant 4)."""

from __future__ import annotations

from ragkv.engine.fusion.context import prefill_over_context
from ragkv.engine.measure.estimates import population_estimate
from ragkv.engine.modes.base import BlockMode
from ragkv.engine.modes.registry import register


@register
class Reuse(BlockMode):
    name = "reuse"
    summary = "every block's independently computed KV, re-rotated to its position (Block-Attention)"
    option_fields = ("positions", "conditioning", "kv_layout")

    def layout_kind(self, fusion):
        return "local" if fusion.positions == "local" else "sequential"  # local: the no-re-encoding ablation

    def fidelity(self, fusion, stats):
        # blocks that never saw each other: exact only for one block after no prefix, or one conditioned on it
        return {"mode": self.name, "exact": False, "positions": fusion.positions,
                "conditioning": fusion.conditioning, "kv_layout": fusion.kv_layout,
                "reused_tokens": stats.reused_tokens, "signal": None, "estimate": population_estimate("reuse")}

    def fuse(self, ctx, segs, fusion, layout, layer_iter, capacity, stats):
        return (yield from prefill_over_context(ctx.forward_model, layer_iter, layout, segs.query, capacity, stats))
