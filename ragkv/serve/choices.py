"""OpenAI response pieces from sequences: the choices of a finished request, the chunks of a streamed one, and
log-probabilities in both formats: chat's `logprobs.content[]` (token, logprob, bytes, top_logprobs) and the legacy
completions' `tokens` / `token_logprobs` / `top_logprobs` / `text_offset`.

A token's text is the token decoded alone, as vLLM shows it (a token holding part of a UTF-8 character shows as
U+FFFD), and its bytes are that text's UTF-8."""

from __future__ import annotations

from ragkv.engine.decode.sampling import TokenLogprob
from ragkv.serve.tools import ToolCallError, parse_calls


class TokenText:
    """Token id -> its text; memoized, for the top tokens repeat across steps."""

    def __init__(self, tokenizer):
        self.tokenizer, self.cache = tokenizer, {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id])
        return text


def chat_logprobs(entries: list[TokenLogprob], text: TokenText) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        s = text(token_id)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}


def legacy_logprobs(entries: list[TokenLogprob], text: TokenText, offset: int = 0) -> dict:
    """`offset`: characters of the completion before these tokens (text_offset counts from the completion's start).
    Each top_logprobs entry holds the k most likely tokens and the chosen one, as OpenAI's legacy API."""
    tokens, offsets = [], []
    for e in entries:
        s = text(e.token_id)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{**{text(t): lp for t, lp in e.top}, text(e.token_id): e.logprob} for e in entries],
            "text_offset": offsets}


def finish_reason(reason: str) -> str:
    """A generation the server's deadline (--timeout) ended keeps its text and finishes "length", as llama-server's
    time limit does; the response's `ragkv.stopped` says "deadline"."""
    return "length" if reason == "timeout" else reason


def final_choice(index: int, seq, chat: bool, text: TokenText, logprobs: bool) -> dict:
    out = seq.out
    lp = None
    if logprobs:
        lp = chat_logprobs(out.logprobs, text) if chat else legacy_logprobs(out.logprobs, text)
    if chat:
        return {"index": index, "message": {"role": "assistant", "content": out.text}, "logprobs": lp,
                "finish_reason": finish_reason(out.finish_reason)}
    return {"index": index, "text": out.text, "logprobs": lp, "finish_reason": finish_reason(out.finish_reason)}


def answer_calls(text: str, names: tuple[str, ...], reason: str, required: bool) -> tuple[str | None, list[dict]]:
    """`parse_calls` over an answer offered the functions `names`. `required` (tool_choice required or named): an
    answer that ended for any reason but its length and holds text besides calls is a ToolCallError, never text."""
    content, calls = parse_calls(text, set(names))
    if required and finish_reason(reason) != "length" and (not calls or content):
        what = "text besides its calls" if calls else "no call that parses as a JSON call object"
        raise ToolCallError(f"tool_choice asked for a function call, but the answer (finish reason {reason!r}) holds "
                            f"{what}: {text[:200]!r}; send the request again")
    return content, calls


def with_tool_calls(choice: dict, names: tuple[str, ...], required: bool = False) -> dict:
    """A chat choice of a request offered the functions `names`: its calls as `message.tool_calls` (the text
    outside them stays the content, null when none) and finish_reason "tool_calls" when it called any."""
    content, calls = answer_calls(choice["message"]["content"], names, choice["finish_reason"], required)
    if not calls:
        return choice
    return {**choice, "message": {"role": "assistant", "content": content, "tool_calls": calls},
            "finish_reason": "tool_calls"}


class Chunks:
    """The chunks of one streamed response, choice by choice (legacy text offsets are kept per choice)."""

    def __init__(self, rid: str, created: int, model: str, chat: bool, text: TokenText, logprobs: bool):
        self.rid, self.created, self.model, self.chat = rid, created, model, chat
        self.text, self.logprobs = text, logprobs
        self.offsets: dict[int, int] = {}

    def envelope(self, choices: list[dict]) -> dict:
        return {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}

    def role(self, index: int) -> dict:
        return self.envelope([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None}])

    def delta(self, index: int, delta) -> dict:
        lp = None
        if self.logprobs:
            if self.chat:
                lp = chat_logprobs(delta.logprobs, self.text)
            else:
                lp = legacy_logprobs(delta.logprobs, self.text, self.offsets.get(index, 0))
                self.offsets[index] = self.offsets.get(index, 0) + sum(len(t) for t in lp["tokens"])
        if self.chat:
            return self.envelope([{"index": index, "delta": {"content": delta.text}, "logprobs": lp,
                                   "finish_reason": None}])
        return self.envelope([{"index": index, "text": delta.text, "logprobs": lp, "finish_reason": None}])

    def tool_deltas(self, index: int, text: str, names: tuple[str, ...], reason: str = "stop",
                    required: bool = False) -> tuple[list[dict], bool]:
        """The chunks of a tools answer, sent whole when it is done (its text is only known to be calls then): the
        content outside the call blocks, then each call as OpenAI's `delta.tool_calls[]`; and whether it called.
        Raises ToolCallError as `answer_calls` does."""
        content, calls = answer_calls(text, names, reason, required)
        out = []
        if content:
            out.append(self.envelope([{"index": index, "delta": {"content": content}, "logprobs": None,
                                       "finish_reason": None}]))
        if calls:
            out.append(self.envelope([{"index": index, "delta": {"tool_calls": [{"index": j, **c}
                                                                                for j, c in enumerate(calls)]},
                                       "logprobs": None, "finish_reason": None}]))
        return out, bool(calls)

    def finish(self, index: int, reason: str) -> dict:
        reason = finish_reason(reason)
        if self.chat:
            return self.envelope([{"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}])
        return self.envelope([{"index": index, "text": "", "logprobs": None, "finish_reason": reason}])
