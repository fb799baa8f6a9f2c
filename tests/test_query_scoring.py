"""The query-aware selection's two scoring options: `score_layers` (only those layers' attention ranks the tokens:
QCFuse's critical layers) and `whole_blocks` (the passages with the most of the query's attention recomputed whole,
inside the ratio's budget). Invariant 6 holds with each; what they choose is checked against stage 1's scores."""

import pytest
import torch
from test_fusion_invariants import assert_selection_extremes
from tiny import make_segs

import ragkv.engine.recompute.query as qs
from ragkv.engine.options import FusionOptions
from ragkv.engine.recompute.query import QueryAttentionRecorder
from ragkv.engine.recompute.rows import keep_count
from ragkv.errors import InvalidRequestError
from ragkv.eval.modes import ModeKeyError, parse_mode_key


def chosen_with_scores(eng, segs, fusion):
    """Run one blend prefill; return (its stats, the fused score stage 1 handed the chooser, the layout, the chosen
    cache indices)."""
    seen, choose = [], qs.choose_tokens

    def spy(score, layout, *args):
        seen.append((score.clone(), layout, choose(score, layout, *args)))
        return seen[-1][2]

    qs.choose_tokens = spy
    try:
        _, stats = eng.prefill(segs, fusion)
    finally:
        qs.choose_tokens = choose
    (score, layout, chosen), = seen
    return stats, score, layout, chosen


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("extra", [dict(whole_blocks=1), dict(whole_blocks=3), dict(score_layers=(1,))])
def test_the_scoring_options_keep_the_extremes(tiny_engine, family, extra):
    """Invariant 6 with either option: r=1 == full, r=0 == reuse."""
    assert_selection_extremes(tiny_engine(family), make_segs(blocks=(20, 30, 25)),
                              dict(mode="blend", select="query", **extra))


@pytest.mark.parametrize("ratio", [0.2, 0.5])
def test_whole_blocks_takes_the_most_attended_passage_whole_and_the_budget_stays(tiny_engine, ratio):
    """At r=0.5 the most attended block fits the budget: it is chosen whole and the rest of the budget goes to the
    highest-scored tokens elsewhere; at r=0.2 none fits (the smallest block is 20 of a 15-token budget) and the
    choice is the plain top r. Either way the count is the ratio's."""
    eng = tiny_engine("llama")
    segs = make_segs(blocks=(20, 30, 25))
    stats, score, layout, chosen = chosen_with_scores(eng, segs, FusionOptions(mode="blend", select="query",
                                                                               ratio=ratio, whole_blocks=1))
    blocks = list(zip(layout.block_offsets(), layout.block_lens))
    budget = keep_count(ratio, 75)
    assert len(chosen) == stats.recompute.selected == budget
    _, plain_score, _, plain = chosen_with_scores(eng, segs, FusionOptions(mode="blend", select="query", ratio=ratio))
    assert torch.equal(score, plain_score)  # the option changes the choice, not stage 1
    mass = [float(score[o:o + n].sum()) for o, n in blocks]
    top = max(range(3), key=mass.__getitem__)
    off, n = blocks[top]
    if n > budget:
        assert torch.equal(chosen, plain)
        return
    inside = (chosen >= off) & (chosen < off + n)
    assert int(inside.sum()) == n  # the whole passage
    rest = chosen[~inside]
    left = torch.ones(layout.context_len, dtype=torch.bool)
    left[:layout.prefix_len] = False
    left[off:off + n] = False
    left[rest] = False
    assert len(rest) == budget - n and float(score[rest].min()) >= float(score[left].max())


def test_score_layers_ranks_by_those_layers_alone(tiny_engine):
    """The recorder keeps the named layers' scores only; every layer named equals the default (all layers), and a
    single layer's ranking is what the selection then uses."""
    eng = tiny_engine("qwen2")
    segs = make_segs(blocks=(20, 30, 25))
    L = eng.num_layers
    _, every, _, chosen = chosen_with_scores(eng, segs, FusionOptions(mode="blend", select="query", ratio=0.2))
    _, named, _, same = chosen_with_scores(eng, segs, FusionOptions(mode="blend", select="query", ratio=0.2,
                                                                    score_layers=tuple(range(L))))
    assert torch.allclose(every, named) and torch.equal(chosen, same)
    per_layer = []
    for layer in range(L):
        _, s, _, _ = chosen_with_scores(eng, segs, FusionOptions(mode="blend", select="query", ratio=0.2,
                                                                 score_layers=(layer,)))
        per_layer.append(s)
    assert torch.allclose(torch.stack(per_layer).mean(dim=0), every, atol=1e-6)
    assert any(not torch.allclose(s, every) for s in per_layer)  # the layers disagree: the test is not vacuous
    rec = QueryAttentionRecorder(4, (1,))
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 7, 8)
    for layer in range(3):
        rec(layer, q, k, k)
    assert len(rec.layer_scores) == 1


