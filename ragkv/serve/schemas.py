"""Request bodies of the OpenAI-compatible API, plus ragkv's per-request extras (`"ragkv": {...}`)."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field


MAX_TOKENS = 1 << 20     # any larger max_tokens is refused before the model's own limit is even looked at
SEED_MAX = (1 << 63) - 1
DOC_ID = r"^[^\x00-\x1f\x7f]{1,256}$"  # printable, at most 256 characters ("/" round-trips through the path)

# OpenAI fields this server does not implement: refused (400 naming them) unless given their no-op value
UNSUPPORTED = {"tools": None, "tool_choice": None, "functions": None, "function_call": None,
               "parallel_tool_calls": None, "response_format": None, "logprobs": (False, 0), "top_logprobs": (0,),
               "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
               "logit_bias": ({},), "echo": (False,), "best_of": (1,), "suffix": None, "top_k": (-1, 0),
               "min_p": (0, 0.0), "guided_json": None, "audio": None, "modalities": None, "prediction": None}


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class DocumentIn(_Strict):
    text: str
    title: str | None = Field(None, max_length=1024)
    id: str | None = Field(None, pattern=DOC_ID)


class Retrieval(_Strict):
    top_k: int = Field(5, ge=1, le=50)


class RagkvExtras(_Strict):
    # FusionOptions' fields (ragkv.engine.options): unset ones take the server's defaults
    mode: str | None = None
    ratio: float | None = None
    auto_ratio: bool | None = None
    check_layers: list[int] | None = Field(None, min_length=1, max_length=64)
    deviation: str | None = None
    gradual: bool | None = None
    sink_tokens: int | None = Field(None, ge=0, le=1 << 20)
    ape_temperature: float | None = Field(None, gt=0, le=100)
    ape_scale: float | None = Field(None, gt=0, le=100)
    documents: list[Union[str, DocumentIn]] | None = None  # inline passages, used as they are
    retrieval: Retrieval | None = None  # retrieve top_k chunks from the ingested documents
    namespace: str | None = None

    def fusion_fields(self) -> dict:
        fields = ("mode", "ratio", "auto_ratio", "check_layers", "deviation", "gradual", "sink_tokens",
                  "ape_temperature", "ape_scale")
        out = {f: getattr(self, f) for f in fields if getattr(self, f) is not None}
        if "check_layers" in out:
            out["check_layers"] = tuple(out["check_layers"])
        return out


class TextPart(_Loose):
    type: Literal["text"] = "text"
    text: str


class Message(_Loose):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class StreamOptions(_Loose):
    include_usage: bool = False


class _Sampling(_Loose):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    stop: Union[str, Annotated[list[str], Field(max_length=16)], None] = None
    n: int = Field(1, ge=1, le=1)
    user: str | None = None
    ragkv: RagkvExtras | None = None

    @classmethod
    def unsupported(cls, data: dict) -> list[str]:
        """Fields of the OpenAI API given with a value this server would have to act on but cannot."""
        return [k for k, noop in UNSUPPORTED.items() if k in data and data[k] is not None
                and (noop is None or data[k] not in noop)]

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatRequest(_Sampling):
    messages: list[Message] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS)


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str]]


class DocumentsRequest(_Strict):
    documents: list[DocumentIn] = Field(..., min_length=1)
    wait: bool = True  # false: answer 202 with the ingestion job at once
