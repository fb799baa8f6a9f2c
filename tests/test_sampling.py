"""Sampling controls (penalties, top-k, min-p), log-probabilities and forked choices (n > 1)."""

import pytest
import torch

from ragkv.engine.decode.sampling import apply_penalties, finite_or_tied, greedy_token, sample, token_logprob
from ragkv.engine.options import FusionOptions, GenerationOptions
from ragkv.engine.request.segments import Passage


def test_penalties_follow_ctrl_and_openai():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    counts = torch.tensor([0.0, 1.0, 0.0, 2.0])
    prompt = torch.tensor([True, False, False, False])
    # CTRL: seen tokens (prompt 0, output 1 and 3): positive logits divided, negative multiplied
    assert apply_penalties(logits, counts, prompt, repetition=2.0).tolist() == [1.0, -4.0, 1.0, 0.25]
    # OpenAI: output tokens only, frequency per occurrence, presence once
    assert apply_penalties(logits, counts, prompt, presence=0.5, frequency=0.25).tolist() == \
        pytest.approx([2.0, -2.75, 1.0, -0.5])
    assert torch.equal(apply_penalties(logits, counts, prompt), logits)


def test_top_k_and_min_p_truncate():
    logits = torch.tensor([3.0, 2.9, 0.0, -1.0, 2.8])
    gens = [torch.Generator().manual_seed(s) for s in range(50)]
    assert {sample(logits, 1.0, 1.0, g, top_k=1) for g in gens} == {0}
    assert {sample(logits, 2.0, 1.0, g, min_p=1.0) for g in gens} == {0}
    drawn = {sample(logits, 5.0, 1.0, torch.Generator().manual_seed(s), top_k=2) for s in range(200)}
    assert drawn == {0, 1}
    # min-p 0.5 at temperature 1: tokens at least half as likely as the best (0, 1, 4), never 2 or 3
    drawn = {sample(logits, 1.0, 1.0, torch.Generator().manual_seed(s), min_p=0.5) for s in range(300)}
    assert drawn == {0, 1, 4}
    a = [sample(logits, 1.0, 0.9, torch.Generator().manual_seed(9), top_k=3, min_p=0.1) for _ in range(5)]
    assert len(set(a)) == 1  # a seed repeats


@pytest.mark.parametrize("temperature", [5e-324, 2.3751195567713764e-288, 1e-30, 9e-6])
def test_a_vanishing_temperature_is_greedy(temperature):
    """A temperature too small for fp32 (a fuzzer's 2e-288 is 0 there) is greedy, as in vLLM; it used to give NaN
    probabilities and an error from the draw."""
    logits = torch.randn(500, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(2130)
    assert sample(logits, temperature, 0.17, g) == sample(logits, temperature, 1.0, g, 5, 0.5) == int(logits.argmax())


@pytest.mark.parametrize("size", [5, 127, 128, 300, 49152, 151936, 151936 + 37])
def test_the_greedy_token_is_torchs_argmax_ties_included(size):
    """greedy_token (row maxima, then the row) picks what torch.argmax picks: the first of tied maxima, wherever
    they fall (one row, two rows, the tail past the last whole row), with -inf entries beside them."""
    g = torch.Generator().manual_seed(size)
    for trial in range(6):
        logits = torch.randn(size, generator=g)
        logits[torch.randint(0, size, (size // 10,), generator=g)] = float("-inf")
        if trial:  # tied maxima at random places, the last possibly in the tail
            where = torch.randint(0, size, (trial,), generator=g)
            logits[where] = 50.0
            logits[size - 1] = 50.0 if trial % 2 else logits[size - 1]
        assert greedy_token(logits) == int(torch.argmax(logits))
        assert finite_or_tied(logits) is logits  # a finite maximum: the logits as they are


def test_a_vanishing_repetition_penalty_leaves_a_valid_draw():
    """repetition_penalty 3e-250 (valid: > 0) divides the seen tokens' positive logits into +inf: those tokens tie
    as the only choices, greedy or sampled; the draw used to fail on NaN probabilities (a 500)."""
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -4.0])
    seen = torch.tensor([0, 0, 1, 1, 0])
    penalized = apply_penalties(logits, seen, None, repetition=2.921619187031793e-250)
    assert torch.isinf(penalized).any()
    g = torch.Generator().manual_seed(0)
    draws = {sample(penalized, 1.7, 1.0, g, 0, 0.46) for _ in range(50)}
    assert draws == {2, 3}  # the two seen tokens with positive logits, both drawn
    assert sample(penalized, 0.0) in (2, 3)
    nan = torch.tensor([float("nan"), 1.0, 0.0])
    assert sample(nan, 0.0) == 1 and sample(nan, 1.0, generator=g) in (1, 2)


def test_token_logprob_is_the_log_softmax():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    ref = torch.log_softmax(logits, -1)
    lp = token_logprob(logits, 7, 5)
    assert lp.token_id == 7 and lp.logprob == pytest.approx(float(ref[7]), abs=1e-6)
    assert [t for t, _ in lp.top] == torch.topk(ref, 5).indices.tolist()
    assert [v for _, v in lp.top] == pytest.approx(torch.topk(ref, 5).values.tolist(), abs=1e-6)
    assert token_logprob(logits, 7, 0).top == ()


def decode(eng, seqs):
    for s in seqs:
        s.advance()
    while not all(s.finished for s in seqs):
        eng.step(seqs)
        for s in seqs:
            s.advance()
    return [s.out.token_ids for s in seqs]


@pytest.mark.parametrize("fusion", [FusionOptions(mode="reuse"), FusionOptions(mode="ape")])
@pytest.mark.model
def test_forked_choices_equal_separate_requests(default_engine, fusion):
    """n choices from one prefill: choice i decodes (batched with the others) exactly what a request of its own
    with seed + i decodes; each fork owns its KV."""
    eng = default_engine
    segs = eng.segments("Who built the tower?", [Passage("Lintwick Tower was built in 1893 by Ada Morrow.", "Tower"),
                                                 Passage("The farm keeps forty-two alpacas.", "Farm")])
    gen = GenerationOptions(max_new_tokens=6, temperature=1.0, seed=5, top_k=20, repetition_penalty=1.3,
                            logprobs=2)
    first = eng.start(segs, fusion, gen)
    choices = decode(eng, [first] + [first.fork(i) for i in (1, 2)])
    alone = [decode(eng, [eng.start(segs, fusion, GenerationOptions(**{**vars(gen), "seed": 5 + i}))])[0]
             for i in range(3)]
    assert choices == alone and len({tuple(c) for c in choices}) > 1
    assert [len(s.out.logprobs) for s in [first]] == [len(choices[0])]
