"""Position layouts: where each segment sits once the blocks are fused ("position layout" in docs/invariants.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Layout:
    """Positions of every cached token, in cache order [prefix | block 0 | block 1 | ... | query]."""
    prefix_len: int
    block_lens: tuple[int, ...]
    query_start: int  # position of the first query token
    context_positions: torch.Tensor  # [prefix_len + sum(block_lens)] int64

    @property
    def context_len(self) -> int:
        return self.context_positions.shape[0]

    def block_offsets(self) -> list[int]:
        """Cache index where each block starts."""
        out, off = [], self.prefix_len
        for n in self.block_lens:
            out.append(off)
            off += n
        return out


def make_layout(prefix_len: int, block_lens: list[int], kind: str = "sequential") -> Layout:
    """`sequential`: each block after the previous (Block-Attention, CacheBlend);
    `shared`: every block starts right after the prefix, query after the longest (APE);
    `local`: no position re-encoding, every block (the prefix too) keeps the positions 0..n-1 it was encoded at,
    the query after all of them (Block-Attention's "w/o-pos" ablation, Ma et al., ICLR 2025)."""
    parts = [torch.arange(prefix_len)]
    if kind == "sequential":
        start = prefix_len
        for n in block_lens:
            parts.append(torch.arange(start, start + n))
            start += n
        query_start = start
    elif kind == "shared":
        for n in block_lens:
            parts.append(torch.arange(prefix_len, prefix_len + n))
        query_start = prefix_len + max(block_lens, default=0)
    elif kind == "local":
        parts += [torch.arange(n) for n in block_lens]
        query_start = prefix_len + sum(block_lens)
    else:
        raise ValueError(f"unknown layout {kind!r}")
    return Layout(prefix_len, tuple(block_lens), query_start, torch.cat(parts).long())
