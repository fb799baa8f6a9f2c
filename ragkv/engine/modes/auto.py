"""`auto` (experimental): a quality-bounded mode. It starts cheap, as `blend` with the query-aware selection
(ProphetKV) at r, and recomputes everything (which equals `full`) only when the request's risk signal
(engine/measure/risk.py: `shift`, `entropy`, `margin` or `uncovered`) is above `max_risk`. Unset, the signal and the
threshold are the model's calibration (`ragkv calibrate --target auto`: on held-out data, the signal that ranks the
distance to `full` best and the threshold that brings the mean first-token KL under a target within an escalation
budget), else `shift` at 0.05. Measured (docs/results/quality_selection.md): no signal yet ranks the error left
after the recompute well, so escalations are only partly aimed at the answers at risk."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from ragkv.engine.modes.blend import Blend
from ragkv.engine.modes.registry import register
from ragkv.engine.recompute import get_selection


@register
class Auto(Blend):
    name = "auto"
    summary = "blend with the query-aware selection at r, escalated to a full recompute when its risk exceeds max_risk"
    option_fields = ("ratio", "signal", "max_risk", "escalation_budget", "sink_tokens", "select_per_block", "draft_tokens", "conditioning",
                     "kv_layout")

    def check(self, ctx, fusion):
        pass

    def worst_token_layers(self, segs, fusion, num_layers):
        # blend's, then the escalation: every block token and the query (and a draft) recomputed once more
        escalation = segs.num_tokens + len(segs.query) + fusion.draft_tokens
        return super().worst_token_layers(segs, fusion, num_layers) + escalation * num_layers

    def fuse(self, ctx, segs, fusion, layout, layer_iter, capacity, stats):
        context_ids = segs.prefix + [t for b in segs.blocks for t in b]
        # unset: what `ragkv calibrate --target auto` chose for this model (ctx.auto_source), else the defaults
        limit = fusion.max_risk if fusion.max_risk is not None else ctx.auto_max_risk
        signal = fusion.signal or ctx.auto_signal
        # the budget: beyond its share of recent answers escalated, an answer at risk keeps its cheap recompute
        spent = fusion.escalation_budget < 1.0 and ctx.escalations.share() >= fusion.escalation_budget
        expect = partial(ctx.expected_kl, select="query")
        # the query-aware selection at r, then again at r = 1 (every block token: full's answer) while at risk
        state = yield from get_selection("query").prefill(ctx.forward_model, layer_iter, layout, context_ids, segs.query,
                                               fusion, capacity, stats, signal,
                                               ratios=(fusion.ratio,) if spent else (fusion.ratio, 1.0),
                                               max_signal=limit, expect=expect)
        rec = stats.recompute
        rec.max_risk, rec.calibration = limit, ctx.auto_source if fusion.max_risk is None else None
        rec.escalation_budget, rec.budget_spent = fusion.escalation_budget, spent
        ctx.escalations.add(rec.escalations > 0)
        return state

    def selection(self, fusion) -> str:
        return "query"  # auto always selects by the query's attention

    def fidelity(self, fusion, stats):
        out = super().fidelity(fusion, stats)
        rec = self.record(fusion, stats)
        out.update(select="query", max_risk=rec.max_risk, escalations=rec.escalations, final_ratio=rec.share,
                   calibration=rec.calibration, budget_spent=rec.budget_spent)
        return out

    def first_token_flops(self, a, fusion, context, query, prefix_len=0, reused=0):
        # the cheap path; an escalation adds a full recompute of the blocks
        return super().first_token_flops(a, replace(fusion, select="query"), context, query, prefix_len, reused)
