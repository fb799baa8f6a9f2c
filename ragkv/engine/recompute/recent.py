"""`recent`: the last r of the block tokens (those nearest the query, which in a full prefill have read every
earlier passage), or of each block's with `select_per_block`, plus any sinks; known from the layout, one pass."""

from __future__ import annotations

import torch

from ragkv.engine.recompute.rows import choose_tokens
from ragkv.engine.recompute.base import StaticSelection
from ragkv.engine.recompute.registry import register


@register
class Recent(StaticSelection):
    name = "recent"
    summary = "the last r of the block tokens, nearest the query"
    source = "this project's static baseline (docs/results/quality_selection.md)"

    def choose(self, layout, fusion):
        recency = torch.arange(layout.context_len, dtype=torch.float32, device=layout.context_positions.device)
        return choose_tokens(recency, layout, fusion.ratio, fusion.sink_tokens, fusion.select_per_block)
