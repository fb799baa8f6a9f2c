"""Task metrics (accuracy, exact match, token F1, Rouge-L) and fidelity of a mode to `full` (first-token KL,
top-1 agreement, greedy-output agreement). Answer metrics take the max over the acceptable answers."""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Callable, Sequence

from ragkv.ops.divergence import (_ids, _logits_pair, first_token_kl, kl_divergence,  # noqa: F401 - metrics of
                                  prefix_agreement, top1_agreement)  # this module too

_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def _golds(golds: str | Sequence[str]) -> list[str]:
    out = [golds] if isinstance(golds, str) else list(golds)
    if not out:
        raise ValueError("need at least one gold answer")
    return out


# SQuAD v1.1 evaluation script, normalize_answer: lowercase, drop punctuation and articles, squeeze whitespace.
def normalize_answer(s: str) -> str:
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", s).split())


# SQuAD v1.1 evaluation script, exact_match_score (max over golds).
def exact_match(prediction: str, golds: str | Sequence[str]) -> float:
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in _golds(golds)))


# Lost in the Middle (Liu et al. 2023) best_subspan_em, also Block-Attention's accuracy: a normalized gold answer
# is a substring of the normalized output (plain substring, as their code does: "1" matches "1901").
def accuracy(prediction: str, golds: str | Sequence[str]) -> float:
    pred = normalize_answer(prediction)
    return float(any(normalize_answer(g) in pred for g in _golds(golds)))


best_subspan_em = accuracy  # the name Lost in the Middle's code gives the same function; their NQ metric


# SQuAD v1.1 evaluation script, f1_score (max over golds), as CacheBlend scores MuSiQue. CacheBlend counts the
# model tokenizer's tokens of the normalized strings: pass `tokenize` to reproduce that; default is whitespace.
def token_f1(prediction: str, golds: str | Sequence[str],
             tokenize: Callable[[str], Sequence] | None = None) -> float:
    split = tokenize or str.split
    pred = list(split(normalize_answer(prediction)))
    return max(_f1(pred, list(split(normalize_answer(g)))) for g in _golds(golds))


def _f1(pred: list, gold: list) -> float:
    if not pred or not gold:
        return float(pred == gold)  # SQuAD: an empty answer scores 1 only against an empty answer
    same = sum((Counter(pred) & Counter(gold)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def parse_generation(text: str) -> str:
    """CacheBlend's answer extraction (example/utils.py): the first non-empty line; yes/no answers collapsed."""
    s = text.lstrip("\n").split("\n")[0]
    words = s.split()
    if s.startswith(("Yes", "yes")):
        return "Yes"
    if words and words[0].startswith(("No", "no")):
        return "No"
    return s


def rouge_tokens(text: str) -> list[str]:
    """Lowercased alphanumeric runs, as rouge_score's default tokenizer (without stemming)."""
    return re.findall(r"[a-z0-9]+", text.lower())


def lcs_length(a: Sequence, b: Sequence) -> int:
    """Length of the longest common subsequence, O(len(a) * len(b)) time, O(len(b)) memory."""
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


# Rouge-L (Lin 2004, section 3.1): LCS-based F-measure with beta = 1, as rouge_score / LongBench report it.
def rouge_l(prediction: str, references: str | Sequence[str]) -> float:
    pred = rouge_tokens(prediction)
    best = 0.0
    for ref in _golds(references):
        gold = rouge_tokens(ref)
        lcs = lcs_length(pred, gold) if pred and gold else 0
        if lcs:
            precision, recall = lcs / len(pred), lcs / len(gold)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "accuracy": accuracy, "best_subspan_em": best_subspan_em, "exact_match": exact_match, "f1": token_f1,
    "rouge_l": rouge_l,
}


def score(metric: str, prediction: str, golds: str | Sequence[str]) -> float:
    """Score one output with a metric named as in `Example.metric`."""
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; known: {', '.join(METRICS)}")
    return METRICS[metric](prediction, golds)


# --- fidelity of a mode to `full` ---

def greedy_agreement(ref_ids, other_ids, n: int = 32) -> float:
    """1.0 if the first `n` generated tokens are identical (same length too, e.g. both stopped early), else 0.0."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return float(_ids(ref_ids)[:n] == _ids(other_ids)[:n])
