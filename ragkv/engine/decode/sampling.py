"""Next-token choice, in vLLM's order: penalties on the model's logits, then greedy, or temperature, top-k, min-p
and top-p (nucleus) sampling with a seeded generator; and the log-probabilities of a choice."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability and the `k` most likely tokens' (id, log-probability), best first."""
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, prompt_mask: torch.Tensor | None,
                    presence: float = 0.0, frequency: float = 0.0, repetition: float = 1.0) -> torch.Tensor:
    """logits [V] fp32; counts [V]: how often each token was generated so far; prompt_mask [V] bool: tokens of the
    prompt (repetition only). Returns new logits; all tensors on the logits' device."""
    if repetition != 1.0:
        # CTRL (Keskar et al. 2019, sec. 4.1), as transformers and vLLM: every token already seen (prompt or
        # output) has a positive logit divided by the penalty and a negative one multiplied by it
        seen = counts > 0 if prompt_mask is None else (counts > 0) | prompt_mask
        penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalized, logits)
    if presence or frequency:
        # OpenAI's definition, output tokens only: mu[j] - c[j] * frequency - (c[j] > 0) * presence
        logits = logits - counts * frequency - (counts > 0).to(logits.dtype) * presence
    return logits


def finite_or_tied(logits: torch.Tensor) -> torch.Tensor:
    """Logits a draw can use whatever the penalties did: a repetition penalty of 3e-250 (valid: > 0; a fuzzer's)
    divides a positive logit into +inf, and softmax then gives NaN probabilities, a failed draw. The tokens at +inf
    tie as the only choices; NaN is never chosen. A finite maximum (max propagates NaN) means no +inf and no NaN:
    the logits are used as they are (-inf entries draw nothing either way); one pass, where `isfinite().all()` took
    ~0.25 ms a row of 152K on a 2-core Zen 4, paid by every sequence at every step."""
    if math.isfinite(float(logits.amax())):
        return logits
    top = logits == float("inf")
    if bool(top.any()):
        return torch.where(top, 0.0, float("-inf"))
    return torch.nan_to_num(logits, nan=float("-inf"))


# a temperature below this is greedy, as in vLLM (its _SAMPLING_EPS): a fuzzer's 2e-288 is 0 in fp32, and the
# division gave NaN probabilities that failed the draw
GREEDY_BELOW = 1e-5


def greedy_token(logits: torch.Tensor, width: int = 128) -> int:
    """torch.argmax(logits) for [V] logits without NaN (the first of tied maxima): the maxima of rows of `width`
    (vectorized), then the first row holding the largest and its first maximum. torch's argmax over a vocabulary of
    152K took ~0.13-0.25 ms on a 2-core Zen 4, this ~0.03."""
    n = logits.shape[0] // width * width
    if n == 0:
        return int(torch.argmax(logits))
    rows = logits[:n].reshape(-1, width).amax(dim=1)
    r = int(torch.argmax(rows))
    tail = logits[n:]
    if tail.numel() and bool(tail.amax() > rows[r]):  # strictly: on a tie the earlier row's index comes first
        return n + int(torch.argmax(tail))
    return r * width + int(torch.argmax(logits[r * width:(r + 1) * width]))


def sample(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
           generator: torch.Generator | None = None, top_k: int = 0, min_p: float = 0.0) -> int:
    """logits: [V] fp32 -> token id. top_k <= 0 and min_p == 0 are off; temperature 0 is greedy."""
    logits = finite_or_tied(logits.float())
    if temperature < GREEDY_BELOW:
        return greedy_token(logits)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if min_p > 0:
        # min-p (Nguyen et al. 2024, eq. 1): keep tokens at least min_p times as likely as the most likely one
        probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # keep the smallest set whose mass reaches top_p (the top token always survives)
        drop = torch.cumsum(sorted_p, dim=-1) - sorted_p > top_p
        sorted_p[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    # drawn on the CPU: a seed gives the same tokens on every device
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def token_logprob(logits: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """The model's own distribution (log_softmax of the raw logits: before penalties, temperature and truncation,
    vLLM's `raw_logprobs`): the chosen token's log-probability and the k most likely tokens'."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = float(logp[token])
    if k <= 0:
        return TokenLogprob(token, chosen)
    values, ids = torch.topk(logp, min(k, logp.shape[-1]))
    return TokenLogprob(token, chosen, tuple(zip(ids.tolist(), values.tolist())))
