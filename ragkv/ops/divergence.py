"""Divergence of two next-token distributions given as logits: how far an approximate answer is from another."""

from __future__ import annotations

import torch


def _logits_pair(ref, other) -> tuple[torch.Tensor, torch.Tensor]:
    p, q = torch.as_tensor(ref).detach().cpu().double(), torch.as_tensor(other).detach().cpu().double()
    if p.shape != q.shape or p.ndim == 0:
        raise ValueError(f"logits must have the same shape [..., vocab], got {tuple(p.shape)} and {tuple(q.shape)}")
    return p, q


def kl_divergence(ref_logits, other_logits) -> torch.Tensor:
    """KL(softmax(ref) || softmax(other)) per row over the last dimension, in fp64 from log_softmax."""
    p, q = _logits_pair(ref_logits, other_logits)
    lp, lq = torch.log_softmax(p, dim=-1), torch.log_softmax(q, dim=-1)
    terms = torch.where(lp > float("-inf"), lp.exp() * (lp - lq), torch.zeros_like(lp))  # 0 log 0 = 0
    return terms.sum(dim=-1).clamp_min(0.0)  # rounding can leave -1e-17 on near-identical rows


def first_token_kl(ref_logits, other_logits) -> float:
    """KL(ref || other) of the first generated token's distributions; mean over leading dims if batched."""
    return float(kl_divergence(ref_logits, other_logits).mean())


def confidence(logits) -> dict:
    """How sure one next-token distribution is: its entropy (nats) and the probability gap between its two most
    likely tokens."""
    lp = torch.log_softmax(torch.as_tensor(logits).detach().cpu().double().reshape(-1), dim=-1)
    p = lp.exp()
    top = torch.topk(p, 2).values
    return {"entropy": float(-(torch.where(p > 0, p * lp, torch.zeros_like(p))).sum()),
            "margin": float(top[0] - top[1])}


def top1_agreement(ref_logits, other_logits) -> float:
    """Fraction of rows whose argmax token is the same (1.0 / 0.0 for a single distribution)."""
    p, q = _logits_pair(ref_logits, other_logits)
    return float((p.argmax(dim=-1) == q.argmax(dim=-1)).double().mean())


def _ids(ids) -> list[int]:
    return [int(t) for t in (ids.reshape(-1).tolist() if hasattr(ids, "tolist") else ids)]


def prefix_agreement(ref_ids, other_ids, n: int | None = None) -> int:
    """Number of leading tokens two greedy outputs share (looking at the first `n` at most)."""
    a, b = _ids(ref_ids)[:n], _ids(other_ids)[:n]
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k
