"""`blend`: `reuse`, then a fraction r of the block tokens recomputed, chosen by one of SELECTIONS:
- `deviation`: CacheBlend (Yao et al., EuroSys'25): the tokens whose KV deviates most at the check layer(s),
  recomputed from there on (ragkv/engine/blend.py);
- `query`: ProphetKV (arXiv 2602.02579): the tokens the query attends to most over the reused cache, recomputed at
  every layer (ragkv/engine/query_select.py);
- `sinks`: EPIC's LegoLink (arXiv 2410.15332): each block's first `sink_tokens`, nothing chosen at run time;
- `recent`: the last r of the block tokens (nearest the query), or of each block's, also static.
The loading controller chooses the tier to read each block from and, with `auto_ratio`, raises r to what loading
hides. r = 1 equals `full`, r = 0 `reuse`, for every selection (invariant 6)."""

from __future__ import annotations

from dataclasses import replace

from ragkv.engine.blend import prefill_blend
from ragkv.engine.flops import attention_flops, head_flops, linear_flops, rows_flops
from ragkv.engine.modes.base import BlockMode
from ragkv.engine.modes.registry import register
from ragkv.engine.query_select import STATIC_SELECTIONS, prefill_selected
from ragkv.errors import OptionError

SELECTIONS = ("deviation", "query", "sinks", "recent")  # FusionOptions.select; the first is the default


@register
class Blend(BlockMode):
    name = "blend"
    summary = "reuse, then r of the block tokens recomputed, chosen by deviation (CacheBlend), query, sinks or recency"
    option_fields = ("ratio", "select", "check_layers", "deviation", "gradual", "sink_tokens", "check_rows",
                     "select_per_block", "draft_tokens", "conditioning", "kv_layout")
    fuses_in_place = False  # shared: prefilled as a copy, then its recomputed rows kept over the pooled blocks

    def own_rows(self, segs, fusion):
        # what its recomputed rows will number is known only after the selection (layers before CacheBlend's
        # check layer recompute every row): the budget reserves the whole prompt, as copied does, and a draft's
        # rows, which stage 1's cache holds until they are forgotten
        return segs.num_tokens + fusion.draft_tokens

    def check(self, engine, fusion):
        if fusion.check_layers[-1] >= engine.num_layers:
            raise OptionError("check_layers", f"check layer {fusion.check_layers[-1]} does not exist: this model's "
                                              f"check layers are 1..{engine.num_layers - 1} (check_layers)")
        if fusion.select == "sinks" and fusion.sink_tokens < 1:
            raise OptionError("sink_tokens", "select='sinks' recomputes each block's first sink_tokens tokens: set "
                                             "sink_tokens >= 1 (EPIC recomputes a handful, e.g. 4-16)")
        if fusion.draft_tokens and fusion.select != "query":
            raise OptionError("draft_tokens", "draft_tokens scores the context by a draft's attention: it needs "
                                              "select='query' (or set draft_tokens=0)")

    def load_schedule(self, engine, res, fusion, stats):
        if res.uncached:  # some blocks live only in this request's memory: nothing to schedule
            return fusion, None
        schedule = engine._planner.schedule(res.keys, fusion.ratio)
        if isinstance(schedule, str):  # why there is none (no profile yet, a single tier...)
            stats.extra["loading_plan"] = {"none": schedule}
        if schedule is None or isinstance(schedule, str):
            return fusion, None
        stats.extra["loading_plan"] = schedule.as_dict()  # each block is read from the tier the schedule names
        return (replace(fusion, ratio=schedule.ratio) if fusion.auto_ratio else fusion), schedule.tiers

    def fuse(self, engine, segs, fusion, layout, layer_iter, capacity, stats):
        context_ids = segs.prefix + [t for b in segs.blocks for t in b]
        if fusion.select != "deviation":
            return prefill_selected(engine.forward_model, layer_iter, layout, context_ids, segs.query,
                                    fusion.select, (fusion.ratio,), fusion.sink_tokens, fusion.select_per_block,
                                    capacity, stats, signal=engine.auto_signal, draft_tokens=fusion.draft_tokens)
        return prefill_blend(engine.forward_model, layer_iter, layout, context_ids, segs.query, fusion, capacity, stats)

    def fidelity(self, fusion, stats):
        x = stats.extra
        risk, name = x.get("risk"), x.get("risk_signal")
        selected = x.get("selected", x.get("blend_selected"))  # query/sinks selections, or CacheBlend's
        block = x.get("block_tokens", x.get("blend_block_tokens"))
        return {"mode": self.name, "exact": selected == block,  # every block token recomputed: full's answer
                "select": fusion.select, "ratio": fusion.ratio, "conditioning": fusion.conditioning,
                "draft_tokens": fusion.draft_tokens,
                "recomputed_tokens": stats.recomputed_tokens,
                "reused_tokens": stats.reused_tokens,
                # the risk signal (engine/risk.py) the model's calibration chose, and its value for this answer
                "signal": risk[name] if risk else None, "signal_name": name if risk else None}

    def worst_token_layers(self, segs, fusion, num_layers):
        # blocks encoded, then the query again (stage 1) and the selected rows with the query and a draft twice
        blocks = sum(len(b) for b in segs.blocks)
        again = len(segs.query) + int(fusion.ratio * blocks + 0.999) + fusion.sink_tokens * len(segs.blocks)
        again += len(segs.query) + 2 * fusion.draft_tokens
        return super().worst_token_layers(segs, fusion, num_layers) + min(again, 2 * segs.num_tokens) * num_layers

    def token_layers(self, stats, num_layers):
        return stats.recomputed_token_layers  # counted per layer by prefill_blend: selections shrink with depth

    def first_token_flops(self, a, fusion, context, query, prefix_len=0, reused=0):
        L = a.num_layers
        if fusion.select in STATIC_SELECTIONS:  # one pass: what was not reused and the query at every layer
            chosen = max(0, context - reused)
            rows = chosen + query
            return L * (rows * linear_flops(a) + attention_flops(a, chosen * context // 2 + query * context)) \
                + head_flops(a)
        if fusion.select != "deviation":  # stage 1 (reuse's query rows), then the chosen rows at every layer
            chosen = int(round(fusion.ratio * (context - prefix_len)))
            rows = chosen + query
            stage2 = L * (rows * linear_flops(a) + attention_flops(a, chosen * context // 2 + query * context))
            return rows_flops(a, context, query, L) + stage2 + head_flops(a)
        check = fusion.check_layers[0]
        early = rows_flops(a, 0, context + query, check)  # layers before the check: every token
        check_v = 2 * a.hidden_size * a.num_kv_heads * a.head_dim * (context - prefix_len)
        selected = int(round(fusion.ratio * (context - prefix_len)))
        rows = selected + query  # selected block tokens spread over the context: attend ~half of it on average
        late = (L - check) * (rows * linear_flops(a) + attention_flops(a, selected * context // 2
                                                                     + query * context + query * query // 2))
        return early + check_v + late + head_flops(a)
