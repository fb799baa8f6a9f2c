"""`deviation`: CacheBlend (Yao et al., EuroSys'25, sec. 4): the block tokens whose KV deviates most at the check
layer(s) from the reused one, recomputed from there on (every token before the first check layer); the default."""

from __future__ import annotations

from ragkv.engine.fusion.blend import prefill_blend
from ragkv.engine.measure.flops import attention_flops, head_flops, linear_flops, rows_flops
from ragkv.engine.selections.base import Selection
from ragkv.engine.selections.registry import register


@register
class Deviation(Selection):
    name = "deviation"
    summary = "CacheBlend: the tokens whose KV deviates most at the check layer(s)"
    source = "CacheBlend, Yao et al., EuroSys'25 (arXiv 2405.16444), sec. 4.2-4.3"

    def prefill(self, model, layer_iter, layout, context_ids, query_ids, fusion, capacity, stats, signal, expect=None):
        # CacheBlend records no risk signals (its deviation check is not a stage-1 answer): `expect` goes unused
        return (yield from prefill_blend(model, layer_iter, layout, context_ids, query_ids, fusion, capacity, stats))

    def first_token_flops(self, a, fusion, context, query, prefix_len=0, reused=0):
        L, check = a.num_layers, fusion.check_layers[0]
        early = rows_flops(a, 0, context + query, check)  # layers before the check: every token
        check_v = 2 * a.hidden_size * a.num_kv_heads * a.head_dim * (context - prefix_len)
        selected = int(round(fusion.ratio * (context - prefix_len)))
        rows = selected + query  # selected block tokens spread over the context: attend ~half of it on average
        late = (L - check) * (rows * linear_flops(a) + attention_flops(a, selected * context // 2
                                                                     + query * context + query * query // 2))
        return early + check_v + late + head_flops(a)
