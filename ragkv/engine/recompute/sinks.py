"""`sinks`: EPIC's LegoLink (arXiv 2410.15332): each block's first `sink_tokens` (where its own attention sink sits)
and the query recomputed, nothing chosen at run time."""

from __future__ import annotations

from ragkv.engine.recompute.rows import choose_tokens
from ragkv.engine.recompute.base import StaticSelection
from ragkv.engine.recompute.registry import register
from ragkv.errors import OptionError


@register
class Sinks(StaticSelection):
    name = "sinks"
    summary = "EPIC: each block's first sink_tokens only"
    source = "EPIC (LegoLink), ICML 2025, arXiv 2410.15332"

    def check(self, fusion):
        super().check(fusion)
        if fusion.sink_tokens < 1:
            raise OptionError("sink_tokens", "select='sinks' recomputes each block's first sink_tokens tokens: set "
                                             "sink_tokens >= 1 (EPIC recomputes a handful, e.g. 4-16)")

    def choose(self, layout, fusion):
        return choose_tokens(None, layout, 0.0, fusion.sink_tokens, False)
