"""A block mode behind the exactly computed start of a conversation (engine/blocks/history.py plans the split): the
start prefilled as `prefix` would (its chunks stored), the turns after it fused by the wrapped mode."""

from __future__ import annotations

from ragkv.engine.blocks.history import fused_rest, history_counts, plan_history
from ragkv.engine.blocks.prefix_cache import prefill_prefix
from ragkv.engine.kv.state import DecodeState
from ragkv.engine.kv.stepwise import Steps
from ragkv.engine.measure.stats import RequestStats
from ragkv.engine.modes.context import ModeContext
from ragkv.engine.request.segments import Segments


class WithHistory:
    """`mode` (a BlockMode) for a chat's segments: the history's exact start, then the mode over the rest."""

    def __init__(self, mode):
        self.mode = mode

    def worst_token_layers(self, ctx: ModeContext, segs: Segments, fusion, ns: str) -> int:
        """The most token-layers this path runs for `segs` (cold cache for what it fuses): every row once when
        nothing is fused (what `prefix` computes), else the mode's worst over the fused rest, its exact start counted
        once. Planned with the store as it is at admission, as the prefill plans it when it starts."""
        j, k = plan_history(ctx.block_cache, ctx.fingerprint, segs, fusion.prefix_chunk, ns)
        if j == len(segs.blocks):
            return segs.num_tokens * ctx.num_layers
        return self.mode.worst_token_layers(fused_rest(segs, j, k), fusion, ctx.num_layers)

    def prefill(self, ctx: ModeContext, segs: Segments, fusion, capacity: int, stats: RequestStats, ns: str, chunk,
                blocks) -> Steps[DecodeState]:
        store, chunk_size = blocks.store, fusion.prefix_chunk
        j, k = plan_history(blocks, ctx.fingerprint, segs, chunk_size, ns)
        rest = fused_rest(segs, j, k)
        exact_ids = rest.prefix
        info = history_counts(segs, j, k)
        info.update(exact_tokens=len(exact_ids) + len(rest.query), prefix_cached_tokens=0)
        stats.extra["history"] = info
        if j == len(segs.blocks):  # nothing worth fusing: exactly what `prefix` computes (its chunks stored)
            before = stats.recomputed_tokens
            state = yield from prefill_prefix(ctx.forward_model, store, ctx.fingerprint, ns, segs.all_ids(),
                                              chunk_size, capacity, stats, chunk)
            # a mode that counts its own token-layers (blend) reads them here: each prefilled row through every layer
            stats.recomputed_token_layers += (stats.recomputed_tokens - before) * ctx.num_layers
            info.update(exact=True, prefix_cached_tokens=stats.cached_tokens, exact_tokens=segs.num_tokens)
            return state
        info["exact"] = False
        if not exact_ids:  # the first turn was edited and there is no system message: all of it fused
            return (yield from self.mode.prefill_blocks(ctx, rest, fusion, capacity, stats, ns, chunk, blocks))
        part = RequestStats(mode="prefix")
        exact = yield from prefill_prefix(ctx.forward_model, store, ctx.fingerprint, ns, exact_ids, chunk_size,
                                          len(exact_ids), part, chunk)
        state = yield from self.mode.prefill_blocks(ctx, rest, fusion, capacity, stats, ns, chunk, blocks,
                                                    exact=exact.cache)
        stats.absorb_exact_prefix(part, ctx.num_layers)
        info["prefix_cached_tokens"] = part.cached_tokens
        return state
