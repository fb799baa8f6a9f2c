"""Constrained decoding: each step's logits masked to the tokens a grammar allows (OpenAI's `response_format`
`json_object` / `json_schema`), through llguidance (PyPI `llguidance`: a Rust matcher that fills a token bitmask
per sequence, without torch).

A grammar is llguidance's text form, compiled once per request from a JSON schema (`json_grammar`); each sequence
holds its own matcher (`Constraint`), advanced by the tokens it chooses. The mask keeps the end-of-sequence tokens
only where the grammar accepts, so an answer that ends with "stop" is a complete JSON value. A step whose mask
allows no token (a grammar the tokenizer cannot complete) ends the sequence with finish reason
`grammar_error` instead of sampling from all -inf logits (NaNs). A schema that no finite value follows is
refused before any of this (`check_finite`)."""

from __future__ import annotations

import json
import threading

import numpy as np
import torch

from ragkv.engine.decode.finite import unfinishable
from ragkv.errors import InvalidRequestError

ANY_OBJECT = {"type": "object"}  # json_object: any JSON object
_TOKENIZERS: dict[int, object] = {}  # id(HF tokenizer) -> llguidance's wrapping of it (~0.4 s to build)
_LOCK = threading.Lock()


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
        import llguidance.numpy
    except ImportError as e:  # an install step missing: say which
        raise InvalidRequestError("response_format needs the llguidance package: pip install llguidance") from e
    return llguidance


def _compiled(make, what: str) -> str:
    """A grammar from `make(LLMatcher)`, validated; an InvalidRequestError with llguidance's reason when unusable."""
    llg = _llguidance()
    try:
        grammar = make(llg.LLMatcher)
        error = llg.LLMatcher.validate_grammar(grammar)
    except Exception as e:  # noqa: BLE001 - the library's own message is the useful part
        error = str(e) or type(e).__name__
    if error:
        raise InvalidRequestError(f"the {what} cannot be used: {error}")
    return grammar


def check_finite(schema, what: str) -> None:
    """An InvalidRequestError, in llguidance's words for `{"anyOf": []}`, when no finite JSON value follows
    `schema` (engine/decode/finite.py): its grammar could never be completed."""
    try:
        bad = unfinishable(schema)
    except RecursionError:
        raise InvalidRequestError(f"the {what} is nested too deeply") from None
    if bad is None:
        return
    names, whom = ", ".join(f"`{b}`" for b in bad), "itself" if len(bad) == 1 else "each other"
    why = (f"{names} can only be satisfied by nesting {whom} without end; give the recursion a way out (an optional "
           "property, an anyOf branch without the $ref, minItems 0)" if bad else
           "a required property or an allOf part admits no value")
    raise InvalidRequestError(f"the {what} cannot be used: Unsatisfiable schema: no finite JSON value follows it: "
                              f"{why}")


def json_grammar(schema: dict | None) -> str:
    """llguidance's grammar for JSON that follows `schema` (None: any JSON object); an invalid schema is an
    InvalidRequestError that says what is wrong. Compact JSON (no free whitespace): a small model otherwise spends
    its tokens on newlines and indentation (SmolLM2's json_object answer: 26 lines, cut by max_tokens 60)."""
    if schema is not None:
        check_finite(schema, "JSON schema")
    text = json.dumps(ANY_OBJECT if schema is None else schema)
    return _compiled(lambda m: m.grammar_from_json_schema(text, defaults={"whitespace_flexible": False}),
                     "JSON schema")


def lark_grammar(lark: str) -> str:
    """llguidance's grammar from its Lark form (JSON schemas embed with `%json {...}`)."""
    return _compiled(lambda m: m.grammar_from_lark(lark), "grammar")


def _wrapped(tokenizer, eos_ids: set[int]):
    llg = _llguidance()
    with _LOCK:
        key = id(tokenizer)
        if key not in _TOKENIZERS:
            _TOKENIZERS[key] = llg.hf.from_tokenizer(tokenizer, eos_token=sorted(eos_ids) or None)
        return _TOKENIZERS[key]


class Constraint:
    """One sequence's matcher: `allow(logits)` masks what the grammar forbids now, `consume(token)` advances it."""

    def __init__(self, grammar: str, tokenizer, eos_ids: set[int]):
        llg = _llguidance()
        self.tokenizer = _wrapped(tokenizer, eos_ids)
        self.matcher = llg.LLMatcher(self.tokenizer, grammar)
        if self.matcher.is_error():
            raise InvalidRequestError(f"the grammar cannot be used: {self.matcher.get_error()}")
        self.vocab = self.tokenizer.vocab_size
        self.eos = sorted(eos_ids)
        self.bitmask = llg.numpy.allocate_token_bitmask(1, self.vocab)
        self._fill = llg.numpy.fill_next_token_bitmask

    def allow(self, logits: torch.Tensor) -> torch.Tensor | None:
        """`logits` with every token the grammar does not allow next at -inf; None when it allows none."""
        if self.matcher.is_error():
            return None
        self._fill(self.matcher, self.bitmask, 0)
        bits = np.unpackbits(self.bitmask[0].view(np.uint8), bitorder="little")[:self.vocab]
        allowed = torch.from_numpy(bits.astype(bool))
        if not self.accepting:  # llguidance offers EOS at a dead end: ending there would be invalid JSON with "stop"
            allowed[[t for t in self.eos if t < self.vocab]] = False
        n = min(self.vocab, logits.shape[-1])
        if not bool(allowed[:n].any()):
            return None
        out = torch.full_like(logits, float("-inf"))
        keep = allowed[:n].to(logits.device)
        out[:n] = torch.where(keep, logits[:n], out[:n])
        return out

    def consume(self, token: int) -> None:
        self.matcher.consume_token(token)

    @property
    def accepting(self) -> bool:
        """The text so far is a complete answer of the grammar: only here may an end-of-sequence token end it."""
        return self.matcher.is_accepting()

    @property
    def done(self) -> bool:
        """The grammar is complete and admits no further token: the answer ends here."""
        return self.matcher.is_stopped()
