"""docs/invariants.md, invariants 1 and 3-8, on tiny random models (fp32, tight tolerances)."""

import pytest
import torch
from tiny import IdText, make_segs, rand_ids

from ragkv.engine.blocks.encode import encode_block
from ragkv.engine.fusion.ape import ApeAttention
from ragkv.engine.fusion.context import prefill_over_context
from ragkv.engine.fusion.layout import make_layout
from ragkv.engine.kv.kvcache import KVCache
from ragkv.engine.kv.state import decode_step
from ragkv.engine.kv.stepwise import drain
from ragkv.engine.measure.stats import RequestStats
from ragkv.engine.modes import get_mode
from ragkv.engine.options import FusionOptions, validate_fusion
from ragkv.engine.request.segments import Segments
from ragkv.engine.recompute import SELECTIONS, get_selection
from ragkv.engine.recompute.base import Selection
from ragkv.errors import InvalidRequestError, OptionError
from ragkv.ops.attention import attention_with_lse, block_attention_mask, merge_by_lse, sdpa
from ragkv.store.memory import MemoryStore

TOL = 1e-4




def maxdiff(a, b):
    return (a.cpu() - b.cpu()).abs().max().item()


def test_rope_of_raw_k_equals_model_k_at_any_position(tiny_loaded):
    """Invariant 1: a block's raw K re-rotated to position p equals the K computed with the block at p."""
    model = tiny_loaded["llama3"].model
    ids = rand_ids(24, 3)
    raw = encode_block(model, ids)  # encoded at positions 0..23
    for p in (0, 37, 300):
        cache = KVCache.for_model(model)
        positions = torch.arange(p, p + 24, device=model.device)
        model(torch.tensor([ids], device=model.device), positions=positions, cache=cache)
        for layer in range(model.args.num_layers):
            rotated = model.rope(raw.keys[layer].unsqueeze(0), positions)
            assert maxdiff(rotated, cache.layer(layer)[0]) <= TOL
            assert maxdiff(raw.values[layer].unsqueeze(0), cache.layer(layer)[1]) <= TOL


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_prefix_mode_equals_full(arch, tiny_engine):
    eng = tiny_engine(arch)
    segs = make_segs()
    full, _ = eng.prefill(segs, FusionOptions(mode="full"))
    opts = FusionOptions(mode="prefix", prefix_chunk=8)
    cold, s1 = eng.prefill(segs, opts)
    warm, s2 = eng.prefill(segs, opts)
    assert s1.reused_tokens == 0 and s2.reused_tokens == (segs.num_tokens - 1) // 8 * 8
    assert maxdiff(cold.logits, full.logits) <= TOL and maxdiff(warm.logits, full.logits) <= TOL
    # a different suffix still reuses the shared chunks
    other = Segments(segs.prefix, segs.blocks[:1], rand_ids(15, 7))
    ref, _ = eng.prefill(other, FusionOptions(mode="full"))
    got, s3 = eng.prefill(other, opts)
    assert s3.reused_tokens > 0 and maxdiff(got.logits, ref.logits) <= TOL
    for tok in (5, 9):
        assert maxdiff(decode_step(eng.model, warm, tok), decode_step(eng.model, full, tok)) <= TOL


def block_mask_forward(model, segs, extra=()):
    """One forward of the whole sequence under the Block-Attention mask (query and `extra` see all)."""
    ids = segs.all_ids() + list(extra)
    seg = [0] * len(segs.prefix)
    for i, b in enumerate(segs.blocks):
        seg += [i + 1] * len(b)
    open_id = len(segs.blocks) + 1
    seg += [open_id] * (len(segs.query) + len(extra))
    mask = block_attention_mask(torch.tensor(seg, device=model.device), torch.tensor([open_id], device=model.device))
    return model(torch.tensor([ids], device=model.device), mask=mask, all_logits=True)[0]


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2"])
def test_reuse_equals_block_mask_forward(arch, tiny_engine):
    """Invariant 4: `reuse` == one forward under the block mask, for the prompt and for decoding."""
    eng = tiny_engine(arch)
    segs = make_segs()
    state, stats = eng.prefill(segs, FusionOptions(mode="reuse"))
    ref = block_mask_forward(eng.model, segs, extra=[42])
    assert stats.cache_misses == 4 and stats.reused_tokens == segs.num_tokens - len(segs.query)
    assert maxdiff(state.logits, ref[-2]) <= TOL
    assert maxdiff(decode_step(eng.model, state, 42), ref[-1]) <= TOL
    _, again = eng.prefill(segs, FusionOptions(mode="reuse"))
    assert again.cache_hits == 4 and again.cache_misses == 0


