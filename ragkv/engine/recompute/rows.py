"""What every selection shares: the r -> count rule (one rounding), the check that a prompt can be recomputed
selectively, the choice of the top-r tokens by a score, and the recomputed rows' attention over the cache (each
layer's fresh K/V of the chosen rows overwrite the reused ones, then they attend causally to the whole context)."""

from __future__ import annotations

import torch

from ragkv.engine.fusion.context import context_rotation, load_context_layer
from ragkv.engine.fusion.layout import Layout
from ragkv.engine.kv.kvcache import KVCache
from ragkv.engine.measure.stats import RequestStats
from ragkv.errors import InvalidRequestError
from ragkv.ops import prefill_kernel
from ragkv.ops.attention import prefill_kernel_path, sdpa


def keep_count(ratio: float, n: int) -> int:
    """The tokens a ratio r keeps of n: round(r n), at most n. The one rounding every selection, its FLOPs and the
    budgets use."""
    return min(n, int(round(ratio * n)))


def check_recomputable(model, layout: Layout, total: int) -> None:
    """What selective recompute needs: no sliding window within the prompt (the recomputed rows attend to the whole
    context) and the sequential layout (cache index == position)."""
    window = model.args.sliding_window
    if window is not None and window < total:
        raise InvalidRequestError(f"selective recompute (blend, auto) is not supported past a sliding window ({window} "
                                  f"tokens; this prompt has {total}): use reuse or full")
    if layout.query_start != layout.context_len:
        raise InvalidRequestError("selective recompute needs the sequential layout (cache index == position)")


def choose_tokens(score: torch.Tensor | None, layout: Layout, ratio: float, sink_tokens: int,
                  per_block: bool, whole_blocks: int = 0) -> torch.Tensor:
    """Cache indices (ascending) of the block tokens to recompute: the top r by `score` (over all blocks, or per
    block), plus each block's first `sink_tokens`. The shared prefix is never chosen (it is computed exactly).
    `whole_blocks`: first the blocks with the largest summed score, each whole while it fits the budget, then the
    budget's rest by token (over all blocks only)."""
    dev = score.device if score is not None else layout.context_positions.device  # the layout lives on the CPU
    chosen = torch.zeros(layout.context_len, dtype=torch.bool, device=dev)
    blocks = list(zip(layout.block_offsets(), layout.block_lens))
    groups = blocks if per_block else [(layout.prefix_len, layout.context_len - layout.prefix_len)]
    if score is not None:
        for off, n in groups:
            k = keep_count(ratio, n)
            if whole_blocks and not per_block:
                k -= take_whole_blocks(score, blocks, chosen, k, whole_blocks)
            if k:
                free = score[off:off + n].masked_fill(chosen[off:off + n], float("-inf"))
                chosen[off + torch.topk(free, k).indices] = True
    for off, n in blocks:
        chosen[off:off + min(sink_tokens, n)] = True
    return chosen.nonzero().squeeze(1)


def take_whole_blocks(score: torch.Tensor, blocks: list[tuple[int, int]], chosen: torch.Tensor, budget: int,
                      limit: int) -> int:
    """Mark up to `limit` blocks whole in `chosen`, by their summed score (the query's attention mass on each
    passage), skipping those larger than what is left of `budget`; returns the tokens taken."""
    mass = torch.stack([score[off:off + n].sum() for off, n in blocks])
    taken = 0
    for i in torch.argsort(mass, descending=True).tolist()[:limit]:
        off, n = blocks[i]
        if taken + n <= budget:
            chosen[off:off + n] = True
            taken += n
    return taken


def per_block_counts(chosen: torch.Tensor, layout: Layout) -> list[int]:
    return [int(((chosen >= o) & (chosen < o + n)).sum()) for o, n in zip(layout.block_offsets(), layout.block_lens)]


def attend_selected(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor,
                    max_chunks: int = 8, min_rows: int = 64) -> torch.Tensor:
    """Causal attention of the recomputed rows (ascending positions `pos`, cache index == position) over the cache.

    In bf16 on the CPU ragkv's kernel takes each row's own limit (its position) and skips the keys past it (SDPA's
    masked CPU kernel ran these rows at ~a quarter of the GEMM's rate on a Zen 4: 27% of a query-aware r=0.3
    prefill), on its AVX-512 BF16 or AMX path, where one was measured the faster causal attention
    (ops.attention.choose_prefill_attention). Elsewhere
    a masked kernel cannot skip the keys after a row, so the rows go in position-ordered chunks, each against only
    the keys up to its last row: ~(1 + 1/chunks)/2 of the rectangle instead of all of it.
    """
    S, total = q.shape[2], keys.shape[2]
    path = prefill_kernel_path(q, keys)
    if path is not None:  # one call, each row its own limit
        return prefill_kernel.prefill_attention(q, keys, values, row_limits=pos, amx=path == "amx")
    if S == total:  # every row recomputed (layers up to the check): the causal kernel
        return sdpa(q, keys, values, causal=True)
    n = max(1, min(max_chunks, S // min_rows))
    bounds = [round(j * S / n) for j in range(n + 1)]
    ends = pos[[b - 1 for b in bounds[1:]]].tolist()  # one host read per layer
    out = torch.empty_like(q)
    for a, b, end in zip(bounds[:-1], bounds[1:], ends):
        mask = torch.arange(end + 1, device=q.device).unsqueeze(0) <= pos[a:b].unsqueeze(1)
        out[:, :, a:b] = sdpa(q[:, :, a:b], keys[:, :, :end + 1], values[:, :, :end + 1], mask=mask)
    return out


class RecomputedRows:
    """The rows in x are the tokens at cache indices `sel` (ascending; == `positions` in the sequential layout): at
    each layer their fresh K/V overwrite the cached ones, then they attend causally over the whole cache."""
    cache: KVCache
    sel: torch.Tensor
    positions: torch.Tensor
    total: int

    def store(self, layer, raw_k, k, v):
        self.cache.overwrite(layer, self.sel, k, v)
        return self.cache.keys[layer][:, :, :self.total], self.cache.values[layer][:, :, :self.total]

    def attend(self, layer, q, kv):
        return attend_selected(q, *kv, self.positions)


class SelectedRowsPlan(RecomputedRows):
    """Stage 2: the chosen context rows and the query rows, through every layer, over a cache that already holds
    every layer's context K/V (stage 1 filled it)."""

    def __init__(self, cache: KVCache, rows: torch.Tensor, total: int):
        self.cache, self.total = cache, total
        self.sel = self.positions = rows  # sequential layout: cache index == position

    def begin(self, layer, decoder_layer, x):
        return x


class FetchedRowsPlan(SelectedRowsPlan):
    """The chosen rows and the query in one pass (EPIC's static selection): before each layer the reused context is
    fetched and written into the cache, K re-rotated (as `reuse` does), then the rows overwrite theirs."""

    def __init__(self, model, cache: KVCache, rows: torch.Tensor, total: int, layer_iter, layout: Layout,
                 stats: RequestStats):
        super().__init__(cache, rows, total)
        self.layers, self.stats, self.N = iter(layer_iter), stats, layout.context_len
        self.cos, self.sin = context_rotation(model, layout)

    def begin(self, layer, decoder_layer, x):
        load_context_layer(self, layer)
        return x
