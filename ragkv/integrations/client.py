"""The HTTP calls every integration makes to `ragkv serve`: chat (whole or streamed) with documents as ragkv
blocks, and retrieval from the server's document library. Framework-free: plain dicts in, `Reply` out."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterator

import httpx


class RagkvServerError(RuntimeError):
    """The server refused or failed a request; `status` and `param` come from its OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(f"ragkv server answered {status}: {message}" + (f" (field {param})" if param else ""))
        self.status, self.param = status, param


@dataclass
class Reply:
    """A finished answer: its text plus what the server says about the prompt's blocks."""
    text: str
    finish_reason: str | None = None
    model: str | None = None
    usage: dict = field(default_factory=dict)    # OpenAI usage plus reused_tokens, recomputed_tokens, ...
    stats: dict = field(default_factory=dict)    # ragkv.stats: mode, cache_hits, cache_misses, ttft_ms, ...
    sources: list = field(default_factory=list)  # ragkv.sources: one entry per block, in prompt order
    tool_calls: list = field(default_factory=list)  # OpenAI's message.tool_calls (a request offered tools)

    @property
    def cached_tokens(self) -> int:
        """The server's `prompt_tokens_details.cached_tokens`: prompt tokens whose KV it did not prefill with the
        question (block tokens read from the store or encoded apart; `stats` tells hits from misses)."""
        details = self.usage.get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens", self.usage.get("reused_tokens")) or 0)


def document(text: str, title: str | None = None, doc_id: str | None = None) -> dict:
    """One entry of `ragkv.documents`; the title is part of the block, so the same title finds the same KV."""
    out: dict = {"text": text}
    if title:
        out["title"] = str(title)
    if doc_id:
        out["id"] = str(doc_id)
    return out


@dataclass
class RagkvClient:
    base_url: str = "http://127.0.0.1:8000"
    api_key: str | None = None
    timeout: float = 300.0

    def _url(self, path: str) -> str:
        return self.base_url.rstrip("/") + path

    def _headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @staticmethod
    def chat_body(messages: list[dict], documents: list[dict] | None = None, *, model: str | None = None,
                  max_tokens: int | None = None, temperature: float | None = None, stop: list[str] | None = None,
                  mode: str | None = None, options: dict | None = None, stream: bool = False,
                  tools: list[dict] | None = None, tool_choice=None) -> dict:
        """An OpenAI chat request whose documents go under `ragkv.documents`, fused by `mode`; `options` are other
        ragkv fields (ratio, namespace, ...). No documents: a plain chat (the server's prefix cache; `mode` unused)."""
        body: dict = {"messages": messages, "stream": stream}
        for key, value in (("model", model), ("max_tokens", max_tokens), ("temperature", temperature),
                           ("stop", stop), ("tools", tools), ("tool_choice", tool_choice)):
            if value is not None:
                body[key] = value
        extras = {k: v for k, v in (options or {}).items() if v is not None}
        if documents:
            extras["documents"] = documents
            if mode is not None:
                extras["mode"] = mode
        if extras:
            body["ragkv"] = extras
        if stream:
            body["stream_options"] = {"include_usage": True}  # the usage (reused tokens) comes last
        return body

    def chat(self, body: dict) -> Reply:
        r = httpx.post(self._url("/v1/chat/completions"), json={**body, "stream": False}, headers=self._headers(),
                       timeout=self.timeout)
        data = _ok(r)
        choice = data["choices"][0]
        extra = data.get("ragkv") or {}
        return Reply(choice["message"].get("content") or "", choice.get("finish_reason"), data.get("model"),
                     data.get("usage") or {}, extra.get("stats") or {}, extra.get("sources") or [],
                     choice["message"].get("tool_calls") or [])

    def stream_chat(self, body: dict) -> Iterator[str | Reply]:
        """Yields each text delta as it is decoded, then one `Reply` (its text the whole answer)."""
        reply, parts, done = Reply(""), [], False
        with httpx.stream("POST", self._url("/v1/chat/completions"), json={**body, "stream": True},
                          headers=self._headers(), timeout=self.timeout) as r:
            if r.status_code != 200:
                r.read()
                _ok(r)
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: "):]
                if payload == "[DONE]":
                    done = True
                    break
                event = json.loads(payload)
                if "error" in event:  # a failure after the first token arrives as an event, not a status
                    err = event["error"]
                    raise RagkvServerError(500, err.get("message", "stream failed"))
                reply.model = event.get("model", reply.model)
                if event.get("usage"):
                    reply.usage = event["usage"]
                if "ragkv" in event:
                    reply.stats, reply.sources = event["ragkv"].get("stats") or {}, event["ragkv"].get("sources") or []
                for choice in event.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        parts.append(text)
                        yield text
                    reply.finish_reason = choice.get("finish_reason") or reply.finish_reason
        if not done:
            raise RagkvServerError(502, "the server closed the stream before its end ([DONE])")
        reply.text = "".join(parts)
        yield reply

    def retrieve(self, query: str, top_k: int = 5) -> list[dict]:
        """The library's `top_k` chunks for `query`, best first: text, title, doc_id, chunk_id, score."""
        r = httpx.post(self._url("/v1/retrieve"), json={"query": query, "top_k": top_k}, headers=self._headers(),
                       timeout=self.timeout)
        return _ok(r)["data"]


def _ok(r: httpx.Response) -> dict:
    """The JSON body of a 2xx answer; any other status raises with the server's own message."""
    try:
        data = r.json()
    except ValueError:
        data = None
    if r.is_success and isinstance(data, dict):
        return data
    err = (data or {}).get("error") if isinstance(data, dict) else None
    if isinstance(err, dict):
        raise RagkvServerError(r.status_code, err.get("message") or r.reason_phrase, err.get("param"))
    raise RagkvServerError(r.status_code, (r.text or r.reason_phrase)[:500])