def test_reuse_with_one_block_and_no_prefix_equals_full(tiny_engine):
    """Invariant 5."""
    eng = tiny_engine("llama")
    segs = make_segs(prefix=0, blocks=(30,))
    a, _ = eng.prefill(segs, FusionOptions(mode="reuse"))
    b, _ = eng.prefill(segs, FusionOptions(mode="full"))
    assert maxdiff(a.logits, b.logits) <= TOL
    assert maxdiff(decode_step(eng.model, a, 11), decode_step(eng.model, b, 11)) <= TOL


def test_prefix_conditioned_reuse_with_one_block_equals_full(tiny_engine):
    """Invariant 5 with a prefix: a block encoded after the prompt's prefix (conditioning=prefix) is computed as in
    `full` when it is the only one, so the answer is full's; alone-encoded blocks are not. With several blocks the
    entries are APE's (same conditioning, same encoding): a request after `ape` finds them all."""
    eng = tiny_engine("llama")
    one = make_segs(blocks=(30,))
    full, _ = eng.prefill(one, FusionOptions(mode="full"))
    cond, _ = eng.prefill(one, FusionOptions(mode="reuse", conditioning="prefix"))
    alone, _ = eng.prefill(one, FusionOptions(mode="reuse"))
    assert maxdiff(cond.logits, full.logits) <= TOL and maxdiff(alone.logits, full.logits) > 1e-3
    assert maxdiff(decode_step(eng.model, cond, 11), decode_step(eng.model, full, 11)) <= TOL
    segs = make_segs(blocks=(20, 30))
    eng.prefill(segs, FusionOptions(mode="ape"))
    _, stats = eng.prefill(segs, FusionOptions(mode="reuse", conditioning="prefix"))
    assert stats.cache_hits == 3 and stats.cache_misses == 0
    with pytest.raises(OptionError, match="conditioning"):
        validate_fusion(FusionOptions(mode="full", conditioning="prefix"))


@pytest.mark.parametrize("select", ["deviation", "query"])
def test_blend_over_prefix_conditioned_blocks_keeps_the_extremes(tiny_engine, select):
    """Invariant 6 over prefix-conditioned blocks: r=1 equals full, r=0 equals reuse of the same blocks."""
    eng = tiny_engine("qwen2")
    segs = make_segs(blocks=(20, 30, 25))
    full, _ = eng.prefill(segs, FusionOptions(mode="full"))
    reuse, _ = eng.prefill(segs, FusionOptions(mode="reuse", conditioning="prefix"))
    kw = dict(mode="blend", select=select, conditioning="prefix")
    one, _ = eng.prefill(segs, FusionOptions(ratio=1.0, **kw))
    zero, _ = eng.prefill(segs, FusionOptions(ratio=0.0, **kw))
    assert maxdiff(one.logits, full.logits) <= TOL and maxdiff(zero.logits, reuse.logits) <= TOL
    assert maxdiff(reuse.logits, eng.prefill(segs, FusionOptions(mode="reuse"))[0].logits) > 1e-3


@pytest.mark.parametrize("deviation", ["v", "k"])
@pytest.mark.parametrize("checks,gradual", [((1,), False), ((1, 2), True), ((1, 2), False)])
def test_blend_extremes(tiny_engine, deviation, checks, gradual):
    """Invariant 6: blend r=1 == full, r=0 == reuse."""
    eng = tiny_engine("llama")
    segs = make_segs()
    full, _ = eng.prefill(segs, FusionOptions(mode="full"))
    reuse, _ = eng.prefill(segs, FusionOptions(mode="reuse"))
    kw = dict(mode="blend", deviation=deviation, check_layers=checks, gradual=gradual)
    one, s1 = eng.prefill(segs, FusionOptions(ratio=1.0, **kw))
    zero, s0 = eng.prefill(segs, FusionOptions(ratio=0.0, **kw))
    assert maxdiff(one.logits, full.logits) <= TOL
    if gradual or len(checks) == 1:  # non-gradual multi-check recomputes all tokens up to its last check
        assert maxdiff(zero.logits, reuse.logits) <= TOL
    assert s1.recomputed_tokens == segs.num_tokens - len(segs.prefix) and s0.recomputed_tokens == len(segs.query)
    assert maxdiff(decode_step(eng.model, one, 8), decode_step(eng.model, full, 8)) <= TOL


