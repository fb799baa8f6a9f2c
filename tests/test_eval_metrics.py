"""Metrics against hand-computed cases."""

import math

import numpy as np
import pytest
import torch

from ragkv.eval.metrics import (accuracy, best_subspan_em, exact_match, first_token_kl, greedy_agreement,
                                kl_divergence, lcs_length, normalize_answer, parse_generation, prefix_agreement,
                                rouge_l, score, token_f1, top1_agreement)


def test_normalize_answer():
    assert normalize_answer("The  Eiffel-Tower, in PARIS!") == "eiffeltower in paris"
    assert normalize_answer("an apple a day") == "apple day"
    assert normalize_answer("Theatre") == "theatre"  # articles only as whole words


def test_exact_match():
    assert exact_match("The Beatles.", ["beatles"]) == 1.0
    assert exact_match("the beatles band", ["beatles"]) == 0.0
    assert exact_match("Paris", ["London", "paris"]) == 1.0


def test_accuracy_is_containment_max_over_golds():
    assert accuracy("I think it was Wilhelm Conrad Röntgen, in 1901.", ["Wilhelm Conrad Röntgen"]) == 1.0
    assert accuracy("Marie Curie", ["Wilhelm Conrad Röntgen", "Röntgen"]) == 0.0
    assert accuracy("Röntgen won", ["Wilhelm Conrad Röntgen", "Röntgen"]) == 1.0
    assert accuracy("in 1901", "1") == 1.0  # plain substring, as Lost in the Middle's code
    assert best_subspan_em("The answer is Exeter College.", ["exeter college"]) == 1.0


def test_token_f1_partial_overlap():
    # pred tokens [barack, obama, jr], gold [barack, obama]: P = 2/3, R = 1, F1 = 0.8
    assert token_f1("Barack Obama Jr.", ["Barack Obama"]) == pytest.approx(0.8)
    # pred [new, york, city, usa] vs gold [york, city, new, jersey]: 3 common, P = R = 3/4
    assert token_f1("new york city usa", "york city new jersey") == pytest.approx(0.75)
    assert token_f1("Paris", ["London", "the Paris"]) == 1.0  # max over golds, article dropped
    assert token_f1("nothing here", ["Exeter College"]) == 0.0
    assert token_f1("", [""]) == 1.0 and token_f1("a", ["x"]) == 0.0  # "a" normalizes to empty


def test_token_f1_repeated_tokens_count_once_each():
    # pred [a1 a1 a1] vs gold [a1]: common = 1, P = 1/3, R = 1 -> F1 = 0.5
    assert token_f1("x x x", ["x"]) == pytest.approx(0.5)


def test_token_f1_custom_tokenizer():
    chars = lambda s: list(s.replace(" ", ""))  # noqa: E731
    # "abc" vs "abd": 2 common of 3 and 3 -> 2/3
    assert token_f1("abc", ["abd"], tokenize=chars) == pytest.approx(2 / 3)


def test_parse_generation():
    assert parse_generation("\nyes, it is\nmore") == "Yes"
    assert parse_generation("Nope") == "No"
    assert parse_generation("Exeter College\nblah") == "Exeter College"


def test_lcs_and_rouge_l_known_values():
    assert lcs_length("ABCBDAB", "BDCABA") == 4  # textbook example (CLRS 15.4)
    assert lcs_length([], [1]) == 0
    # Lin 2004 example: reference "police killed the gunman", candidate "police kill the gunman":
    # LCS = 3 (police, the, gunman), P = R = 3/4 -> F = 0.75
    assert rouge_l("police kill the gunman", "police killed the gunman") == pytest.approx(0.75)
    # candidate "the gunman kill police": LCS = 2 (the gunman) -> 0.5
    assert rouge_l("the gunman kill police", "police killed the gunman") == pytest.approx(0.5)
    # different lengths: pred 2 tokens, ref 4 tokens, LCS 2 -> P = 1, R = 0.5, F = 2/3
    assert rouge_l("Police, gunman!", ["police killed the gunman"]) == pytest.approx(2 / 3)
    assert rouge_l("", ["anything"]) == 0.0
    assert rouge_l("a b", ["x y", "a b"]) == 1.0


def test_score_dispatch():
    assert score("f1", "Barack Obama Jr.", ["Barack Obama"]) == pytest.approx(0.8)
    assert score("rouge_l", "a b", "a b") == 1.0
    with pytest.raises(ValueError, match="known"):
        score("bleu", "a", "a")


def test_kl_identical_is_exactly_zero():
    logits = torch.randn(49152, dtype=torch.float32)
    assert first_token_kl(logits, logits.clone()) == 0.0
    assert first_token_kl(logits, logits + 3.0) == pytest.approx(0.0, abs=1e-12)  # softmax is shift-invariant


def test_kl_known_value():
    p, q = np.array([0.5, 0.5]), np.array([0.25, 0.75])
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)  # = 0.143841...
    assert first_token_kl(np.log(p), np.log(q)) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(0.1438410362)
    # direction matters: KL(ref || other)
    assert first_token_kl(np.log(q), np.log(p)) != pytest.approx(expected)


