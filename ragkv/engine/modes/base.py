"""What a fusion mode is to the engine: its cache keys, its warm-up, its prefill, its FLOPs to the first token.

A mode is a stateless object; the engine hands it a ModeContext (`ctx`, modes/context.py: the model, the store and
caches, the loading planner, the calibrated defaults, each member named; never the Engine itself) and the request.
The annotation "FusionOptions" names that type through a type-checking import only: the options import the modes,
never the other way round.

`BlockMode` is the shared shape of the modes that fuse independently encoded blocks (reuse, ape, blend, auto):
ensure the blocks, stream their KV per layer, then the mode's own `fuse`.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, ClassVar

from ragkv.engine.blocks.encode import NO_CONDITIONING, BlockCache, EnsureResult, prefix_conditioning
from ragkv.engine.blocks.history import with_exact_prefix
from ragkv.engine.fusion.layout import Layout, make_layout
from ragkv.engine.fusion.shared_attention import keep_own_rows, prefill_shared
from ragkv.engine.kv.state import DecodeState
from ragkv.engine.kv.stepwise import Steps, drain
from ragkv.engine.measure.flops import head_flops, rows_flops
from ragkv.engine.measure.stats import RequestStats
from ragkv.engine.modes.context import ModeContext
from ragkv.engine.modes.history import WithHistory
from ragkv.engine.request.segments import Segments
from ragkv.models.args import ModelArgs
from ragkv.store.base import CacheKey

if TYPE_CHECKING:  # annotations only: importing these at run time would be a circle (they import the modes)
    from ragkv.engine.request.fusion import FusionOptions


class FusionMode:
    """One way of turning a request's segments into the KV the query attends to (DESIGN "fusion mode")."""
    name: ClassVar[str]
    summary: ClassVar[str]                   # one line: what the query attends to (help texts, docs)
    option_fields: ClassVar[tuple[str, ...]] = ()  # FusionOptions fields it reads: stored in eval records
    reads_blocks: ClassVar[bool] = False     # whether it reads content-keyed blocks (what `store warm` fills)
    is_reference: ClassVar[bool] = False     # the exact answer others are compared with (accuracy_vs_full)
    always_exact: ClassVar[bool] = False     # its answer is `full`'s on the same weights, whatever the options
    shares_positions: ClassVar[bool] = False  # blocks side by side on one position range (longer than the window)

    def check(self, ctx: ModeContext, fusion: "FusionOptions") -> None:
        """Request-time checks that need the model (FusionOptions checks what it can without one)."""

    def cache_keys(self, ctx: ModeContext, segs: Segments, fusion: "FusionOptions", ns: str) -> list[CacheKey]:
        """The store entries this mode reads for `segs`, the shared prefix's first (none by default)."""
        return []

    def shared_key_count(self, segs: Segments, fusion: "FusionOptions") -> int:
        """How many leading `cache_keys` belong to the shared prefix (the system prompt), which `forget` keeps."""
        return 0

    def positions(self, segs: Segments, fusion: "FusionOptions") -> int:
        """Positions the prompt occupies before the first generated token (the model's window bounds them)."""
        return segs.num_tokens

    def own_rows(self, segs: Segments, fusion: "FusionOptions") -> int:
        """Prompt rows a sequence keeps in its own cache (what a server's KV budget reserves for the prompt)."""
        return segs.num_tokens

    def warm(self, ctx: ModeContext, segs: Segments, fusion: "FusionOptions", ns: str) -> EnsureResult:
        """Precompute and store what a later request over `segs`' context would reuse."""
        return EnsureResult([], 0, 0, 0.0)

    def prefill(self, ctx: ModeContext, segs: Segments, fusion: "FusionOptions", capacity: int,
                stats: RequestStats, ns: str, chunk, blocks: "BlockCache") -> Steps[DecodeState]:
        raise NotImplementedError

    def fidelity(self, fusion: "FusionOptions", stats: RequestStats) -> dict:
        """How this request was computed and how close to `full` it is believed to be (every reply carries it)."""
        return {"mode": self.name, "exact": False}

    def token_layers(self, stats: RequestStats, num_layers: int) -> int:
        """Rows this request ran through a layer, summed over layers (every recomputed token through every layer
        unless the mode counts its own)."""
        return stats.recomputed_tokens * num_layers

    def worst_token_layers(self, segs: Segments, fusion: "FusionOptions", num_layers: int) -> int:
        """The most rows this request's prefill can run through a layer, summed over layers, on a cold cache (every
        block encoded): what a server weighs before admitting it (the unit of `token_layers`)."""
        return segs.num_tokens * num_layers

    def takes_history(self, segs: Segments, fusion: "FusionOptions") -> bool:
        """Whether `segs` (a chat) run on the history path, its exactly computable start first
        (engine/blocks/history.py; Engine.worst_token_layers plans its cost as that path runs)."""
        return False

    def first_token_flops(self, a: ModelArgs, fusion: "FusionOptions", context: int, query: int,
                          prefix_len: int = 0, reused: int = 0) -> int:
        """Analytic FLOPs to the first token; context = prefix + block tokens, `reused` = tokens taken from the
        cache (the prefix mode's cached chunks)."""
        return rows_flops(a, context, query, a.num_layers) + head_flops(a)