def assert_selection_extremes(eng, segs, kw: dict):
    """Invariant 6 for one selection: r=1 equals `full` (logits and a decode step), r=0 equals `reuse`; returns the
    two runs' stats."""
    full, _ = eng.prefill(segs, FusionOptions(mode="full"))
    reuse, _ = eng.prefill(segs, FusionOptions(mode="reuse"))
    one, s1 = eng.prefill(segs, FusionOptions(ratio=1.0, **kw))
    zero, s0 = eng.prefill(segs, FusionOptions(ratio=0.0, **kw))
    assert maxdiff(full.logits, reuse.logits) > 100 * TOL  # the prompts tell the two apart: not vacuous
    assert maxdiff(one.logits, full.logits) <= TOL
    assert maxdiff(decode_step(eng.model, one, 8), decode_step(eng.model, full, 8)) <= TOL
    assert maxdiff(zero.logits, reuse.logits) <= TOL
    return s1, s0


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_drafts_attention_joins_the_querys_and_the_draft_is_forgotten(tiny_engine, family):
    """Invariant 6 with `draft_tokens`: r=1 equals `full` and r=0 `reuse` (the draft's rows are forgotten: cache,
    position and the next decode step are reuse's); the draft's rows count as work at every layer; and the tokens
    chosen are those a query extended by the draft (reuse's greedy tokens) would choose in one pass."""
    from dataclasses import replace

    eng, n = tiny_engine(family), 4
    segs = make_segs(blocks=(20, 30, 25))
    kw = dict(mode="blend", select="query", draft_tokens=n)
    s1, s0 = assert_selection_extremes(eng, segs, kw)
    Tq, L = len(segs.query), eng.num_layers
    assert s0.recomputed_token_layers == (Tq + n) * L
    assert s1.recomputed_token_layers == (Tq + n + 75 + Tq + n) * L  # stage 2 runs the draft's rows too
    zero, _ = eng.prefill(segs, FusionOptions(ratio=0.0, **kw))
    reuse, _ = eng.prefill(segs, FusionOptions(mode="reuse"))
    assert (zero.next_position, zero.cache.length) == (reuse.next_position, reuse.cache.length)
    assert maxdiff(decode_step(eng.model, zero, 8), decode_step(eng.model, reuse, 8)) <= TOL
    state, draft = eng.prefill(segs, FusionOptions(mode="reuse"))[0], []
    for _ in range(n):
        draft.append(int(state.logits.argmax()))
        decode_step(eng.model, state, draft[-1])
    _, drafted = eng.prefill(segs, FusionOptions(ratio=0.2, **kw))
    _, extended = eng.prefill(replace(segs, query=segs.query + draft),
                              FusionOptions(mode="blend", select="query", ratio=0.2))
    assert drafted.recompute.selected_per_block == extended.recompute.selected_per_block
    # a server's KV budget reserves the draft's rows too: stage 1's cache holds them until they are forgotten
    assert get_mode("blend").own_rows(segs, FusionOptions(**kw)) == segs.num_tokens + n
    with pytest.raises(InvalidRequestError, match="select='query'"):
        eng.prefill(segs, FusionOptions(mode="blend", select="deviation", draft_tokens=n))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("ratio", [0.02, 1.0])  # a stage 2 near stage 1 (the draft's answer), and one that is `full`
def test_an_answer_that_begins_as_the_draft_did_takes_its_rows_without_a_forward(tiny_engine, family, ratio,
                                                                                monkeypatch):
    """Stage 2 runs the draft's rows after the query (DecodeState.lookahead): each answer token equal to the
    draft's next one is taken without a forward. The answer is the one decoded step by step (greedy and seeded
    sampling, and each choice of n > 1), and as many tokens are taken as the answer shares with the draft."""
    from ragkv.engine.kv.state import DecodeState
    from ragkv.engine.options import GenerationOptions

    eng = tiny_engine(family)
    eng.tokenizer, eng.eos_ids = IdText(), set()  # every answer runs to its budget
    segs = make_segs(blocks=(20, 30, 25))
    fusion = FusionOptions(mode="blend", select="query", draft_tokens=6, ratio=ratio)
    gens = [GenerationOptions(max_new_tokens=10), GenerationOptions(max_new_tokens=10, temperature=0.8, seed=3)]
    fast = [eng.generate(segs, fusion, g) for g in gens]
    parent = eng.start(segs, fusion, gens[1])
    choices = [parent, parent.fork(1)]  # n = 2: the choices share the prompt's rows, not the draft's
    assert not parent.state.lookahead
    while not all(c.finished for c in choices):
        for c in choices:
            c.advance()
        eng.step(choices)
    monkeypatch.setattr(DecodeState, "take_lookahead", lambda self, token: self.drop_lookahead())  # every step a forward
    slow = [eng.generate(segs, fusion, g) for g in gens]
    for f, s in zip(fast, slow):
        assert f.token_ids == s.token_ids and maxdiff(f.first_logits, s.first_logits) <= TOL
        assert "lookahead_taken" not in s.stats.extra
    draft, answer = fast[0].stats.recompute.draft, fast[0].token_ids
    shared = next((i for i, (a, b) in enumerate(zip(draft, answer)) if a != b), min(len(draft), len(answer)))
    assert fast[0].stats.extra.get("lookahead_taken", 0) == min(shared, len(answer) - 1)
    assert choices[0].out.token_ids == slow[1].token_ids
    if ratio < 1:  # two tokens recomputed: the greedy answer begins as the whole draft did
        assert fast[0].stats.extra["lookahead_taken"] == len(draft) == 6


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("per_block", [False, True])
def test_query_aware_selection_keeps_the_extremes(tiny_engine, family, per_block):
    """Invariant 6 for ProphetKV's query-aware selection: r=1 recomputes every block token at every layer (== full),
    r=0 leaves stage 1's answer (== reuse); in between, the chosen tokens are the most attended ones and the work
    counted is stage 1's query rows plus stage 2's chosen rows and query, at every layer."""
    eng = tiny_engine(family)
    segs = make_segs(blocks=(20, 30, 25))
    kw = dict(mode="blend", select="query", select_per_block=per_block)
    s1, s0 = assert_selection_extremes(eng, segs, kw)
    n_block, Tq, L = 75, len(segs.query), eng.num_layers
    assert s1.recomputed_tokens == n_block + Tq and s0.recomputed_tokens == Tq
    assert s1.recomputed_token_layers == (Tq + n_block + Tq) * L and s0.recomputed_token_layers == Tq * L
    seen = []  # what stage 1 scored and what was chosen from it
    import ragkv.engine.recompute.query as qs

    def spy(score, layout, *args):
        seen.append((score.clone(), layout, qs_choose(score, layout, *args)))
        return seen[-1][2]

    qs_choose = qs.choose_tokens
    try:
        qs.choose_tokens = spy
        _, part = eng.prefill(segs, FusionOptions(ratio=0.2, **kw))
    finally:
        qs.choose_tokens = qs_choose
    assert part.recompute.selected == (15 if not per_block else 4 + 6 + 5)
    assert part.recompute.risks[0]["shift"] >= 0 and part.recompute.escalations == 0
    (score, layout, chosen), = seen
    groups = list(zip(layout.block_offsets(), layout.block_lens)) if per_block else [(layout.prefix_len, n_block)]
    for off, n in groups:  # every chosen token is attended at least as much as every one left out
        inside = chosen[(chosen >= off) & (chosen < off + n)]
        left = torch.ones(n, dtype=torch.bool)
        left[inside - off] = False
        assert len(inside) and float(score[inside].min()) >= float(score[off:off + n][left].max())
    assert float(score[:layout.prefix_len].sum()) >= 0 and (chosen >= layout.prefix_len).all()


