"""The order retrieved passages take in a prompt. Block-Attention (Ma et al., ICLR 2025, sec. 3.2) puts them in
ascending relevance, so that the best passage is the one next to the question. Measured here (Qwen 0.5B, 40 NQ-10
questions, docs/results/quality_selection.md "best-first"): best-last halves the query-aware blend's first-token KL
to `full` (-0.064 [-0.089, -0.039]); its accuracy gain (+12.5 points [-2.5, +27.5]) and `reuse`'s change (-5.0
[-12.5, 0.0]) are not significant."""

from __future__ import annotations

from typing import Sequence, TypeVar

from ragkv.errors import OptionError
from ragkv.settings import DEFAULT_PASSAGE_ORDER

T = TypeVar("T")
PASSAGE_ORDERS = ("best-last", "best-first", "as-given")  # as-given: the retriever's own order


def check_order(order: str, param: str = "passage_order") -> str:
    if order not in PASSAGE_ORDERS:
        raise OptionError(param, f"{param} must be one of {', '.join(PASSAGE_ORDERS)}, got {order!r}")
    return order


def order_passages(best_first: Sequence[T], order: str = DEFAULT_PASSAGE_ORDER) -> list[T]:
    """Passages ranked best first (as every search returns them) in the prompt order `order` names."""
    check_order(order)
    return list(reversed(best_first)) if order == "best-last" else list(best_first)
