"""Decoding after any fusion mode: a sequence chooses its tokens, detokenizes them incrementally and stops on EOS,
a stop string or its budget; feeding the chosen tokens back is batched across sequences (ragkv.engine.kv.state)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from ragkv.engine.decode.constrained import Constraint
from ragkv.engine.decode.sampling import TokenLogprob, apply_penalties, sample, token_logprob
from ragkv.engine.kv.state import DecodeState, decode_batch, decode_forward, finish_decode
from ragkv.engine.measure.stats import RequestStats
from ragkv.engine.request.generation import GenerationOptions
from ragkv.models.loop import Forward, outcome, run_together

log = logging.getLogger("ragkv.engine")


@dataclass
class Delta:
    text: str
    token_id: int | None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of the tokens this text completes (if asked)


@dataclass
class Generation:
    """Final once its sequence is finished: `text`, `token_ids`, `finish_reason` and, when asked for, one
    `logprobs` entry per token id."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    logprobs: list[TokenLogprob] = field(default_factory=list)


def _stop_index(text: str, stops: tuple[str, ...], start: int = 0) -> int:
    """Where the first stop string begins at or after `start`, or -1."""
    hits = [i for i in (text.find(s, start) for s in stops if s) if i >= 0]
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


class Detokenizer:
    """Incremental detokenization: each token decodes a short window, not the whole answer again.

    The window starts a few tokens back (`prefix`), so the tokenizer sees the same left context as in a full
    decode (leading-space rules), and text is released only once it no longer ends in a partial character.
    """

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.text = tokenizer, [], ""
        self.prefix = self.read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> str:
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # an incomplete multi-byte character: wait for the next token
        new = after[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += new
        return new

    def final(self) -> str:
        """All text, partial characters at the end included."""
        return self.text + self._decode(self.ids[self.prefix:])[len(self._decode(self.ids[self.prefix:self.read])):]


class Sequence:
    """One request being decoded. `advance()` picks the next token from `state.logits` and returns the new text;
    afterwards `feed` is the token to run through the model next, or None once `finished`."""

    def __init__(self, state: DecodeState, opts: GenerationOptions, tokenizer, eos_ids: set[int],
                 stats: RequestStats, max_positions: int, prompt_ids: list[int] = ()):
        self.state, self.opts, self.eos_ids, self.stats = state, opts, eos_ids, stats
        self.tokenizer, self.max_positions, self.prompt_ids = tokenizer, max_positions, prompt_ids
        self.generator = torch.Generator().manual_seed(opts.seed) if opts.seed is not None else None
        self.budget = max(0, min(opts.max_new_tokens, max_positions - state.next_position))
        state.cache.max_rows = state.cache.length + self.budget  # its cache grows no further than this
        self.detok = Detokenizer(tokenizer)
        self.out = Generation()
        self.first_logits = state.logits.clone()
        self.counts = self.prompt_mask = None  # penalties' state, on the logits' device
        if opts.penalized:
            dev, vocab = state.logits.device, state.logits.shape[-1]
            self.counts = torch.zeros(vocab, dtype=torch.float32, device=dev)
            if opts.repetition_penalty != 1.0:
                self.prompt_mask = torch.zeros(vocab, dtype=torch.bool, device=dev)
                ids = torch.tensor([t for t in prompt_ids if t < vocab], dtype=torch.long, device=dev)
                self.prompt_mask[ids] = True
        # response_format: the grammar's matcher, one per sequence (n choices each follow it on their own)
        self.constraint = Constraint(opts.grammar, tokenizer, eos_ids) if opts.grammar else None
        self.stops_from = 0  # where stop strings may begin in the text (after min_tokens' tokens)
        self.sent = 0  # characters of out.text already streamed
        self.logprobs_sent = 0  # entries of out.logprobs already streamed
        self.feed: int | None = None
        self.finished = False
        self.on_finish: Callable[["Sequence"], None] | None = None  # run once when it ends, before its KV goes
        self.t0 = time.perf_counter()

    def advance(self) -> list[Delta]:
        deltas = self._advance_one()
        # tokens the prefill already ran (DecodeState.lookahead): each chosen one needs no forward
        while self.feed is not None and self.state.take_lookahead(self.feed):
            self.stats.extra["lookahead_taken"] = self.stats.extra.get("lookahead_taken", 0) + 1
            deltas += self._advance_one()
        return deltas

    def _advance_one(self) -> list[Delta]:
        if self.finished:
            return []
        self.feed = None
        if len(self.out.token_ids) >= self.budget:
            return self._finish("length")
        o, logits = self.opts, self.state.logits
        if self.counts is not None:
            logits = apply_penalties(logits, self.counts, self.prompt_mask, o.presence_penalty,
                                     o.frequency_penalty, o.repetition_penalty)
        early = len(self.out.token_ids) < o.min_tokens  # vLLM's min_tokens: no end of any kind before it
        if early and self.eos_ids:
            logits = logits.clone()
            logits[[t for t in self.eos_ids if t < logits.shape[-1]]] = float("-inf")
        if self.constraint is not None:
            logits = self.constraint.allow(logits)
            if logits is None:  # no token can continue the grammar: end cleanly, never sample from all -inf
                return self._finish("grammar_error")
        token = sample(logits, o.temperature, o.top_p, self.generator, o.top_k, o.min_p)
        if token in self.eos_ids:  # "stop" only where the grammar is complete (its mask keeps EOS nowhere else)
            return self._finish("stop" if self.constraint is None or self.constraint.accepting else "grammar_error")
        if self.constraint is not None:
            self.constraint.consume(token)
        self.out.token_ids.append(token)
        if self.counts is not None:
            self.counts[token] += 1
        if o.logprobs is not None:
            self.out.logprobs.append(token_logprob(self.state.logits, token, o.logprobs))
        self.detok.add(token)
        text = self.detok.text
        stops = self.opts.stop if not early else ()
        if early:  # a stop string counts from after the first min_tokens tokens' text (vLLM looks at new text only)
            self.stops_from = len(text)
        cut = _stop_index(text, stops, self.stops_from) if stops else -1
        if cut >= 0:
            deltas = [Delta(text[self.sent:cut], token, self._unsent_logprobs())] if cut > self.sent else []
            self.sent = max(self.sent, cut)
            return deltas + self._finish("stop", text[:cut])
        self.out.text = text
        ready = len(text) - (_held_back(text, stops) if stops else 0)
        deltas = []
        if ready > self.sent:
            deltas.append(Delta(text[self.sent:ready], token, self._unsent_logprobs()))
            self.sent = ready
        if self.constraint is not None and self.constraint.done:  # the JSON value is complete
            deltas += self._finish("stop")
        elif len(self.out.token_ids) < self.budget:
            self.feed = token
        else:
            deltas += self._finish("length")
        return deltas

    def _finish(self, reason: str, text: str | None = None) -> list[Delta]:
        """`text`: the answer cut at a stop string; otherwise all decoded text, partial characters included."""
        self.finished, self.feed = True, None
        if self.on_finish is not None:  # e.g. a chat reply's KV kept for the next turn (Engine.start_steps)
            try:
                self.on_finish(self)
            except Exception:  # keeping is an optimisation: the answer is whole without it
                log.exception("could not keep a finished sequence's KV")
        self.state.release()  # the KV goes now, not when the last reference to this sequence does
        self.out.finish_reason = reason
        self.out.text = text if text is not None else self.detok.final()
        self.stats.completion_tokens = len(self.out.token_ids)
        self.stats.decode_ms = (time.perf_counter() - self.t0) * 1000
        if len(self.out.text) > self.sent:  # text held back for a stop string that never came
            delta = [Delta(self.out.text[self.sent:], None, self._unsent_logprobs())]
            self.sent = len(self.out.text)
            return delta
        if self.logprobs_sent < len(self.out.logprobs):  # tokens whose text a stop string cut away
            return [Delta("", None, self._unsent_logprobs())]
        return []

    def _unsent_logprobs(self) -> list[TokenLogprob]:
        new = self.out.logprobs[self.logprobs_sent:]
        self.logprobs_sent = len(self.out.logprobs)
        return new

    def fork(self, index: int) -> "Sequence":
        """Choice `index` of the same prompt (n > 1), before any token was chosen: the prefilled state with the
        prompt's KV shared (DecodeState.fork), the same options, seed + index (so that seeded choices differ from
        each other and repeat)."""
        if self.out.token_ids or self.finished:
            raise RuntimeError("fork a sequence before it advances")
        opts = self.opts if self.opts.seed is None else replace(self.opts, seed=(self.opts.seed + index) % (1 << 63))
        stats = replace(self.stats, extra=dict(self.stats.extra))
        seq = Sequence(self.state.fork(), opts, self.tokenizer, self.eos_ids, stats, self.max_positions,
                       self.prompt_ids)
        seq.first_logits = self.first_logits  # the same distribution: one copy for every choice
        return seq

    def cancel(self, reason: str) -> None:
        """Leave decoding now (client gone, deadline passed): the text so far is final."""
        if not self.finished:
            self._finish(reason, self.out.text)


def step_sequences(model, seqs: list[Sequence], rows: int | None = None, forwards: list[Forward] = ()) -> list:
    """One batched forward for every sequence that has a token to feed (at a fixed row count: decode_batch), with
    `forwards` (prefill chunks, blocks to encode, queries over cached blocks: of the same model) in the same pass
    over the layers; returns their outputs, in order. At a fixed row count the forwards run alone: a row's numbers
    must not depend on what runs beside it."""
    live = [s for s in seqs if s.feed is not None]
    forwards = list(forwards)
    if rows is not None or not live:
        if live:
            decode_batch(model, [s.state for s in live], [s.feed for s in live], rows)
        return [outcome(f) for f in forwards]
    states = [s.state for s in live]
    outs = run_together([decode_forward(model, states, [s.feed for s in live])] + forwards)
    if isinstance(outs[0], BaseException):  # the decode rows' own failure fails the step, as a decode step alone
        raise outs[0]
    finish_decode(model, states, outs[0])
    return outs[1:]

