"""Analytic FLOPs of a pass over the layers: what each fusion mode's `first_token_flops` is built from
(Block-Attention table 2 layout).

Counts multiply-adds as 2 FLOPs: per token and layer the Q/K/V/O projections and the SwiGLU MLP, attention
as 4 * Hq * D per attended key (QK^T and PV), and the LM head (`head_flops`) once for the last token.
"""

from __future__ import annotations

from ragkv.models.args import ModelArgs


def linear_flops(a: ModelArgs) -> int:
    """Per token, per layer."""
    h, d = a.hidden_size, a.head_dim
    qkvo = h * a.num_heads * d * 2 + 2 * h * a.num_kv_heads * d
    return 2 * (qkvo + 3 * h * a.intermediate_size)


def attention_flops(a: ModelArgs, keys: int) -> int:
    return 4 * a.num_heads * a.head_dim * keys


def rows_flops(a: ModelArgs, first_pos: int, n: int, layers: int) -> int:
    """n consecutive tokens starting at cache index first_pos, each attending causally, for `layers` layers."""
    attended = n * first_pos + n * (n + 1) // 2
    return layers * (n * linear_flops(a) + attention_flops(a, attended))


def head_flops(a: ModelArgs) -> int:
    """The LM head for the one token whose logits the first answer token comes from."""
    return 2 * a.hidden_size * a.vocab_size
