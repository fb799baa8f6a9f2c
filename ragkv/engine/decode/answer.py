"""A request's answer: in flight (Run, its text deltas as they are decoded) and complete (Answer)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch

from ragkv.engine.decode.generate import Delta, Sequence
from ragkv.engine.measure.stats import RequestStats


@dataclass
class Answer:
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: RequestStats
    first_logits: torch.Tensor  # [V] fp32, the first generated token's distribution
    logprobs: list = field(default_factory=list)  # TokenLogprob per token, when GenerationOptions.logprobs asked


class Run:
    """A request in flight: iterate for text deltas; `stats` and `generation` are complete afterwards."""

    def __init__(self, deltas: Iterator[Delta], seq: Sequence):
        self._deltas, self.generation, self.stats = deltas, seq.out, seq.stats
        self.first_logits = seq.first_logits

    def __iter__(self) -> Iterator[Delta]:
        return self._deltas

    def close(self) -> None:
        """Stop decoding early (client gone, deadline passed) and release the model."""
        self._deltas.close()

    def answer(self) -> Answer:
        for _ in self._deltas:
            pass
        g = self.generation
        return Answer(g.text, g.token_ids, g.finish_reason, self.stats, self.first_logits, list(g.logprobs))
