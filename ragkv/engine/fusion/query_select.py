"""Selective recompute by a selection known before recomputing: query-aware (ProphetKV, Wang et al., ICML 2026,
arXiv 2602.02579) and chunk-link sinks (EPIC, ICML 2025, arXiv 2410.15332).

ProphetKV's method section could not be read here; the scoring and fusion follow a public reimplementation that
cites the paper's Algorithm 1 and eq. 8 (vLLM fork omerpaz95/vllm, prophet_kv.py): stage-1 softmax over the
context keys only, summed over heads and query tokens, averaged uniformly over all layers, one global top-k.

ProphetKV's dual-stage pipeline: stage 1 is `reuse` (the query's rows over the reused, re-rotated block KV) and
records, at every layer, how much attention the query gives each context token; the per-layer scores are fused
into one relevance score and the top r of the block tokens are chosen. Stage 2 recomputes only those tokens and the
query, at every layer from the embeddings on, over the cache stage 1 filled: each layer's selected rows overwrite
their reused K/V and attend causally to the whole context (ragkv/engine/fusion/blend.py's row attention). No token runs
through a full layer 0 or a check layer (CacheBlend's cost): the work is Tq rows x L layers for stage 1 plus
(k + Tq) rows x L for stage 2, which is what `recomputed_token_layers` counts.

EPIC's LegoLink needs no stage 1: each block's first `sink_tokens` tokens (where its own attention sink sits) and
the query are recomputed, nothing chosen at run time. So it runs in one pass: before each layer the reused context
is fetched and re-rotated into the cache, then the sink rows and the query overwrite theirs and attend (the query
runs once, not in a stage 1 and again in stage 2): Tq + sinks rows x L. `recent` is static too: the last r of the
block tokens (those nearest the query, which in a full prefill have read every earlier passage), per block with
`select_per_block` (each block's tail), plus any sinks; same one pass.

With `draft_tokens` (an extension of this project, not in ProphetKV): after stage 1, a greedy draft of that many
tokens is decoded over the reused cache, each draft row's attention recorded like the query's, and the rows are
then forgotten; the fused score sums the query's and the draft's rows. The question says what is asked, the draft
what the answer will read. Measured (docs/results/quality_selection.md, session 27): +6.7 points at r=0.15 on NQ-10
with the gold passage farthest from the question, nothing where it is near; counted work is the draft's rows at
every layer (~1%), but its time is N sequential decode steps. So that those steps are not all thrown away, stage 2
runs the draft's rows after the query (N more rows, counted): while the answer repeats the draft, decoding takes
its tokens' rows without a forward (DecodeState.lookahead; speculative decoding with the draft as the guess).

Invariants (tests/test_fusion_invariants.py): selecting every block token equals `full`; selecting none (r = 0,
no sinks) leaves stage 1's result, which is `reuse`.
"""

from __future__ import annotations

import math
import time

import torch

from ragkv.engine.fusion.blend import RecomputedRows, keep_count
from ragkv.engine.fusion.context import context_rotation, load_context_layer, prefill_over_context
from ragkv.engine.fusion.layout import Layout
from ragkv.engine.kv.kvcache import KVCache
from ragkv.engine.kv.state import DecodeState, decode_step
from ragkv.engine.measure.risk import DEFAULT_SIGNAL, measure
from ragkv.engine.measure.stats import RequestStats
from ragkv.errors import InvalidRequestError
from ragkv.models.loop import Forward, computed
from ragkv.ops.attention import prefill_mask, sdpa


class QueryAttentionRecorder:
    """An attention policy for stage 1: the query rows' ordinary attention, plus, per layer, each context token's
    relevance to the query: alpha_l(t) = sum over heads and query tokens of softmax_t(Q K'_{1:C}^T / sqrt(d)), the
    softmax over the context keys only (ProphetKV's stage-1 score over the reused K') [N] fp32."""

    def __init__(self, context_len: int):
        self.N = context_len
        self.layer_scores: list[torch.Tensor] = []

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [1, Hq, Tq, D]; k, v: [1, Hkv, N + Tq, D]
        Tq, total = q.shape[2], k.shape[2]
        out = sdpa(q, k, v, mask=prefill_mask(Tq, total, None, q.device))
        if self.N:  # query heads grouped by the KV head they share (head h reads KV head h // groups): no K copy
            Hkv, D = k.shape[1], q.shape[-1]
            qg = q.float().reshape(1, Hkv, -1, D)  # [1, Hkv, groups * Tq, D]
            ctx = k[:, :, :self.N].float()
            probs = (qg @ ctx.transpose(-1, -2) / math.sqrt(D)).softmax(dim=-1)  # [1, Hkv, groups * Tq, N]
            self.layer_scores.append(probs.sum(dim=(1, 2))[0])
        return out


