"""What a recompute selection is to `blend` (and `auto`): which r of the block tokens are recomputed over the reused
blocks, how, what it checks of the options, and its FLOPs to the first token.

A selection is a stateless object. `prefill` runs over the reused context, layer by layer (`layer_iter`), and
records what it chose in one vocabulary for every selection (query_select.record_selection): `select`,
`selected`, `selected_per_block`, `block_tokens`, and where a first answer existed before the recompute, the risk
signals of the answer (engine/measure/risk.py). Invariant 6 holds for every selection: r = 1 (or sinks covering every
block) equals `full`, r = 0 equals `reuse`.

`StaticSelection` is the shape of the selections known from the layout alone (no stage 1): one pass over the
context with the chosen rows and the query recomputed at every layer."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from ragkv.engine.fusion.layout import Layout
from ragkv.engine.fusion.query_select import check_selectable, prefill_static, record_selection
from ragkv.engine.kv.state import DecodeState
from ragkv.engine.measure.flops import attention_flops, head_flops, linear_flops
from ragkv.engine.measure.risk import measure
from ragkv.engine.measure.stats import RequestStats
from ragkv.models.args import ModelArgs

if TYPE_CHECKING:  # annotations only: the options import the selections
    from ragkv.engine.options import FusionOptions


class Selection:
    name: ClassVar[str]
    summary: ClassVar[str]
    source: ClassVar[str]  # the paper (or the project's note) it follows

    def check(self, fusion: "FusionOptions") -> None:
        """Raise OptionError for options this selection cannot run with."""

    def prefill(self, model, layer_iter, layout: Layout, context_ids: list[int], query_ids: list[int],
                fusion: "FusionOptions", capacity: int, stats: RequestStats, signal: str, expect=None) -> DecodeState:
        """The decode state after recomputing this selection's tokens over the reused context; `expect(logits,
        share)`: the reply's expected KL to `full` (the `expected_kl` risk signal), or None."""
        raise NotImplementedError

    def first_token_flops(self, a: ModelArgs, fusion: "FusionOptions", context: int, query: int,
                          prefix_len: int = 0, reused: int = 0) -> int:
        raise NotImplementedError


class StaticSelection(Selection):
    """Chosen from the layout alone: one pass, no stage 1 over the query."""

    def choose(self, layout: Layout, fusion: "FusionOptions") -> torch.Tensor:
        """Cache indices (ascending) of the block tokens to recompute."""
        raise NotImplementedError

    def prefill(self, model, layer_iter, layout, context_ids, query_ids, fusion, capacity, stats, signal,
                expect=None):
        check_selectable(model, layout, len(context_ids) + len(query_ids))
        chosen = self.choose(layout, fusion)
        state = yield from prefill_static(model, layer_iter, layout, context_ids + query_ids, len(query_ids), chosen, capacity,
                               stats)
        # no stage 1 to compare with: the risk's `shift` is unknown
        full = (len(context_ids) + len(query_ids)) * model.args.num_layers
        estimate = None if expect is None else expect(state.logits, stats.recomputed_token_layers / max(1, full))
        record_selection(stats, self.name, chosen, layout, [measure(state.logits, None, None, estimate)], signal)
        return state

    def first_token_flops(self, a, fusion, context, query, prefix_len=0, reused=0):
        # one pass: what was not reused and the query, at every layer
        chosen = max(0, context - reused)
        rows = chosen + query
        return a.num_layers * (rows * linear_flops(a) + attention_flops(a, chosen * context // 2 + query * context)) \
            + head_flops(a)