@pytest.mark.parametrize("spread", [1.0, 40.0])
def test_the_recorders_score_is_the_softmax_over_the_context_summed(spread):
    """alpha_l(t) = sum over heads and query rows of softmax_t(q k_t / sqrt(d)) over the context keys only (the
    recorder computes it by hand, query heads grouped by their KV head); `spread` 40 puts rows' scores hundreds
    apart, as the real model's heads do, where the recorder holds probabilities under e^-80 of the row's largest."""
    torch.manual_seed(0)
    N, Tq, D = 50, 3, 16
    q, k = torch.randn(1, 4, Tq, D) * spread, torch.randn(1, 2, N + Tq, D)
    rec = QueryAttentionRecorder(N)
    rec(0, q, k, k)
    kx = k[:, :, :N].repeat_interleave(2, dim=1)  # query head h reads KV head h // 2
    expected = (q @ kx.transpose(-1, -2) / D ** 0.5).softmax(dim=-1).sum(dim=(0, 1, 2))
    assert torch.allclose(rec.layer_scores[0], expected, rtol=1e-5, atol=1e-6)
    assert abs(float(expected.sum()) - 4 * Tq) < 1e-4


@pytest.mark.parametrize("n", [50, 64, 1300])
@pytest.mark.parametrize("spread", [1.0, 8.0])
@pytest.mark.parametrize("D", [64, 32, 128])
def test_the_one_pass_context_mass_is_the_softmax_over_the_context_summed(n, spread, D):
    """ops/context_mass (bf16 on AVX-512 BF16; head dim 64 on AMX tiles where the CPU has them, other dims on
    AVX-512): the same score as the fp32 products of the bf16 values, over a slice of a longer cache (K's heads a
    capacity apart, the query's own keys after the context), to fp32 rounding."""
    from ragkv.ops.context_mass import context_mass, kernel

    if kernel() is None:
        pytest.skip("the pass is built only where the CPU has AVX-512 BF16")
    torch.manual_seed(n)
    Tq = 5
    q = (torch.randn(1, 14, Tq, D) * spread).bfloat16()
    k = torch.randn(1, 2, n + Tq + 40, D).bfloat16()[:, :, :n + Tq]
    kx = k[:, :, :n].float().repeat_interleave(7, dim=1)
    expected = (q.float() @ kx.transpose(-1, -2) / D ** 0.5).softmax(dim=-1).sum(dim=(0, 1, 2))
    got = context_mass(q, k, n)
    assert got.shape == (n,)
    assert torch.allclose(got, expected, rtol=2e-5, atol=1e-6)
    rec = QueryAttentionRecorder(n)  # the recorder takes this pass for bf16
    rec(0, q, k, k)
    assert torch.equal(rec.layer_scores[0], got)
    assert context_mass(q.float(), k.float(), n) is None  # fp32 keeps torch's ops


def test_the_options_are_refused_where_they_mean_nothing(tiny_engine):
    eng = tiny_engine("llama")
    segs = make_segs()
    with pytest.raises(ModeKeyError):
        parse_mode_key("reuse:whole=1")
    for fusion in (FusionOptions(mode="blend", whole_blocks=1), FusionOptions(mode="blend", select="recent",
                                                                               score_layers=(1,))):
        with pytest.raises(InvalidRequestError, match="select='query'"):
            eng.prefill(segs, fusion)
    with pytest.raises(ModeKeyError, match="increasing"):
        parse_mode_key("blend:sel=query,slayers=3+1")
    with pytest.raises(InvalidRequestError, match="score_layers"):
        eng.prefill(segs, FusionOptions(mode="blend", select="query", score_layers=(eng.num_layers,)))
    assert parse_mode_key("blend:sel=query,r=0.15,slayers=1+2,whole=1").score_layers == (1, 2)


def test_score_from_names_the_deeper_layers(tiny_engine):
    """score_from is a share of the depth: 0.5 of 28 layers is 14..27, of 24 is 12..23; 1 the last layer alone. A
    run with it chooses as one naming those layers does; both at once are refused."""
    from ragkv.engine.recompute.query import scoring_layers

    assert scoring_layers(FusionOptions(mode="blend", select="query", score_from=0.5), 28) == tuple(range(14, 28))
    assert scoring_layers(FusionOptions(mode="blend", select="query", score_from=0.5), 24) == tuple(range(12, 24))
    assert scoring_layers(FusionOptions(mode="blend", select="query", score_from=1.0), 24) == (23,)
    assert scoring_layers(FusionOptions(mode="blend", select="query"), 24) == ()
    eng = tiny_engine("llama")
    segs = make_segs(blocks=(20, 30, 25))
    L = eng.num_layers
    _, by_share, _, a = chosen_with_scores(eng, segs, FusionOptions(mode="blend", select="query", ratio=0.2,
                                                                    score_from=0.5))
    _, by_name, _, b = chosen_with_scores(eng, segs, FusionOptions(mode="blend", select="query", ratio=0.2,
                                                                   score_layers=tuple(range(L // 2, L))))
    assert torch.equal(by_share, by_name) and torch.equal(a, b)
    with pytest.raises(InvalidRequestError, match="score_from"):
        FusionOptions(mode="blend", select="query", score_from=0.5, score_layers=(1,))
    assert parse_mode_key("blend:sel=query,r=0.13,sfrom=0.5").score_from == 0.5
