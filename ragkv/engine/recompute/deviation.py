"""`deviation`: CacheBlend's selective recompute (Yao et al., EuroSys'25, sec. 4), the default selection.

Independently cached blocks miss each other's attention. CacheBlend recomputes, layer by layer, only the
tokens whose KV deviates most from a full prefill ("HKVD" tokens, sec. 4.2): layers before the first check
layer are recomputed for every token (the original code: a full layer 0, selection on layer 1's V), at a check
layer the fresh V (or K) of the candidates is compared with the cached one and the top fraction r of block
tokens is kept (over all blocks, or per block with `select_per_block`); later layers recompute only those plus
every query token (with `check_rows="all"` the check layer itself still recomputes and writes every row, as the
original code does; by default it already runs the kept rows only). Gradual filtering (sec. 4.3)
narrows the selection over several check layers; without gradual filtering, several check layers sum their
deviations and select once at the last (every token is recomputed up to it). r = 1 is `full`; r = 0 is `reuse`
with a single check layer or gradual filtering (docs/invariants.md, invariant 6).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ragkv.engine.fusion.context import context_rotation, load_context_layer
from ragkv.engine.fusion.layout import Layout
from ragkv.engine.kv.kvcache import KVCache
from ragkv.engine.kv.state import DecodeState
from ragkv.engine.measure.flops import attention_flops, head_flops, linear_flops, rows_flops
from ragkv.engine.measure.stats import RequestStats
from ragkv.engine.recompute.base import Selection
from ragkv.engine.recompute.record import Recompute
from ragkv.engine.recompute.registry import register
from ragkv.engine.recompute.rows import RecomputedRows, check_recomputable, keep_count
from ragkv.models.loop import Forward, computed

if TYPE_CHECKING:  # annotations only: the options import the selections
    from ragkv.engine.request.fusion import FusionOptions


GRADUAL_SPREAD = 0.5  # gradual filtering starts at r + 0.5 min(r, 1 - r) and ends at r - 0.5 min(r, 1 - r)


def check_ratios(opts: FusionOptions, num_layers: int) -> list[float]:
    """Kept fraction after each check layer.

    Gradual filtering (CacheBlend, Yao et al. 2025, sec. 4.3): select slightly more than r at the first check
    layer and narrow it at each later one, each layer choosing among the previous layer's selection, so that the
    selection averages r over the layers it applies to (check layer j's ratio holds until the next check layer, the
    last one's until the last layer): r_j = r + d (c_j - c̄), c_j = (m - 1 - 2j) / (m - 1), c̄ the layer-weighted
    mean of c, d = GRADUAL_SPREAD * min(r, 1 - r). Narrowing, inside [0, 1] (|c_j - c̄| <= 2), and the work equals
    the stated r; r = 0 and r = 1 stay exact (invariant 6). Averaging over the check layers only, as this code did
    before, left every later layer at r - d. Without gradual filtering the one selection keeps r."""
    checks, r = list(opts.check_layers), opts.ratio
    m = len(checks)
    if not (opts.gradual and m > 1):
        return [r] * m
    spans = [b - a for a, b in zip(checks, checks[1:] + [num_layers])]  # layers each ratio applies to
    c = [(m - 1 - 2 * j) / (m - 1) for j in range(m)]
    mean_c = sum(w * x for w, x in zip(spans, c)) / sum(spans)
    d = GRADUAL_SPREAD * min(r, 1.0 - r)
    return [min(1.0, max(0.0, r + d * (x - mean_c))) for x in c]


class BlendPlan(RecomputedRows):
    """All rows start in x; before each layer the cached context is fetched and written; at a check layer the
    candidates' fresh V (or K) is compared with the cached one and only the most deviating block tokens (plus
    sinks and every query token) go on. Rows write their fresh K/V over the cached ones and attend causally."""

    def __init__(self, model, cache: KVCache, layer_iter, layout: Layout, total: int, opts: FusionOptions,
                 stats: RequestStats):
        dev = model.device
        self.model, self.cache, self.layers, self.stats, self.opts = model, cache, iter(layer_iter), stats, opts
        self.N, self.P, self.total = layout.context_len, layout.prefix_len, total
        self.n_block = self.N - self.P
        check_recomputable(model, layout, total)
        self.cos, self.sin = context_rotation(model, layout)
        self.all_positions = torch.arange(total, device=dev)  # sequential layout: cache index == position
        self.within = torch.full((total,), -1, device=dev)  # index inside its block, for attention sinks
        self.blocks = list(zip(layout.block_offsets(), layout.block_lens))
        for off, n in self.blocks:
            self.within[off:off + n] = torch.arange(n, device=dev)
        self.ratios = dict(zip(opts.check_layers, check_ratios(opts, model.args.num_layers)))
        self.first_check, self.last_check = min(opts.check_layers), opts.check_layers[-1]
        self.unread = 0  # cached layers passed over: every row is recomputed before the first check layer
        self.sel = self.all_positions  # cache indices of the rows in x, ascending
        self.positions = self.sel
        self.deviation = torch.zeros(total, device=dev, dtype=torch.float32)
        self.kept_block = self.n_block
        self.pending = None       # check_rows="all": the rows kept at the check layer, dropped from the next one
        self.token_layers = 0     # rows through attention + MLP, summed over layers
        self.projected_rows = 0   # candidate rows whose V (or K) was projected at check layers, to compare

    def begin(self, layer, decoder_layer, x):
        if self.pending is not None:
            keep, self.pending = self.pending, None
            self.sel = self.positions = self.sel[keep]
            x = x[:, keep]
        if layer < self.first_check:
            # every row (context and query) is computed afresh here and overwrites the cached layer: do not wait
            # for it; the stream's item is dropped at the next load, by when it has long arrived (on a slow tier
            # the first layer's load was the one not hidden behind compute)
            self.unread += 1
        else:
            while self.unread and self.N:
                self.unread -= 1
                t0 = time.perf_counter()
                next(self.layers)
                self.stats.fetch_ms += (time.perf_counter() - t0) * 1000
            load_context_layer(self, layer)
        if layer in self.ratios and self.n_block:
            x = self._select(layer, decoder_layer, x)
        self.token_layers += x.shape[1]
        return x

    def _select(self, layer, decoder_layer, x):
        opts, sel, N, P = self.opts, self.sel, self.N, self.P
        is_cand = (sel >= P) & (sel < N)
        rows = is_cand.nonzero().squeeze(1)
        idx = sel[rows]
        self.projected_rows += len(rows)
        if opts.deviation == "v":
            fresh, cached = decoder_layer.project_v(x[:, rows]), self.cache.values[layer][:, :, idx]
        else:  # post-RoPE K deviation equals raw-K deviation (RoPE is a rotation); compare rotated
            _, k, _ = decoder_layer.project_qkv(x[:, rows], need_q=False)
            fresh, cached = self.model.rope(k, self.all_positions[idx]), self.cache.keys[layer][:, :, idx]
        self.deviation[idx] += (fresh.float() - cached.float()).pow(2).sum(dim=(0, 1, 3))
        if not (opts.gradual or layer == self.last_check):
            return x
        keep = torch.zeros(len(sel), dtype=torch.bool, device=x.device)
        groups = [(off, off + n) for off, n in self.blocks] if opts.select_per_block else [(P, N)]
        for lo, hi in groups:  # the top r of each group by deviation (one group: all block tokens)
            in_group = rows[(idx >= lo) & (idx < hi)]
            n_keep = min(keep_count(self.ratios[layer], hi - lo), len(in_group))
            if n_keep:
                keep[in_group[torch.topk(self.deviation[sel[in_group]], n_keep).indices]] = True
        if opts.sink_tokens:
            keep |= is_cand & (self.within[sel] < opts.sink_tokens)
        keep |= sel >= N  # every query token is always recomputed
        self.deviation.zero_()
        self.kept_block = int((keep & is_cand).sum())
        if opts.check_rows == "all":  # this layer still runs every row; the selection starts at the next
            self.pending = keep
            return x
        self.sel = self.positions = sel[keep]
        return x[:, keep]



@torch.inference_mode()
def prefill_blend(model, layer_iter, layout: Layout, context_ids: list[int], query_ids: list[int],
                  opts: FusionOptions, capacity: int, stats: RequestStats) -> DecodeState:
    N, Tq = layout.context_len, len(query_ids)
    total = N + Tq
    cache = KVCache.for_model(model, max(capacity, total))
    t0, before = time.perf_counter(), stats.fetch_ms + stats.rerotate_ms
    plan = BlendPlan(model, cache, layer_iter, layout, total, opts, stats)
    x = yield from computed(Forward(model, model.embed(torch.tensor([context_ids + query_ids], device=model.device)),
                                    plan))
    cache.commit(total)
    logits = model.logits(x[:, -1:])[0, -1]
    stats.recompute_ms += (time.perf_counter() - t0) * 1000 - (stats.fetch_ms + stats.rerotate_ms - before)
    stats.recomputed_tokens += plan.kept_block + Tq
    stats.reused_tokens += N - plan.kept_block
    stats.recomputed_token_layers = plan.token_layers
    sel = plan.sel if plan.pending is None else plan.sel[plan.pending]
    per_block = [int(((sel >= off) & (sel < off + n)).sum()) for off, n in plan.blocks]
    # CacheBlend records no risk signals (its deviation check is not a stage-1 answer)
    stats.recompute = Recompute(select="deviation", block_tokens=plan.n_block, selected=plan.kept_block,
                                selected_per_block=per_block, check_layers=list(opts.check_layers),
                                projected_rows=plan.projected_rows)
    return DecodeState(cache, total, logits)


@register
class Deviation(Selection):
    name = "deviation"
    summary = "CacheBlend: the tokens whose KV deviates most at the check layer(s)"
    source = "CacheBlend, Yao et al., EuroSys'25 (arXiv 2405.16444), sec. 4.2-4.3"

    def prefill(self, model, layer_iter, layout, context_ids, query_ids, fusion, capacity, stats, signal, expect=None):
        # no stage-1 answer to read risk signals from: `expect` goes unused
        return (yield from prefill_blend(model, layer_iter, layout, context_ids, query_ids, fusion, capacity, stats))

    def first_token_flops(self, a, fusion, context, query, prefix_len=0, reused=0):
        L, check = a.num_layers, fusion.check_layers[0]
        early = rows_flops(a, 0, context + query, check)  # layers before the check: every token
        check_v = 2 * a.hidden_size * a.num_kv_heads * a.head_dim * (context - prefix_len)
        selected = keep_count(fusion.ratio, context - prefix_len)
        rows = selected + query  # selected block tokens spread over the context: attend ~half of it on average
        late = (L - check) * (rows * linear_flops(a) + attention_flops(a, selected * context // 2
                                                                     + query * context + query * query // 2))
        return early + check_v + late + head_flops(a)
