"""Next-token choice: greedy, or temperature + nucleus (top-p) sampling with a seeded generator."""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> int:
    """logits: [V] fp32 -> token id."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # keep the smallest set whose mass reaches top_p (the top token always survives)
        drop = torch.cumsum(sorted_p, dim=-1) - sorted_p > top_p
        sorted_p[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