def test_kl_handles_masked_vocab_and_batches():
    ref = torch.tensor([[0.0, 0.0, float("-inf")], [1.0, 2.0, 3.0]])
    other = torch.tensor([[0.0, 0.0, 5.0], [1.0, 2.0, 3.0]])
    per_row = kl_divergence(ref, other)
    assert per_row.dtype == torch.float64 and per_row[1] == 0.0
    assert per_row[0] == pytest.approx(math.log(2 + math.exp(5)) - math.log(2))
    assert first_token_kl(ref, other) == pytest.approx(float(per_row.mean()))
    with pytest.raises(ValueError, match="same shape"):
        first_token_kl(torch.zeros(3), torch.zeros(4))


def test_top1_agreement():
    assert top1_agreement(torch.tensor([0.1, 2.0, 0.3]), torch.tensor([5.0, 9.0, 1.0])) == 1.0
    assert top1_agreement(torch.tensor([0.1, 2.0, 0.3]), torch.tensor([9.0, 5.0, 1.0])) == 0.0
    assert top1_agreement(torch.tensor([[0.0, 1.0], [1.0, 0.0]]), torch.tensor([[0.0, 1.0], [0.0, 1.0]])) == 0.5


def test_greedy_and_prefix_agreement():
    ref = list(range(40))
    assert greedy_agreement(ref, list(ref)) == 1.0
    assert greedy_agreement(ref, ref[:32] + [-1] * 8) == 1.0  # only the first 32 count
    assert greedy_agreement(ref, ref[:31] + [-1], n=32) == 0.0
    assert greedy_agreement(torch.tensor([[1, 2, 3]]), [1, 2, 3]) == 1.0  # tensors or lists
    assert greedy_agreement([1, 2, 3], [1, 2]) == 0.0  # one stopped early
    assert prefix_agreement(ref, ref[:5] + [99, 6]) == 5
    assert prefix_agreement(ref, ref, n=32) == 32
    assert prefix_agreement([7], [8]) == 0


# --- 95% bootstrap intervals of the summaries (ragkv.eval.summary) ---

def test_bootstrap_ci_known_cases():
    from ragkv.eval.summary import bootstrap_ci

    assert bootstrap_ci([]) is None
    assert bootstrap_ci([0.3] * 7) == (0.3, 0.3)  # no spread, no interval
    # two values 0 and 1: a resample's mean is 0, 0.5 or 1 with probabilities 1/4, 1/2, 1/4, so the 2.5% and
    # 97.5% quantiles are exactly 0 and 1
    assert bootstrap_ci([0.0, 1.0]) == (0.0, 1.0)
    # 50 correct out of 100: the resampled mean is Binomial(100, 0.5) / 100, whose 2.5% and 97.5% quantiles are
    # 0.40 and 0.60 (P(X <= 39) = 0.018, P(X <= 40) = 0.028), the normal approximation 0.5 -+ 1.96 * 0.05
    lo, hi = bootstrap_ci([1.0] * 50 + [0.0] * 50)
    assert (lo, hi) == (pytest.approx(0.40), pytest.approx(0.60))
    # 90% interval is narrower; the seed makes it deterministic, another seed moves it at most a little
    lo90, hi90 = bootstrap_ci([1.0] * 50 + [0.0] * 50, confidence=0.9)
    assert lo < lo90 < 0.5 < hi90 < hi
    xs = list(np.random.default_rng(1).random(37))
    assert bootstrap_ci(xs) == bootstrap_ci(xs) and bootstrap_ci(xs, seed=1) != bootstrap_ci(xs)
    assert bootstrap_ci(xs, seed=1) == pytest.approx(bootstrap_ci(xs), abs=0.02)
    with pytest.raises(ValueError, match="confidence"):
        bootstrap_ci([1.0], confidence=1.0)


def test_bootstrap_ci_paired_difference():
    from ragkv.eval.summary import summarize

    def rec(ex, mode, acc):
        return {"example_id": ex, "mode_key": mode, "scores": {"accuracy": acc}, "ttft_ms": 1.0,
                "fidelity": {"first_token_kl": 0.0, "top1_agreement": 1.0}}
    # 40 examples; `reuse` loses exactly the 4 examples it differs on: difference -0.1 on every resample's scale
    full = [rec(str(i), "full", float(i % 2)) for i in range(40)]
    reuse = [rec(str(i), "reuse", float(i % 2) if i >= 8 else 0.0) for i in range(40)]
    s = summarize(full + reuse)
    assert s["reuse"]["accuracy_vs_full"] == pytest.approx(-0.1) and s["reuse"]["accuracy_vs_full_n"] == 40
    lo, hi = s["reuse"]["accuracy_vs_full_ci"]
    assert -0.25 < lo < -0.1 < hi <= 0.0  # paired: never above 0, since reuse is never better
    # the paired interval is narrower than the difference of the two separate intervals would suggest
    (flo, fhi), (rlo, rhi) = s["full"]["accuracy_ci"], s["reuse"]["accuracy_ci"]
    assert hi - lo < (fhi - rlo) - (flo - rhi)
