"""What a recompute selection is to `blend` (and `auto`): which r of the block tokens are recomputed over the reused
blocks, how, what it checks of the options, and its FLOPs to the first token.

A selection is a stateless object. `prefill` runs over the reused context, layer by layer (`layer_iter`), and
leaves a Recompute record (record.py) in the request's stats: what it chose and, where a first answer existed
before the recompute, the risk signals of the answer (engine/measure/risk.py). Invariant 6 holds for every
selection: r = 1 (or sinks covering every block) equals `full`, r = 0 equals `reuse`.

`StaticSelection` is the shape of the selections known from the layout alone (no stage 1): one pass over the
context with the chosen rows and the query recomputed at every layer.

EPIC's LegoLink needs no stage 1: each block's first `sink_tokens` tokens (where its own attention sink sits) and
the query are recomputed, nothing chosen at run time. So it runs in one pass: before each layer the reused context
is fetched and re-rotated into the cache, then the sink rows and the query overwrite theirs and attend (the query
runs once, not in a stage 1 and again in stage 2): Tq + sinks rows x L. `recent` is static too: the last r of the
block tokens (those nearest the query, which in a full prefill have read every earlier passage), per block with
`select_per_block` (each block's tail), plus any sinks; same one pass.
"""

from __future__ import annotations

import time
from dataclasses import fields
from typing import TYPE_CHECKING, ClassVar

import torch

from ragkv.engine.fusion.layout import Layout
from ragkv.engine.kv.kvcache import KVCache
from ragkv.engine.kv.state import DecodeState
from ragkv.engine.measure.flops import attention_flops, head_flops, linear_flops
from ragkv.engine.measure.risk import measure
from ragkv.engine.measure.stats import RequestStats
from ragkv.engine.recompute.record import Recompute
from ragkv.engine.recompute.rows import FetchedRowsPlan, check_recomputable, per_block_counts
from ragkv.errors import OptionError
from ragkv.models.args import ModelArgs
from ragkv.models.loop import Forward, computed

if TYPE_CHECKING:  # annotations only: the options import the selections
    from ragkv.engine.request.fusion import FusionOptions


# the options that only a selection scoring by the query's attention reads, and what each does
QUERY_SCORE_OPTIONS = {"draft_tokens": "scores the context by a draft's attention",
                       "score_layers": "picks the layers whose query attention ranks the tokens",
                       "score_from": "picks the layers whose query attention ranks the tokens",
                       "whole_blocks": "recomputes the passages the query attends to most"}


class Selection:
    name: ClassVar[str]
    summary: ClassVar[str]
    source: ClassVar[str]  # the paper (or the project's note) it follows
    # whether it ranks tokens by the query's (and a draft's) attention, where draft_tokens, score_layers and
    # whole_blocks mean something
    scores_by_query: ClassVar[bool] = False

    def check(self, fusion: "FusionOptions") -> None:
        """Raise OptionError for options this selection cannot run with."""
        if self.scores_by_query:
            return
        defaults = {f.name: f.default for f in fields(fusion)}
        for name, what in QUERY_SCORE_OPTIONS.items():
            if getattr(fusion, name) != defaults[name]:
                raise OptionError(name, f"{name} {what}: select='{self.name}' has no such score; use "
                                        f"select='query' (or leave {name} unset)")

    def prefill(self, model, layer_iter, layout: Layout, context_ids: list[int], query_ids: list[int],
                fusion: "FusionOptions", capacity: int, stats: RequestStats, signal: str, expect=None) -> DecodeState:
        """The decode state after recomputing this selection's tokens over the reused context; `expect(logits,
        share)`: the reply's expected KL to `full` (the `expected_kl` risk signal), or None."""
        raise NotImplementedError

    def first_token_flops(self, a: ModelArgs, fusion: "FusionOptions", context: int, query: int,
                          prefix_len: int = 0, reused: int = 0) -> int:
        raise NotImplementedError


def record_selection(stats: RequestStats, select: str, chosen: torch.Tensor, layout: Layout, risks: list[dict],
                     signal: str | None, **more) -> Recompute:
    """What was selected and each stage-2 run's risk signals, as the request's Recompute record."""
    stats.recompute = Recompute(select=select, block_tokens=layout.context_len - layout.prefix_len,
                                selected=len(chosen), selected_per_block=per_block_counts(chosen, layout),
                                risks=risks, signal=signal if risks else None, **more)
    return stats.recompute


class StaticSelection(Selection):
    """Chosen from the layout alone: one pass, no stage 1 over the query."""

    def choose(self, layout: Layout, fusion: "FusionOptions") -> torch.Tensor:
        """Cache indices (ascending) of the block tokens to recompute."""
        raise NotImplementedError

    def prefill(self, model, layer_iter, layout, context_ids, query_ids, fusion, capacity, stats, signal,
                expect=None):
        check_recomputable(model, layout, len(context_ids) + len(query_ids))
        chosen = self.choose(layout, fusion)
        state = yield from prefill_static(model, layer_iter, layout, context_ids + query_ids, len(query_ids), chosen,
                                          capacity, stats)
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


@torch.inference_mode()
def prefill_static(model, layer_iter, layout: Layout, ids: list[int], Tq: int, chosen: torch.Tensor, capacity: int,
                   stats: RequestStats) -> DecodeState:
    """A selection known from the layout (EPIC's LegoLink, `recent`) in one pass: the chosen context rows and the
    query recomputed at every layer, over the reused context fetched layer by layer."""
    N, L, total = layout.context_len, model.args.num_layers, len(ids)
    chosen = chosen.to(model.device)
    rows = torch.cat([chosen, torch.arange(N, total, device=chosen.device)])
    cache = KVCache.for_model(model, max(capacity, total))
    t0, before = time.perf_counter(), stats.fetch_ms + stats.rerotate_ms
    plan = FetchedRowsPlan(model, cache, rows, total, layer_iter, layout, stats)
    x = yield from computed(Forward(model, model.embed(torch.tensor(ids, device=model.device)[rows].unsqueeze(0)),
                                    plan))
    cache.commit(total)
    logits = model.logits(x[:, -1:])[0, -1]
    stats.recompute_ms += (time.perf_counter() - t0) * 1000 - (stats.fetch_ms + stats.rerotate_ms - before)
    stats.recomputed_token_layers += len(rows) * L
    stats.reused_tokens += N - len(chosen)
    stats.recomputed_tokens += Tq + len(chosen)
    return DecodeState(cache, total, logits)
