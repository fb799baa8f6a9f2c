"""Analytic FLOPs to the first token per fusion mode (Block-Attention table 2 layout).

Counts multiply-adds as 2 FLOPs: per token and layer the Q/K/V/O projections and the SwiGLU MLP, attention
as 4 * Hq * D per attended key (QK^T and PV), and the LM head once for the last token.
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


def flops_to_first_token(a: ModelArgs, mode: str, context: int, query: int, ratio: float = 0.15,
                         check_layer: int = 1, prefix_len: int = 0, cached_prefix: int = 0) -> int:
    """context: prefix + block tokens; query: query tokens; for `prefix`, `cached_prefix` tokens are reused."""
    head = 2 * a.hidden_size * a.vocab_size
    L = a.num_layers
    if mode == "full":
        return rows_flops(a, 0, context + query, L) + head
    if mode == "prefix":
        return rows_flops(a, cached_prefix, context + query - cached_prefix, L) + head
    if mode in ("reuse", "ape"):
        return rows_flops(a, context, query, L) + head
    if mode == "blend":
        total = context + query
        early = rows_flops(a, 0, total, check_layer)  # layers before the check: every token
        check_v = 2 * a.hidden_size * a.num_kv_heads * a.head_dim * (context - prefix_len)
        selected = int(round(ratio * (context - prefix_len)))
        rows = selected + query  # selected block tokens spread over the context: attend ~half of it on average
        late = (L - check_layer) * (rows * linear_flops(a) + attention_flops(a, selected * context // 2
                                                                            + query * context + query * query // 2))
        return early + check_v + late + head
    raise ValueError(f"unknown mode {mode!r}")
