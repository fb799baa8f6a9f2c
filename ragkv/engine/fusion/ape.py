"""APE attention (Yang, Chen, Chen 2025, "Adaptive Parallel Encoding"): the joint merge of appendix C.4.

Context tokens (the parallel-encoded blocks) get a temperature T inside their softmax and a scaling
factor S on their log-sum-exp; prefix and query/generated tokens attend normally. What runs is appendix C.4's
merge of one attention per part through the parts' log-sum-exps (it differs from eq. 11-12's written form when
S != 1):
    lse_ctx' = S * T * LSE(q.k / (sqrt(d) T)),   out = sum_p softmax_p(lse_p) * out_p
With T = S = 1 this is exactly attention over the concatenation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragkv.ops.attention import attention_with_lse, causal_mask, merge_by_lse

DEFAULT_T = 0.9
DEFAULT_S = 0.9


@dataclass(frozen=True)
class ApeAttention:
    """Cache order is [prefix (P) | context (C) | query + generated]; callable as a decode attention policy."""
    prefix_len: int
    context_len: int
    temperature: float
    scale: float

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        P, C = self.prefix_len, self.context_len
        T_q, tail = q.shape[2], k.shape[2] - P - C
        outs, lses = [], []
        if P:
            o, lse = attention_with_lse(q, k[:, :, :P], v[:, :, :P])
            outs.append(o), lses.append(lse)
        if C:
            o, lse = attention_with_lse(q, k[:, :, P:P + C], v[:, :, P:P + C], temperature=self.temperature)
            outs.append(o), lses.append(lse * (self.scale * self.temperature))
        mask = causal_mask(T_q, tail, q.device) if T_q > 1 else None
        o, lse = attention_with_lse(q, k[:, :, P + C:], v[:, :, P + C:], mask=mask)
        outs.append(o), lses.append(lse)
        return merge_by_lse(outs, lses).to(q.dtype)
