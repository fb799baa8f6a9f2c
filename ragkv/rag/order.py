"""The order retrieved passages take in a prompt. Block-Attention (Ma et al., ICLR 2025, sec. 3.2) puts them in
ascending relevance, so that the best passage is the one next to the question; a model reusing independently
encoded blocks answers far better that way (docs/results/passage_order.md)."""

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
