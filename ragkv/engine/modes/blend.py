"""`blend`: `reuse`, then a fraction r of the block tokens recomputed, chosen by a selection
(ragkv/engine/recompute: CacheBlend's deviation, the default; ProphetKV's query-aware; EPIC's sinks; recent).
The loading controller chooses the tier to read each block from and, with `auto_ratio`, raises r to what loading
hides. r = 1 equals `full`, r = 0 `reuse`, for every selection (invariant 6)."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from ragkv.engine.measure.estimates import EXACT_ESTIMATE, population_estimate
from ragkv.engine.modes.base import BlockMode
from ragkv.engine.modes.registry import register
from ragkv.engine.recompute import Recompute, get_selection
from ragkv.engine.recompute.rows import keep_count
from ragkv.errors import OptionError


@register
class Blend(BlockMode):
    name = "blend"
    summary = "reuse, then r of the block tokens recomputed, chosen by deviation (CacheBlend), query, sinks or recency"
    option_fields = ("ratio", "select", "check_layers", "deviation", "gradual", "sink_tokens", "check_rows",
                     "select_per_block", "draft_tokens", "score_layers", "score_from",
                     "whole_blocks", "conditioning", "kv_layout")
    fuses_in_place = False  # shared: prefilled as a copy, then its recomputed rows kept over the pooled blocks

    def own_rows(self, segs, fusion):
        # what its recomputed rows will number is known only after the selection (layers before CacheBlend's
        # check layer recompute every row): the budget reserves the whole prompt, as copied does, and a draft's
        # rows, which stage 1's cache holds until they are forgotten
        return segs.num_tokens + fusion.draft_tokens

    def check(self, ctx, fusion):
        if fusion.check_layers[-1] >= ctx.num_layers:
            raise OptionError("check_layers", f"check layer {fusion.check_layers[-1]} does not exist: this model's "
                                              f"check layers are 1..{ctx.num_layers - 1} (check_layers)")
        if fusion.score_layers and max(fusion.score_layers) >= ctx.num_layers:
            raise OptionError("score_layers", f"score layer {max(fusion.score_layers)} does not exist: this model's "
                                              f"layers are 0..{ctx.num_layers - 1} (score_layers)")
        get_selection(fusion.select).check(fusion)

    def load_schedule(self, ctx, res, fusion, stats):
        if res.uncached:  # some blocks live only in this request's memory: nothing to schedule
            return fusion, None
        schedule = ctx.loading_planner.schedule(res.keys, fusion.ratio)
        if isinstance(schedule, str):  # why there is none (no profile yet, a single tier...)
            stats.extra["loading_plan"] = {"none": schedule}
        if schedule is None or isinstance(schedule, str):
            return fusion, None
        stats.extra["loading_plan"] = schedule.as_dict()  # each block is read from the tier the schedule names
        return (replace(fusion, ratio=schedule.ratio) if fusion.auto_ratio else fusion), schedule.tiers

    def fuse(self, ctx, segs, fusion, layout, layer_iter, capacity, stats):
        context_ids = segs.prefix + [t for b in segs.blocks for t in b]
        # every risk signal is recorded, the reply's own estimate too (`ragkv calibrate --target auto` ranks them)
        expect = partial(ctx.expected_kl, select=fusion.select)
        return (yield from get_selection(fusion.select).prefill(ctx.forward_model, layer_iter, layout, context_ids,
                                                                 segs.query, fusion, capacity, stats,
                                                                 ctx.auto_signal, expect=expect))

    def fidelity(self, fusion, stats):
        rec = self.record(fusion, stats)
        risk, name = rec.risk, rec.signal
        exact = rec.exact  # every block token recomputed: full's answer
        return {"mode": self.name, "exact": exact,
                "select": fusion.select, "ratio": fusion.ratio, "conditioning": fusion.conditioning,
                "draft_tokens": fusion.draft_tokens,
                "recomputed_tokens": stats.recomputed_tokens,
                "reused_tokens": stats.reused_tokens,
                # the risk signal (engine/measure/risk.py) the model's calibration chose, and its value for this answer
                "signal": risk[name] if risk else None, "signal_name": name if risk else None,
                # how close it is expected to be (a population's figures at the recomputed share: engine/estimates)
                "estimate": EXACT_ESTIMATE if exact else population_estimate(self.name, self.selection(fusion),
                                                                             rec.share)}

    def record(self, fusion, stats) -> Recompute:
        """The request's Recompute record; none where no block token was there to choose (its answer is exact)."""
        return stats.recompute or Recompute(select=self.selection(fusion), block_tokens=0)

    def selection(self, fusion) -> str:
        return fusion.select

    def worst_token_layers(self, segs, fusion, num_layers):
        # blocks encoded, then the query again (stage 1) and the selected rows with the query and a draft twice
        blocks = sum(len(b) for b in segs.blocks)
        again = len(segs.query) + keep_count(fusion.ratio, blocks) + fusion.sink_tokens * len(segs.blocks)
        again += len(segs.query) + 2 * fusion.draft_tokens
        return super().worst_token_layers(segs, fusion, num_layers) + min(again, 2 * segs.num_tokens) * num_layers

    def token_layers(self, stats, num_layers):
        return stats.recomputed_token_layers  # counted per layer by prefill_blend: selections shrink with depth

    def first_token_flops(self, a, fusion, context, query, prefix_len=0, reused=0):
        return get_selection(fusion.select).first_token_flops(a, fusion, context, query, prefix_len, reused)