def fuse_layer_scores(layer_scores: list[torch.Tensor]) -> torch.Tensor:
    """ProphetKV's uniform fusion: the mean over layers of alpha_l(t) (each layer's scores sum to the same
    heads x query tokens, so no layer dominates). A draft adds one entry per layer and step: the mean then ranks
    tokens as the sum over layers and over the query's and the draft's rows, each row weighing the same."""
    return torch.stack(layer_scores).mean(dim=0)


def record_draft(model, state: DecodeState, recorder: QueryAttentionRecorder, n: int,
                 stats: RequestStats) -> list[int]:
    """Decode a greedy draft of `n` tokens over stage 1's cache with `recorder` as the attention policy (each draft
    row's attention to the context joins the query's scores), then forget it: the cache, position and logits are
    stage 1's again. Returns the draft's tokens."""
    start, logits, policy = state.next_position, state.logits, state.attention
    state.attention, draft = recorder, [int(logits.argmax())]
    t0 = time.perf_counter()
    for _ in range(n):
        draft.append(int(decode_step(model, state, draft[-1]).argmax()))
    state.cache.truncate(start)
    state.next_position, state.logits, state.attention = start, logits, policy
    stats.recomputed_token_layers += n * model.args.num_layers
    stats.extra.update(draft_ms=round((time.perf_counter() - t0) * 1000, 3), draft=draft[:n])
    return draft[:n]


def choose_tokens(score: torch.Tensor | None, layout: Layout, ratio: float, sink_tokens: int,
                  per_block: bool) -> torch.Tensor:
    """Cache indices (ascending) of the block tokens to recompute: the top r by `score` (over all blocks, or per
    block), plus each block's first `sink_tokens`. The shared prefix is never chosen (it is computed exactly)."""
    dev = score.device if score is not None else layout.context_positions.device  # the layout lives on the CPU
    chosen = torch.zeros(layout.context_len, dtype=torch.bool, device=dev)
    blocks = list(zip(layout.block_offsets(), layout.block_lens))
    groups = blocks if per_block else [(layout.prefix_len, layout.context_len - layout.prefix_len)]
    if score is not None:
        for off, n in groups:
            k = keep_count(ratio, n)
            if k:
                chosen[off + torch.topk(score[off:off + n], k).indices] = True
    for off, n in blocks:
        chosen[off:off + min(sink_tokens, n)] = True
    return chosen.nonzero().squeeze(1)


def uncovered_share(score: torch.Tensor | None, chosen: torch.Tensor, prefix_len: int) -> float | None:
    """The share of the fused stage-1 attention to block tokens that falls on tokens not recomputed."""
    if score is None:
        return None
    total = float(score[prefix_len:].sum())
    return 1.0 - float(score[chosen].sum()) / total if total > 0 else 0.0


def per_block_counts(chosen: torch.Tensor, layout: Layout) -> list[int]:
    return [int(((chosen >= o) & (chosen < o + n)).sum()) for o, n in zip(layout.block_offsets(), layout.block_lens)]


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


def check_selectable(model, layout: Layout, total: int) -> None:
    """What every selection but CacheBlend's needs: no sliding window within the prompt, the sequential layout."""
    window = model.args.sliding_window
    if window is not None and window < total:
        raise InvalidRequestError("query-aware and sink selections are not supported past a sliding window; use "
                                  "reuse or full")
    if layout.query_start != layout.context_len:
        raise InvalidRequestError("selective recompute needs the sequential layout (cache index == position)")


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


