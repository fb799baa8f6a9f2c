"""`auto` (experimental): a quality-bounded mode. It starts cheap, as `blend` with the query-aware selection
(ProphetKV) at r, and recomputes everything (which equals `full`) only when the request's own fidelity signal is
above `max_kl`: the KL between the first-token distributions before and after the recompute (how far recomputing r
of the tokens moved the answer).

Measured (docs/results/quality_selection.md, Qwen 0.5B, NQ-10): that signal ranks `reuse`'s distance to `full`
well (Spearman ~0.8) but not the distance left after the recompute (~0), so escalations are not yet aimed at the
answers at risk; `max_kl`'s default is not calibrated. A signal for the residual is the open part of issue 27."""

from __future__ import annotations

from dataclasses import replace

from ragkv.engine.modes.blend import Blend
from ragkv.engine.modes.registry import register
from ragkv.engine.query_select import prefill_selected


@register
class Auto(Blend):
    name = "auto"
    summary = "blend with the query-aware selection at r, escalated to a full recompute when its signal exceeds max_kl"
    option_fields = ("ratio", "max_kl", "sink_tokens", "select_per_block")

    def check(self, engine, fusion):
        pass

    def fuse(self, engine, segs, fusion, layout, layer_iter, capacity, stats):
        context_ids = segs.prefix + [t for b in segs.blocks for t in b]
        return prefill_selected(engine.model, layer_iter, layout, context_ids, segs.query, "query",
                                (fusion.ratio, 1.0), fusion.sink_tokens, fusion.select_per_block, capacity, stats,
                                max_signal=fusion.max_kl)

    def fidelity(self, fusion, stats):
        out = super().fidelity(fusion, stats)
        out.update(select="query", max_kl=fusion.max_kl, escalations=stats.extra.get("escalations", 0),
                   final_ratio=stats.extra.get("final_ratio"))
        return out

    def first_token_flops(self, a, fusion, context, query, prefix_len=0, reused=0):
        # the cheap path; an escalation adds a full recompute of the blocks
        return super().first_token_flops(a, replace(fusion, select="query"), context, query, prefix_len, reused)
