"""`query`: ProphetKV's query-aware selective recompute (Wang et al., ICML 2026, arXiv 2602.02579).

ProphetKV's method section could not be read here; the scoring and fusion follow a public reimplementation that
cites the paper's Algorithm 1 and eq. 8 (vLLM fork omerpaz95/vllm, prophet_kv.py): stage-1 softmax over the
context keys only, summed over heads and query tokens, averaged uniformly over all layers, one global top-k.

ProphetKV's dual-stage pipeline: stage 1 is `reuse` (the query's rows over the reused, re-rotated block KV) and
records, at every layer, how much attention the query gives each context token; the per-layer scores are fused
into one relevance score and the top r of the block tokens are chosen. Stage 2 recomputes only those tokens and the
query, at every layer from the embeddings on, over the cache stage 1 filled: each layer's selected rows overwrite
their reused K/V and attend causally to the whole context (rows.py's row attention). No token runs
through a full layer 0 or a check layer (CacheBlend's cost): the work is Tq rows x L layers for stage 1 plus
(k + Tq) rows x L for stage 2, which is what `recomputed_token_layers` counts.

With `draft_tokens` (an extension of this project, not in ProphetKV): after stage 1, a greedy draft of that many
tokens is decoded over the reused cache, each draft row's attention recorded like the query's, and the rows are
then forgotten; the fused score sums the query's and the draft's rows. The question says what is asked, the draft
what the answer will read. Measured (docs/results/quality_selection.md): +6.7 points at r=0.15 on NQ-10
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

from ragkv.engine.fusion.context import query_rows_over_context
from ragkv.engine.fusion.layout import Layout
from ragkv.engine.kv.state import DecodeState, decode_step
from ragkv.engine.measure.flops import attention_flops, head_flops, linear_flops, rows_flops
from ragkv.engine.measure.risk import DEFAULT_SIGNAL, measure
from ragkv.engine.measure.stats import RequestStats
from ragkv.engine.recompute.base import Selection, record_selection
from ragkv.engine.recompute.registry import register
from ragkv.engine.recompute.rows import SelectedRowsPlan, check_recomputable, choose_tokens, keep_count
from ragkv.models.loop import Forward, computed
from ragkv.ops.attention import causal_attention, prefill_mask
from ragkv.ops.context_mass import context_mass


class QueryAttentionRecorder:
    """An attention policy for stage 1: the query rows' ordinary attention, plus, per layer, each context token's
    relevance to the query: alpha_l(t) = sum over heads and query tokens of softmax_t(Q K'_{1:C}^T / sqrt(d)), the
    softmax over the context keys only (ProphetKV's stage-1 score over the reused K') [N] fp32. With `layers`, only
    those layers' scores are kept (QCFuse's critical layers); empty: every layer."""

    def __init__(self, context_len: int, layers: tuple[int, ...] = ()):
        self.N = context_len
        self.layers = frozenset(layers)
        self.layer_scores: list[torch.Tensor] = []

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [1, Hq, Tq, D]; k, v: [1, Hkv, N + Tq, D]
        Tq, total = q.shape[2], k.shape[2]
        out = causal_attention(q, k, v, total - Tq, prefill_mask(Tq, total, None, q.device))
        if self.N and (not self.layers or layer in self.layers):
            mass = context_mass(q, k, self.N)  # bf16 on AVX-512 BF16: one pass (ops/context_mass.py)
            if mass is not None:
                self.layer_scores.append(mass)
                return out
            # query heads grouped by the KV head they share (head h reads KV head h // groups): no K copy
            Hkv, D = k.shape[1], q.shape[-1]
            qg = q.float().reshape(1, Hkv, -1, D) * (1.0 / math.sqrt(D))  # [1, Hkv, groups * Tq, D], scaled here
            s = qg @ k[:, :, :self.N].float().transpose(-1, -2)  # [1, Hkv, groups * Tq, N]
            # the softmax by hand: where a row's scores spread over 100+ (as some heads' do), e^x far below -88
            # sends torch's exp to a slow path (3.1 ms against 0.8 for 322 rows x 1.3K keys, random scores); a
            # probability under e^-80 of the row's largest (a share < 2e-35) is held there. The rows' sums of
            # probabilities are one product.
            e = s.sub_(s.amax(dim=-1, keepdim=True)).clamp_(min=-80.0).exp_()
            inverse_sums = e.sum(dim=-1, keepdim=True).reciprocal_()  # [1, Hkv, groups * Tq, 1]
            self.layer_scores.append((inverse_sums.transpose(-1, -2) @ e).sum(dim=(0, 1, 2)))
        return out


def fuse_layer_scores(layer_scores: list[torch.Tensor]) -> torch.Tensor:
    """ProphetKV's uniform fusion: the mean over layers of alpha_l(t) (each layer's scores sum to the same
    heads x query tokens, so no layer dominates). A draft adds one entry per layer and step: the mean then ranks
    tokens as the sum over layers and over the query's and the draft's rows, each row weighing the same."""
    return torch.stack(layer_scores).mean(dim=0)


def record_draft(model, state: DecodeState, recorder: QueryAttentionRecorder, n: int,
                 stats: RequestStats) -> tuple[list[int], float]:
    """Decode a greedy draft of `n` tokens over stage 1's cache with `recorder` as the attention policy (each draft
    row's attention to the context joins the query's scores), then forget it: the cache, position and logits are
    stage 1's again. Returns the draft's tokens and its ms."""
    start, logits, policy = state.next_position, state.logits, state.attention
    state.attention, draft = recorder, [int(logits.argmax())]
    t0 = time.perf_counter()
    for _ in range(n):
        draft.append(int(decode_step(model, state, draft[-1]).argmax()))
    state.cache.truncate(start)
    state.next_position, state.logits, state.attention = start, logits, policy
    stats.recomputed_token_layers += n * model.args.num_layers
    return draft[:n], round((time.perf_counter() - t0) * 1000, 3)


def uncovered_share(score: torch.Tensor | None, chosen: torch.Tensor, prefix_len: int) -> float | None:
    """The share of the fused stage-1 attention to block tokens that falls on tokens not recomputed."""
    if score is None:
        return None
    total = float(score[prefix_len:].sum())
    return 1.0 - float(score[chosen].sum()) / total if total > 0 else 0.0


@torch.inference_mode()
def prefill_query_aware(model, layer_iter, layout: Layout, context_ids: list[int], query_ids: list[int],
                        ratios: tuple[float, ...], sink_tokens: int, per_block: bool, capacity: int,
                        stats: RequestStats, max_signal: float | None = None,
                        signal: str = DEFAULT_SIGNAL, draft_tokens: int = 0, expect=None,
                        score_layers: tuple[int, ...] = (), whole_blocks: int = 0) -> DecodeState:
    """ProphetKV's two stages (the static selections run `prefill_static` instead: selections/base.py). With
    several `ratios` (the quality-bounded mode), stage 2 runs
    again at the next ratio while the risk `signal` (engine/measure/risk.py: e.g. KL(this answer's first-token
    distribution || the previous one's)) exceeds `max_signal`: the answer is at risk. A larger selection contains
    the smaller one, so stage 2 simply runs again over the same cache (each layer's selected rows are overwritten
    before they are attended). `draft_tokens`: a draft's attention joins the query's (record_draft). `expect(logits,
    share)`: the reply's expected KL to `full` at that recomputed share (the `expected_kl` signal).
    `score_layers`: the layers whose scores are fused (empty: all); `whole_blocks`: the passages with the most of the
    query's attention recomputed whole, inside the budget (rows.choose_tokens)."""
    N, Tq, L = layout.context_len, len(query_ids), model.args.num_layers
    total = N + Tq
    check_recomputable(model, layout, total)
    recorder = QueryAttentionRecorder(N, score_layers)
    room = max(capacity, total + draft_tokens)  # the draft's rows too, so its decode never regrows the cache
    stage1, last = yield from query_rows_over_context(model, layer_iter, layout, query_ids, room, stats, recorder)
    stats.recomputed_token_layers += Tq * L
    def stage1_logits():  # alone: a draft needs them first, or nothing was recomputed
        return model.logits(last)[0, -1]

    if draft_tokens and N:  # the draft starts from stage 1's next token
        stage1.logits = stage1_logits()
    draft, draft_ms = record_draft(model, stage1, recorder, draft_tokens, stats) if draft_tokens and N else ([], 0.0)
    score = fuse_layer_scores(recorder.layer_scores) if N else None
    logits, chosen, risks, ahead = stage1.logits, torch.zeros(0, dtype=torch.long, device=model.device), [], []
    t0 = time.perf_counter()
    for ratio in ratios:
        chosen = choose_tokens(score, layout, ratio, sink_tokens, per_block, whole_blocks).to(model.device)
        if not len(chosen):  # nothing to recompute: stage 1's answer is `reuse`'s
            continue
        # the draft's rows run too, after the query: if the answer begins as the draft did, decoding takes those
        # tokens without a forward (DecodeState.lookahead; each is the row a decode step would compute)
        rows = torch.cat([chosen, torch.arange(N, total + len(draft), device=chosen.device)])
        ids = torch.tensor(context_ids + query_ids + draft, device=model.device)[rows].unsqueeze(0)
        x = yield from computed(Forward(model, model.embed(ids), SelectedRowsPlan(stage1.cache, rows,
                                                                                  total + len(draft))))
        rows_out = x[:, -1 - len(draft):]
        if logits is None:  # stage 1's LM head runs beside stage 2's: its weights (~0.3 GB on the 0.5B) read once
            out = model.logits(torch.cat([last, rows_out], dim=1))[0]
            logits, out = out[0], out[1:]
        else:
            out = model.logits(rows_out)[0]
        new, ahead = out[0], list(zip(draft, out[1:]))
        stats.recomputed_token_layers += len(rows) * L
        estimate = None if expect is None else expect(new, stats.recomputed_token_layers / max(1, total * L))
        risks.append(measure(new, logits, uncovered_share(score, chosen, layout.prefix_len), estimate))
        logits = new
        if max_signal is None or risks[-1][signal] <= max_signal:
            break
    if logits is None:  # nothing was recomputed: the answer is stage 1's
        logits = stage1_logits()
    stats.recompute_ms += (time.perf_counter() - t0) * 1000
    stats.reused_tokens -= len(chosen)
    stats.recomputed_tokens += len(chosen)
    record_selection(stats, "query", chosen, layout, risks, signal, draft=draft, draft_ms=draft_ms)
    stage1.cache.commit(len(ahead))
    return DecodeState(stage1.cache, total, logits, lookahead=ahead)


def scoring_layers(fusion, num_layers: int) -> tuple[int, ...]:
    """The layers whose scores rank the tokens: `score_layers` as named, or every layer from `score_from` of the
    depth on (empty: all of them, ProphetKV's uniform fusion)."""
    if fusion.score_layers or not fusion.score_from:
        return fusion.score_layers
    return tuple(range(min(num_layers - 1, int(fusion.score_from * num_layers)), num_layers))


@register
class QueryAware(Selection):
    name = "query"
    summary = "ProphetKV: the tokens the query (and a draft) attends to most over the reused cache"
    scores_by_query = True
    source = "ProphetKV, arXiv 2602.02579 (scoring as in the public reimplementation omerpaz95/vllm prophet_kv.py)"

    def prefill(self, model, layer_iter, layout, context_ids, query_ids, fusion, capacity, stats, signal,
                ratios=None, max_signal=None, expect=None):
        """`ratios`, `max_signal`: `auto`'s escalation (stage 2 again at the next ratio while the risk exceeds);
        `expect`: the `expected_kl` signal's estimator."""
        return (yield from prefill_query_aware(model, layer_iter, layout, context_ids, query_ids,
                                               ratios or (fusion.ratio,), fusion.sink_tokens, fusion.select_per_block,
                                               capacity, stats, max_signal, signal, fusion.draft_tokens, expect,
                                               scoring_layers(fusion, model.args.num_layers), fusion.whole_blocks))

    def first_token_flops(self, a, fusion, context, query, prefix_len=0, reused=0):
        # stage 1 (reuse's query rows), then the chosen rows and the query at every layer
        L = a.num_layers
        chosen = keep_count(fusion.ratio, context - prefix_len)
        rows = chosen + query
        stage2 = L * (rows * linear_flops(a) + attention_flops(a, chosen * context // 2 + query * context))
        return rows_flops(a, context, query, L) + stage2 + head_flops(a)
