"""`query`: ProphetKV (arXiv 2602.02579): stage 1 is `reuse`'s query over the reused cache, scoring each context
token by the query's attention (and a draft's, with `draft_tokens`); stage 2 recomputes the top r and the query at
every layer (engine/fusion/query_select.py)."""

from __future__ import annotations

from ragkv.engine.fusion.query_select import prefill_query_aware
from ragkv.engine.measure.flops import attention_flops, head_flops, linear_flops, rows_flops
from ragkv.engine.selections.base import Selection
from ragkv.engine.selections.registry import register


@register
class QueryAware(Selection):
    name = "query"
    summary = "ProphetKV: the tokens the query (and a draft) attends to most over the reused cache"
    source = "ProphetKV, arXiv 2602.02579 (scoring as in the public reimplementation omerpaz95/vllm prophet_kv.py)"

    def prefill(self, model, layer_iter, layout, context_ids, query_ids, fusion, capacity, stats, signal,
                ratios=None, max_signal=None, expect=None):
        """`ratios`, `max_signal`: `auto`'s escalation (stage 2 again at the next ratio while the risk exceeds);
        `expect`: the `expected_kl` signal's estimator."""
        return (yield from prefill_query_aware(model, layer_iter, layout, context_ids, query_ids,
                                               ratios or (fusion.ratio,), fusion.sink_tokens, fusion.select_per_block,
                                               capacity, stats, max_signal, signal, fusion.draft_tokens, expect))

    def first_token_flops(self, a, fusion, context, query, prefix_len=0, reused=0):
        # stage 1 (reuse's query rows), then the chosen rows and the query at every layer
        L = a.num_layers
        chosen = int(round(fusion.ratio * (context - prefix_len)))
        rows = chosen + query
        stage2 = L * (rows * linear_flops(a) + attention_flops(a, chosen * context // 2 + query * context))
        return rows_flops(a, context, query, L) + stage2 + head_flops(a)