class BlockMode(FusionMode):
    """Reuse of independently encoded blocks (the prefix as a block too), re-rotated to a layout, then fused."""
    reads_blocks = True
    # whether `fuse_in_place` computes the query over the pooled blocks directly (reuse, ape); otherwise (blend,
    # which recomputes block rows) the mode fuses a copy and keeps only the rows it computed (keep_own_rows)
    fuses_in_place: ClassVar[bool] = True

    def conditioning(self, segs: Segments, fusion: "FusionOptions") -> str:
        """What the blocks attended to when encoded (part of their cache key): themselves alone, or the prompt's
        prefix first (`fusion.conditioning`, which FusionOptions refuses for the modes that do not read it)."""
        if fusion.conditioning == "prefix" and segs.prefix:
            return prefix_conditioning(segs.prefix)
        return NO_CONDITIONING

    def layout_kind(self, fusion: "FusionOptions") -> str:
        return "sequential"

    def positions(self, segs, fusion):
        layout = make_layout(len(segs.prefix), [len(b) for b in segs.blocks], self.layout_kind(fusion))
        return layout.query_start + len(segs.query)  # shared (APE): the longest block, not the sum

    def cache_keys(self, ctx, segs, fusion, ns):
        pre = [ctx.block_cache.key(segs.prefix, NO_CONDITIONING, ns)] if segs.prefix else []
        return pre + [ctx.block_cache.key(ids, self.conditioning(segs, fusion), ns) for ids in segs.blocks]

    def shared_key_count(self, segs, fusion):
        return 1 if segs.prefix else 0

    def ensure_steps(self, blocks: "BlockCache", segs: Segments, fusion: "FusionOptions",
                     ns: str, chunk=None) -> Steps[EnsureResult]:
        """The prefix and every block in the store (encoding misses, in units of `chunk` tokens), as one result in
        prompt order."""
        prefix_blocks = [segs.prefix] if segs.prefix else []
        cond = self.conditioning(segs, fusion)
        if cond == NO_CONDITIONING:
            return (yield from blocks.ensure_steps(prefix_blocks + segs.blocks, NO_CONDITIONING, namespace=ns,
                                                   chunk=chunk))
        pre = yield from blocks.ensure_steps(prefix_blocks, NO_CONDITIONING, namespace=ns, chunk=chunk)
        blk = yield from blocks.ensure_steps(segs.blocks, cond, segs.prefix, ns, chunk=chunk)
        return EnsureResult(pre.keys + blk.keys, pre.hits + blk.hits, pre.misses + blk.misses,
                            pre.encode_ms + blk.encode_ms, {**pre.uncached, **blk.uncached},
                            pre.hit_tokens + blk.hit_tokens)

    def warm(self, ctx, segs, fusion, ns):
        return drain(self.ensure_steps(ctx.block_cache, segs, fusion, ns))

    def takes_history(self, segs, fusion):
        return segs.history and self.conditioning(segs, fusion) == NO_CONDITIONING and \
            self.layout_kind(fusion) == "sequential"

    def prefill(self, ctx, segs, fusion, capacity, stats, ns, chunk, blocks):
        if self.takes_history(segs, fusion):
            # chat turns: the exactly computable start of the conversation first (engine/blocks/history.py)
            return (yield from WithHistory(self).prefill(ctx, segs, fusion, capacity, stats, ns, chunk, blocks))
        return (yield from self.prefill_blocks(ctx, segs, fusion, capacity, stats, ns, chunk, blocks))

    def prefill_blocks(self, ctx, segs, fusion, capacity, stats, ns, chunk, blocks, exact=None):
        """Fetch (or encode) the prefix and the blocks, then `fuse`. `exact`: a cache already holding the prefix
        computed exactly (rotated K), used in place of the prefix's block."""
        layout = make_layout(len(segs.prefix), [len(b) for b in segs.blocks], self.layout_kind(fusion))
        ctx.check_length(layout.query_start + len(segs.query))
        res = yield from self.ensure_steps(blocks, segs if exact is None else replace(segs, prefix=[]), fusion, ns,
                                           chunk)
        stats.cache_hits, stats.cache_misses = res.hits, res.misses
        stats.cached_tokens, stats.encode_ms = res.hit_tokens, res.encode_ms
        if res.uncached:
            stats.extra["uncached_blocks"] = len(res.uncached)  # computed and used, but the store did not keep them
        pooled = None
        if exact is None and self.reads_in_place(fusion):  # shared block attention: no copy, no re-rotation
            t0 = time.perf_counter()
            pooled = ctx.block_pool.blocks(res.keys, lambda keys: ctx.layer_stream(keys, res.uncached,
                                                                                    blocks.store))
            stats.fetch_ms += (time.perf_counter() - t0) * 1000
            if self.fuses_in_place:
                return (yield from self.fuse_in_place(ctx, segs, fusion, layout, pooled, capacity, stats))
        # a plan names the engine store's tiers: none for a request's own memory (the store failed mid-request and
        # its blocks were computed again: the soak's one 500 read them with the plan's tiers)
        fusion, tiers = self.load_schedule(ctx, res, fusion, stats) if blocks.store is ctx.block_cache.store \
            else (fusion, None)
        layer_iter = ctx.layer_stream(res.keys, res.uncached, blocks.store, tiers)
        parts = layer_iter if exact is None else with_exact_prefix(exact, len(segs.prefix), layer_iter)
        state = yield from self.fuse(ctx, segs, fusion, layout, parts, capacity, stats)
        if hasattr(layer_iter, "wait_ms"):
            stats.extra["load_wait_ms"] = round(layer_iter.wait_ms, 3)  # loading not hidden by compute
        if pooled is not None:  # fused as a copy (blend): from now on only its own rows, the blocks in place
            state = keep_own_rows(ctx.forward_model, state, pooled, layout, capacity, stats)
        return state

    def reads_in_place(self, fusion: "FusionOptions") -> bool:
        """Whether the query attends to the pooled blocks in place (ragkv.engine.fusion.shared_attention) rather than to
        a re-rotated copy in its own cache: a mode that reads `kv_layout` (its `fuse_in_place`), set to shared."""
        return "kv_layout" in self.option_fields and fusion.kv_layout == "shared"

    def own_rows(self, segs, fusion):
        # in place, the blocks stay in the pool (bounded apart); a history's exact start is the sequence's own
        return len(segs.query) if self.reads_in_place(fusion) and not segs.history else segs.num_tokens

    def fuse_in_place(self, ctx, segs: Segments, fusion, layout: Layout, pooled, capacity: int,
                      stats: RequestStats) -> DecodeState:
        """`fuse` over pooled blocks read in place (when `reads_in_place`)."""
        return (yield from prefill_shared(ctx.forward_model, pooled, layout, segs.query, capacity, stats))

    def load_schedule(self, ctx, res: EnsureResult, fusion, stats: RequestStats):
        """(fusion, tiers to read each block from, or None: the store's own order). Only blend plans loading."""
        return fusion, None

    def fuse(self, ctx, segs: Segments, fusion, layout: Layout, layer_iter, capacity: int,
             stats: RequestStats) -> DecodeState:
        raise NotImplementedError
