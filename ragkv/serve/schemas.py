"""Request bodies of the OpenAI-compatible API, plus ragkv's per-request extras (`"ragkv": {...}`)."""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore")


class DocumentIn(_Loose):
    text: str
    title: str | None = None
    id: str | None = None


class Retrieval(_Loose):
    top_k: int = Field(5, ge=1, le=50)


class RagkvExtras(_Loose):
    # FusionOptions' fields (ragkv.engine.options): unset ones take the server's defaults
    mode: str | None = None
    ratio: float | None = None
    auto_ratio: bool | None = None
    check_layers: list[int] | None = None
    deviation: str | None = None
    gradual: bool | None = None
    sink_tokens: int | None = Field(None, ge=0)
    ape_temperature: float | None = None
    ape_scale: float | None = None
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
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    n: int = Field(1, ge=1, le=1)
    ragkv: RagkvExtras | None = None

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatRequest(_Sampling):
    messages: list[Message] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str]]


class DocumentsRequest(_Loose):
    documents: list[DocumentIn] = Field(..., min_length=1)