def test_the_query_attention_score_is_each_context_tokens_softmax_mass():
    """ProphetKV's stage-1 score, checked against a per-head loop: sum over query heads and rows of the softmax over
    the context keys only, each query head reading the KV head it shares (GQA)."""
    from ragkv.engine.recompute.query import QueryAttentionRecorder

    g = torch.Generator().manual_seed(0)
    N, Tq, Hq, Hkv, D = 9, 3, 4, 2, 8
    q = torch.randn(1, Hq, Tq, D, generator=g)
    k, v = torch.randn(1, Hkv, N + Tq, D, generator=g), torch.randn(1, Hkv, N + Tq, D, generator=g)
    rec = QueryAttentionRecorder(N)
    rec(0, q, k, v)
    want = torch.zeros(N)
    for h in range(Hq):
        want += ((q[0, h] @ k[0, h // (Hq // Hkv), :N].T) / D ** 0.5).softmax(-1).sum(0)
    assert maxdiff(rec.layer_scores[0], want) <= 1e-5 and abs(float(want.sum()) - Hq * Tq) < 1e-4


def test_auto_escalates_to_full_exactly_when_its_signal_exceeds_the_budget(tiny_engine):
    """The quality-bounded mode: a zero budget always escalates (== full, counted as both stage-2 runs); an
    unbounded one keeps blend's query-aware answer at r; every reply states what was done."""
    eng = tiny_engine("llama")
    segs = make_segs(blocks=(20, 30, 25))
    full, _ = eng.prefill(segs, FusionOptions(mode="full"))
    cheap, sc = eng.prefill(segs, FusionOptions(mode="blend", select="query", ratio=0.2))
    strict, ss = eng.prefill(segs, FusionOptions(mode="auto", ratio=0.2, max_risk=0.0))
    loose, sl = eng.prefill(segs, FusionOptions(mode="auto", ratio=0.2, max_risk=100.0))
    assert maxdiff(strict.logits, full.logits) <= TOL and maxdiff(loose.logits, cheap.logits) <= TOL
    Tq, L = len(segs.query), eng.num_layers
    assert ss.recomputed_token_layers == (Tq + (15 + Tq) + (75 + Tq)) * L
    assert sl.recomputed_token_layers == sc.recomputed_token_layers
    assert ss.fidelity["exact"] and ss.fidelity["escalations"] == 1 and ss.fidelity["signal"] is not None
    assert not sl.fidelity["exact"] and sl.fidelity["escalations"] == 0
    assert sl.fidelity["signal"] == sc.fidelity["signal"] == sc.recompute.risks[0]["shift"]
    assert eng.prefill(segs, FusionOptions(mode="full"))[1].fidelity == {"mode": "full", "exact": True}


def test_auto_on_the_expected_kl_escalates_within_its_budget(tiny_engine):
    """`signal=expected_kl`: the reply's own fidelity estimate (the population's figure for a model never fitted)
    against max_risk as a KL; `escalation_budget` caps the share of the last 100 answers escalated: beyond it an
    answer at risk keeps its cheap recompute and says so."""
    from ragkv.engine.measure.estimates import population_estimate

    eng = tiny_engine("llama")
    segs = make_segs(blocks=(20, 30, 25))
    full, _ = eng.prefill(segs, FusionOptions(mode="full"))
    cheap, _ = eng.prefill(segs, FusionOptions(mode="blend", select="query", ratio=0.2))
    _, est = eng.prefill(segs, FusionOptions(mode="auto", ratio=0.2, signal="expected_kl", max_risk=100.0))
    stated = est.recompute.risk["expected_kl"]
    share = est.recompute.risks[0]["expected_kl"]
    assert stated == share and 0 < stated < population_estimate("blend", "query", 0.0)["expected_kl"]
    eng.escalations = type(eng.escalations)(window=4)
    budget = dict(mode="auto", ratio=0.2, signal="expected_kl", max_risk=stated / 2, escalation_budget=0.5)
    runs = [eng.prefill(segs, FusionOptions(**budget)) for _ in range(4)]
    escalated = [s.fidelity["escalations"] for _, s in runs]
    assert escalated == [1, 0, 0, 1], escalated  # escalates while under half of the window escalated
    assert [s.fidelity["budget_spent"] for _, s in runs] == [False, True, True, False]
    assert maxdiff(runs[3][0].logits, full.logits) <= TOL and maxdiff(runs[2][0].logits, cheap.logits) <= TOL
    assert maxdiff(full.logits, cheap.logits) > 1e-3  # not vacuous
    eng.escalations = type(eng.escalations)(window=4)  # budget 1 (the default) is no limit: every one escalates
    unbounded = [eng.prefill(segs, FusionOptions(mode="auto", ratio=0.2, max_risk=0.0))[1] for _ in range(3)]
    assert [s.fidelity["escalations"] for s in unbounded] == [1, 1, 1]


def test_sink_selection_recomputes_each_blocks_first_tokens(tiny_engine):
    """EPIC's static chunk links: sinks covering every block == full; each block's first k otherwise."""
    eng = tiny_engine("llama")
    segs = make_segs(blocks=(20, 30, 25))
    full, _ = eng.prefill(segs, FusionOptions(mode="full"))
    every, _ = eng.prefill(segs, FusionOptions(mode="blend", select="sinks", sink_tokens=30))
    assert maxdiff(every.logits, full.logits) <= TOL
    one_pass, st = eng.prefill(segs, FusionOptions(mode="blend", select="sinks", sink_tokens=4))
    assert st.recompute.selected_per_block == [4, 4, 4]
    # one pass (no stage 1) computes what stage 1 then stage 2 over the same rows does, for the query's rows only
    two_stage, s2 = eng.prefill(segs, FusionOptions(mode="blend", select="query", ratio=0.0, sink_tokens=4))
    assert s2.recompute.selected_per_block == [4, 4, 4]
    assert maxdiff(one_pass.logits, two_stage.logits) <= TOL
    Tq, L = len(segs.query), eng.num_layers
    assert st.recomputed_token_layers == (12 + Tq) * L == s2.recomputed_token_layers - Tq * L
    assert st.recomputed_tokens == 12 + Tq and st.fidelity["signal_name"] and st.recompute.risk["shift"] is None
    with pytest.raises(InvalidRequestError, match="sink_tokens"):
        eng.prefill(segs, FusionOptions(mode="blend", select="sinks"))


@pytest.mark.parametrize("per_block", [False, True])
def test_recent_selection_recomputes_the_tokens_nearest_the_query(tiny_engine, per_block):
    """Invariant 6 for the static recency selection: r=1 == full, r=0 == reuse; in between, the last r of the block
    tokens (or of each block's), in one pass (no stage 1 over the query)."""
    eng = tiny_engine("llama")
    segs = make_segs(blocks=(20, 30, 25))
    kw = dict(mode="blend", select="recent", select_per_block=per_block)
    s1, _ = assert_selection_extremes(eng, segs, kw)
    part, sp = eng.prefill(segs, FusionOptions(ratio=0.2, **kw))
    Tq, L = len(segs.query), eng.num_layers
    # 15 of 75 block tokens: all in the last block (25 tokens), or 4 / 6 / 5 at each block's end
    assert sp.recompute.selected_per_block == ([4, 6, 5] if per_block else [0, 0, 15])
    assert sp.recomputed_token_layers == (15 + Tq) * L and sp.recomputed_tokens == 15 + Tq
    assert s1.recomputed_token_layers == (75 + Tq) * L  # one pass: no stage 1 over the query
    assert not sp.fidelity["exact"] and sp.fidelity["select"] == "recent"


@pytest.mark.parametrize("check_rows,per_block", [("all", False), ("selected", True), ("all", True)])
def test_blend_variants_keep_the_extremes(tiny_engine, check_rows, per_block):
    """Invariant 6 for the drift-study variants: r=1 is full; r=0 is reuse when only the selected
    rows run the check layer (check_rows="all" recomputes every row there by design)."""
    eng = tiny_engine("llama")
    segs = make_segs(blocks=(20, 30, 25))
    full, _ = eng.prefill(segs, FusionOptions(mode="full"))
    reuse, _ = eng.prefill(segs, FusionOptions(mode="reuse"))
    kw = dict(mode="blend", check_rows=check_rows, select_per_block=per_block)
    one, _ = eng.prefill(segs, FusionOptions(ratio=1.0, **kw))
    zero, _ = eng.prefill(segs, FusionOptions(ratio=0.0, **kw))
    assert maxdiff(one.logits, full.logits) <= TOL
    if check_rows == "selected":
        assert maxdiff(zero.logits, reuse.logits) <= TOL


def test_blend_per_block_selection_keeps_r_of_each_block(tiny_engine):
    eng = tiny_engine("llama")
    segs = make_segs(blocks=(20, 40, 60))
    _, stats = eng.prefill(segs, FusionOptions(mode="blend", ratio=0.25, select_per_block=True))
    assert stats.recompute.selected_per_block == [5, 10, 15] and stats.recompute.selected == 30


def test_blend_check_rows_all_runs_every_row_through_the_check_layer(tiny_engine):
    """The original code's variant costs one more full layer: the check layer runs all rows, then the kept."""
    eng = tiny_engine("llama")
    segs = make_segs(blocks=(40, 40))
    opts = dict(mode="blend", ratio=0.25, check_layers=(1,))
    _, sel = eng.prefill(segs, FusionOptions(**opts))
    _, every = eng.prefill(segs, FusionOptions(check_rows="all", **opts))
    total = segs.num_tokens  # every row of the prompt (the prefix too) runs the layers before the selection
    kept = sel.recompute.selected + len(segs.query)
    assert every.recompute.selected == sel.recompute.selected == 20
    assert every.recomputed_token_layers - sel.recomputed_token_layers == total - kept


def test_blend_intermediate_ratio_is_between(tiny_engine):
    eng = tiny_engine("llama")
    segs = make_segs(blocks=(40, 40, 40))
    full, _ = eng.prefill(segs, FusionOptions(mode="full"))
    reuse, _ = eng.prefill(segs, FusionOptions(mode="reuse"))
    mid, stats = eng.prefill(segs, FusionOptions(mode="blend", ratio=0.25, sink_tokens=2))
    assert stats.recompute.selected >= 30  # 25% of 120 plus forced sinks
    assert stats.recomputed_tokens == stats.recompute.selected + len(segs.query)
    # neither extreme, and nearer `full` than `reuse` is: the recompute moved the answer toward the exact one
    assert maxdiff(mid.logits, full.logits) > TOL and maxdiff(mid.logits, reuse.logits) > TOL
    assert maxdiff(mid.logits, full.logits) < maxdiff(reuse.logits, full.logits)


def test_lse_merge_equals_single_attention():
    """Invariant 7b: attention over disjoint parts merged by LSE equals attention over the concatenation."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 5, 16, generator=g)
    k, v = torch.randn(1, 2, 40, 16, generator=g), torch.randn(1, 2, 40, 16, generator=g)
    whole = sdpa(q, k, v)
    parts = [attention_with_lse(q, k[:, :, a:b], v[:, :, a:b]) for a, b in ((0, 7), (7, 31), (31, 40))]
    merged = merge_by_lse([o for o, _ in parts], [lse for _, lse in parts])
    assert maxdiff(merged, whole) <= 1e-5


def test_ape_with_unit_t_s_and_sequential_layout_equals_reuse(tiny_engine):
    """Invariant 7a: APE's attention with T = S = 1 over the sequential layout is `reuse`."""
    eng = tiny_engine("llama")
    segs = make_segs(prefix=10)
    reuse, _ = eng.prefill(segs, FusionOptions(mode="reuse"))
    layout = make_layout(len(segs.prefix), [len(b) for b in segs.blocks], "sequential")
    keys = eng.warm(segs).keys
    ape = ApeAttention(len(segs.prefix), layout.context_len - len(segs.prefix), 1.0, 1.0)
    state = drain(prefill_over_context(eng.model, eng.store.iter_layers(keys, eng.model.args.num_layers), layout,
                                       segs.query, 64, RequestStats("ape"), ape))
    assert maxdiff(state.logits, reuse.logits) <= TOL
    assert maxdiff(decode_step(eng.model, state, 3), decode_step(eng.model, reuse, 3)) <= TOL


def test_ape_mode_uses_shared_layout_and_prefix_conditioning(tiny_engine):
    eng = tiny_engine("llama")
    segs = make_segs(blocks=(20, 30))
    s1 = eng.prefill(segs, FusionOptions(mode="ape", ape_temperature=0.9, ape_scale=0.9))
    state, stats = s1
    assert state.next_position == len(segs.prefix) + 30 + len(segs.query)
    assert stats.cache_misses == 3  # prefix + 2 prefix-conditioned blocks
    _, r = eng.prefill(segs, FusionOptions(mode="reuse"))
    assert r.cache_hits == 1 and r.cache_misses == 2  # prefix shared; blocks differ by conditioning
    t1, _ = eng.prefill(segs, FusionOptions(mode="ape", ape_temperature=1.0, ape_scale=1.0))
    assert maxdiff(t1.logits, state.logits) > 1e-4  # T and S matter


def test_ape_does_not_see_the_order_of_the_passages(tiny_engine):
    """APE puts every block at the same positions, so moving a passage changes only the order of a sum: the
    first token and the greedy continuation are the same (why `ape` is flat against gold position on NQ-10,
    docs/results/nq10_n200.md). `reuse` re-rotates each block to its place and does see the order."""
    eng = tiny_engine("llama")
    segs = make_segs(blocks=(20, 17, 25))
    moved = Segments(prefix=segs.prefix, blocks=[segs.blocks[2], segs.blocks[0], segs.blocks[1]], query=segs.query)
    outs = {}
    for key, fusion in (("ape", FusionOptions(mode="ape", ape_temperature=0.9, ape_scale=0.8)),
                        ("reuse", FusionOptions(mode="reuse"))):
        (a, _), (b, _) = eng.prefill(segs, fusion), eng.prefill(moved, fusion)
        outs[key] = maxdiff(a.logits, b.logits)
        if key == "ape":
            for tok in (5, 77, 131):  # teacher-forced steps over the two caches
                outs[key] = max(outs[key], maxdiff(decode_step(eng.model, a, tok), decode_step(eng.model, b, tok)))
    assert outs["ape"] <= TOL and outs["reuse"] > 1e-3


def test_cache_entries_never_cross_models_or_dtypes(tiny_loaded):
    """Invariant 8: different weights, RoPE or dtype -> different fingerprints -> no hits."""
    from ragkv.engine.engine import Engine
    from ragkv.models.loader import model_fingerprint

    store = MemoryStore()
    segs = make_segs()
    Engine(tiny_loaded["llama"], store=store).prefill(segs, FusionOptions(mode="reuse"))
    _, stats = Engine(tiny_loaded["llama3"], store=store).prefill(segs, FusionOptions(mode="reuse"))
    assert stats.cache_hits == 0
    la = tiny_loaded["llama"]
    from ragkv.models.loader import _weight_files
    files = _weight_files(la.path)
    fp32 = model_fingerprint(la.path, la.args, torch.float32, files)
    bf16 = model_fingerprint(la.path, la.args, torch.bfloat16, files)
    assert fp32 == la.fingerprint and bf16 != fp32


def test_namespaces_do_not_share_blocks(tiny_engine):
    eng = tiny_engine("llama")
    segs = make_segs()
    eng.prefill(segs, FusionOptions(mode="reuse"), namespace="a")
    _, stats = eng.prefill(segs, FusionOptions(mode="reuse"), namespace="b")
    assert stats.cache_hits == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_into_matches_apply_rope(dtype, tiny_loaded):
    from ragkv.ops.rope import apply_rope, half_tables, rope_into

    model = tiny_loaded["llama3"].model
    x = torch.randn(1, 2, 300, 16).to(model.device, dtype)
    cos, sin = model.rotary.lookup(torch.arange(100, 400, device=model.device))
    out = torch.empty_like(x)
    rope_into(out, x, *half_tables(cos, sin), chunk=128)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert maxdiff(out.float(), apply_rope(x, cos, sin).float()) <= tol


@pytest.mark.parametrize("checks", [(1, 2), (1, 2, 3), (1, 4, 8, 12, 20), (1, 29)])
@pytest.mark.parametrize("r", [0.0, 0.1, 0.15, 0.3, 0.9, 1.0])
def test_gradual_filtering_schedule_narrows_and_averages_r_over_the_layers(checks, r):
    """CacheBlend sec. 4.3: a little more than r first, narrowing at each check layer, r on average over the layers
    each ratio applies to (from its check layer to the next, the last one's to the last layer): the work is r's."""
    from ragkv.engine.recompute.deviation import check_ratios

    L = 30
    ratios = check_ratios(FusionOptions(mode="blend", ratio=r, check_layers=checks, gradual=True), L)
    spans = [b - a for a, b in zip(checks, checks[1:] + (L,))]
    assert ratios == sorted(ratios, reverse=True) and len(ratios) == len(checks)
    assert sum(w * x for w, x in zip(spans, ratios)) / sum(spans) == pytest.approx(r)
    assert r in (0, 1) or ratios[0] > r >= ratios[-1] - 1e-12
    assert all(0 <= x <= 1 for x in ratios)


def test_blend_accounting_counts_token_layers(tiny_engine):
    """Every token goes through the layers up to the check layer; after it only the selection and the query."""
    eng = tiny_engine()
    segs = make_segs()
    L, total = eng.num_layers, segs.num_tokens
    _, full = eng.prefill(segs, FusionOptions(mode="full"))
    assert full.recomputed_token_layers == full.full_token_layers == total * L
    _, reuse = eng.prefill(segs, FusionOptions(mode="reuse"))
    assert reuse.recomputed_token_layers == len(segs.query) * L and reuse.to_dict()["recompute_vs_full"] < 0.2
    _, zero = eng.prefill(segs, FusionOptions(mode="blend", ratio=0.0, check_layers=(1,)))
    assert zero.recomputed_token_layers == total * 1 + len(segs.query) * (L - 1)  # layer 0 for every token
    assert zero.recomputed_tokens == len(segs.query)


@pytest.mark.parametrize("mode", ["reuse", "ape", "blend", "prefix"])
def test_cached_tokens_count_only_what_the_store_held(tiny_engine, mode):
    """usage.prompt_tokens_details.cached_tokens: 0 on a first ask (blocks encoded by the request itself are
    reused but not cached), then the tokens of every block (or prefix chunk) found in the store."""
    eng = tiny_engine("llama")
    segs = make_segs(prefix=6, blocks=(20, 30))
    _, first = eng.prefill(segs, FusionOptions(mode=mode))
    _, again = eng.prefill(segs, FusionOptions(mode=mode))
    assert first.cached_tokens == 0 and first.cache_misses > 0
    if mode == "prefix":  # whole 32-token chunks, the last token always prefilled
        assert again.cached_tokens == again.reused_tokens == (segs.num_tokens - 1) // 32 * 32
    else:
        assert again.cached_tokens == 6 + 20 + 30 and again.cache_misses == 0


@pytest.mark.parametrize("select", [s for s in SELECTIONS if s != "sinks"])  # sinks: its own test above
def test_every_registered_selection_keeps_the_extremes(tiny_engine, select):
    """Invariant 6 for each selection object in engine/recompute (a new one is covered by being registered), and
    the one vocabulary every selection records."""
    eng = tiny_engine("llama")
    segs = make_segs(blocks=(20, 30, 25))
    s1, s0 = assert_selection_extremes(eng, segs, dict(mode="blend", select=select))
    for stats, chosen in ((s1, 75), (s0, 0)):
        x = stats.recompute
        assert (x.select, x.selected, x.block_tokens, sum(x.selected_per_block)) == (select, chosen, 75, chosen)
    sel = get_selection(select)
    assert isinstance(sel, Selection) and sel.name == select and sel.summary and sel.source


def test_an_unknown_selection_names_the_field_and_the_choices():
    """The record takes any name (it knows no registry); where options enter, the registered ones are checked."""
    with pytest.raises(OptionError) as e:
        validate_fusion(FusionOptions(mode="blend", select="bogus"))
    assert e.value.param == "select" and all(s in str(e.value) for s in SELECTIONS)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("with_prefix", [False, True])
def test_a_block_encoded_in_units_equals_it_encoded_at_once(tiny_engine, family, with_prefix):
    """A long block's encoding yields every `chunk` tokens (so it pauses other requests for one unit): each unit runs
    after the block's earlier rows, so the raw K and V equal the one-shot encode's (with APE's prefix too)."""
    from ragkv.engine.blocks.encode import encode_block_steps
    from ragkv.engine.kv.stepwise import drain

    eng = tiny_engine(family)
    ids, prefix = rand_ids(70, 5), encode_block(eng.model, rand_ids(9, 6)) if with_prefix else None
    whole = encode_block(eng.model, ids, prefix)
    units = encode_block_steps(eng.model, ids, prefix, chunk=16)
    yields = forwards = 0
    try:  # plain next(): each forward runs where its generator resumes (models.loop.computed)
        while True:
            item = next(units)
            forwards += item is not None
            yields += item is None
    except StopIteration as done:
        parts = done.value
    assert yields == 4 and forwards == 5  # 16 + 16 + 16 + 16 + 6: a unit boundary after each but the last
    assert parts.keys.shape == whole.keys.shape
    assert maxdiff(parts.keys, whole.keys) <= TOL and maxdiff(parts.values, whole.values) <= TOL
    sized = drain(encode_block_steps(eng.model, ids, prefix, chunk=lambda: 32))  # a function giving each size
    assert maxdiff(sized.keys, whole.keys) <= TOL
