"""Decoding after any fusion mode: a streaming iterator of text deltas with EOS and stop strings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ragkv.engine.options import GenerationOptions, RequestStats
from ragkv.engine.sampling import sample
from ragkv.engine.state import DecodeState, decode_step


@dataclass
class Delta:
    text: str
    token_id: int | None


@dataclass
class Generation:
    """Consumed by iterating `stream()`; afterwards `text`, `token_ids` and `finish_reason` are final."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"


def _stop_index(text: str, stops: tuple[str, ...]) -> int:
    hits = [text.find(s) for s in stops if s and s in text]
    return min(hits) if hits else -1


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of `text` that could still start a stop string: not streamed yet."""
    n = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                n = max(n, k)
                break
    return n


def stream_tokens(model, tokenizer, state: DecodeState, opts: GenerationOptions, eos_ids: set[int],
                  stats: RequestStats, out: Generation, max_positions: int) -> Iterator[Delta]:
    """Sample from state.logits, feed the token back, yield new text until EOS, a stop string or the limit."""
    gen = torch.Generator().manual_seed(opts.seed) if opts.seed is not None else None
    budget = min(opts.max_new_tokens, max_positions - state.next_position)
    sent = 0
    t0 = time.perf_counter()
    for step in range(budget):
        token = sample(state.logits, opts.temperature, opts.top_p, gen)
        if token in eos_ids:
            out.finish_reason = "stop"
            break
        out.token_ids.append(token)
        text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
        cut = _stop_index(text, opts.stop)
        if cut >= 0:
            out.text, out.finish_reason = text[:cut], "stop"
            if cut > sent:
                yield Delta(text[sent:cut], token)
            sent = cut
            break
        out.text = text
        ready = len(text) - _held_back(text, opts.stop)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the next token
            ready = min(ready, len(text) - 1)
        if ready > sent:
            yield Delta(text[sent:ready], token)
            sent = ready
        if step + 1 < budget:
            decode_step(model, state, token)
    else:
        out.finish_reason = "length"
    if len(out.text) > sent:  # text held back for a stop string that never came
        yield Delta(out.text[sent:], None)
    stats.completion_tokens = len(out.token_ids)
    stats.decode_ms = (time.perf_counter() - t0) * 1000