@torch.inference_mode()
def prefill_query_aware(model, layer_iter, layout: Layout, context_ids: list[int], query_ids: list[int],
                        ratios: tuple[float, ...], sink_tokens: int, per_block: bool, capacity: int,
                        stats: RequestStats, max_signal: float | None = None,
                        signal: str = DEFAULT_SIGNAL, draft_tokens: int = 0, expect=None) -> DecodeState:
    """ProphetKV's two stages (the static selections run `prefill_static` instead: selections/base.py). With
    several `ratios` (the quality-bounded mode), stage 2 runs
    again at the next ratio while the risk `signal` (engine/measure/risk.py: e.g. KL(this answer's first-token
    distribution || the previous one's)) exceeds `max_signal`: the answer is at risk. A larger selection contains
    the smaller one, so stage 2 simply runs again over the same cache (each layer's selected rows are overwritten
    before they are attended). `draft_tokens`: a draft's attention joins the query's (record_draft). `expect(logits,
    share)`: the reply's expected KL to `full` at that recomputed share (the `expected_kl` signal)."""
    N, Tq, L = layout.context_len, len(query_ids), model.args.num_layers
    total = N + Tq
    check_selectable(model, layout, total)
    recorder = QueryAttentionRecorder(N)
    room = max(capacity, total + draft_tokens)  # the draft's rows too, so its decode never regrows the cache
    stage1 = yield from prefill_over_context(model, layer_iter, layout, query_ids, room, stats, recorder)
    stats.recomputed_token_layers += Tq * L
    draft = record_draft(model, stage1, recorder, draft_tokens, stats) if draft_tokens and N else []
    score = fuse_layer_scores(recorder.layer_scores) if N else None
    logits, chosen, risks, ahead = stage1.logits, torch.zeros(0, dtype=torch.long, device=model.device), [], []
    t0 = time.perf_counter()
    for ratio in ratios:
        chosen = choose_tokens(score, layout, ratio, sink_tokens, per_block).to(model.device)
        if not len(chosen):  # nothing to recompute: stage 1's answer is `reuse`'s
            continue
        # the draft's rows run too, after the query: if the answer begins as the draft did, decoding takes those
        # tokens without a forward (DecodeState.lookahead; each is the row a decode step would compute)
        rows = torch.cat([chosen, torch.arange(N, total + len(draft), device=chosen.device)])
        ids = torch.tensor(context_ids + query_ids + draft, device=model.device)[rows].unsqueeze(0)
        x = yield from computed(Forward(model, model.embed(ids), SelectedRowsPlan(stage1.cache, rows,
                                                                                  total + len(draft))))
        out = model.logits(x[:, -1 - len(draft):])[0]
        new, ahead = out[0], list(zip(draft, out[1:]))
        stats.recomputed_token_layers += len(rows) * L
        estimate = None if expect is None else expect(new, stats.recomputed_token_layers / max(1, total * L))
        risks.append(measure(new, logits, uncovered_share(score, chosen, layout.prefix_len), estimate))
        logits = new
        if max_signal is None or risks[-1][signal] <= max_signal:
            break
    stats.recompute_ms += (time.perf_counter() - t0) * 1000
    stats.reused_tokens -= len(chosen)
    stats.recomputed_tokens += len(chosen)
    record_selection(stats, "query", chosen, layout, risks, signal)
    stage1.cache.commit(len(ahead))
    return DecodeState(stage1.cache, total, logits, lookahead=ahead)


def record_selection(stats: RequestStats, select: str, chosen: torch.Tensor, layout: Layout, risks: list[dict],
                     signal: str) -> None:
    """What was selected and each stage-2 run's risk signals into the request's record; `risk` is the first
    (cheap) answer's, the one that decided escalation."""
    block_tokens = layout.context_len - layout.prefix_len
    stats.extra.update(select=select, selected=len(chosen), block_tokens=block_tokens,
                       selected_per_block=per_block_counts(chosen, layout))
    if risks:
        stats.extra.update(stage2_kl=[r["shift"] for r in risks], stage2_risks=risks, risk=risks[0],
                           risk_signal=signal, final_ratio=len(chosen) / max(1, block_tokens),
                           escalations=len(risks) - 1)
