"""Request bodies of the OpenAI-compatible API, plus ragkv's per-request extras (`"ragkv": {...}`)."""

from __future__ import annotations

import json
import unicodedata
from typing import Annotated, Literal, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from ragkv.engine.options import OptionSpec, fusion_option_specs
from ragkv.errors import InvalidRequestError
from ragkv.rag.order import PASSAGE_ORDERS
from ragkv.settings import DEFAULT_PASSAGE_ORDER

MAX_TOKENS = 1 << 20     # any larger max_tokens is refused before the model's own limit is even looked at
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1  # OpenAI takes any integer: a signed 64-bit one here
DOC_ID = r"^[^\x00-\x1f\x7f]{1,256}$"  # printable, at most 256 characters ("/" round-trips through the path)
MAX_LOGPROBS = 20  # top log-probabilities per token, as OpenAI and vLLM's default
MAX_N = 128        # choices per request (the server also keeps n within --max-batch)
MAX_PROMPTS = 64   # prompts in one /v1/completions request (each is queued as its own generation)
# messages in one chat request: cutting a chat into blocks renders the template once per message over the
# conversation so far (quadratic: 1,000 messages took 84 s); more is refused before any rendering
MAX_MESSAGES = 256
# characters an id must not contain: controls, format characters (zero-width space U+200B, joiners, bidi overrides,
# the BOM) and line/paragraph separators; invisible, they would make two ids that look the same differ
INVISIBLE_CATEGORIES = ("Cc", "Cf", "Zl", "Zp")

# OpenAI fields this server does not implement: refused (400 naming them) unless given their no-op value
UNSUPPORTED = {"functions": None, "function_call": None, "logit_bias": ({},), "echo": (False,), "best_of": (1,), "suffix": None,
               "guided_json": None, "audio": None, "modalities": None, "prediction": None}


class FieldError(InvalidRequestError):
    """A request field that is well-formed but cannot be served; `param` names it in the 400, `code` (if any) says
    why in OpenAI's terms (`context_length_exceeded`, `too_many_documents`, ...)."""

    def __init__(self, param: str, message: str, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def _kind(annotation) -> str:
    text = str(annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")
    return "a number" if ("int" in text or "float" in text) and "str" not in text else text


def _no_bool_as_number(cls, value, info):
    """JSON's true/false are not numbers: pydantic would read `"ratio": true` as 1.0. Refused for every field
    whose type has no bool in it (the error names the field)."""
    field = cls.model_fields.get(info.field_name)
    if isinstance(value, bool) and field is not None and "bool" not in str(field.annotation):
        raise ValueError(f"{str(value).lower()} is a boolean; this field takes {_kind(field.annotation)}")
    return value


def _only_bool_as_bool(cls, value, info):
    """A boolean field takes JSON's true/false only, as OpenAI's API: pydantic would read "yes", "off" or 1 as one."""
    field = cls.model_fields.get(info.field_name)
    if field is None or value is None or isinstance(value, bool):
        return value
    if {a for a in (get_args(field.annotation) or (field.annotation,)) if a is not type(None)} == {bool}:
        raise ValueError(f"{json.dumps(value)[:40]} is not a boolean; this field takes true or false")
    return value


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    _booleans = field_validator("*", mode="before")(classmethod(_no_bool_as_number))
    _bools = field_validator("*", mode="before")(classmethod(_only_bool_as_bool))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    _booleans = field_validator("*", mode="before")(classmethod(_no_bool_as_number))
    _bools = field_validator("*", mode="before")(classmethod(_only_bool_as_bool))


def document_id(value: str) -> str:
    """A document id as the library keeps it: NFC (so `café` typed either way is one document), with no invisible
    character (refused, naming it: an id a user cannot see cannot be trusted)."""
    value = unicodedata.normalize("NFC", value)
    if not value.strip():  # spaces only (U+00A0 and U+3000 included): nothing a user could tell apart
        raise ValueError(f"the id {value!r} is only space characters; send an id with a visible character")
    for i, ch in enumerate(value):
        if unicodedata.category(ch) in INVISIBLE_CATEGORIES:
            name = unicodedata.name(ch, "a control character")
            raise ValueError(f"the id {value!r} contains U+{ord(ch):04X} {name} at position {i}, an invisible "
                             "character; send the id without it")
    return value


class DocumentIn(_Strict):
    text: str
    title: str | None = Field(None, max_length=1024)
    id: str | None = Field(None, pattern=DOC_ID)

    @field_validator("id")
    @classmethod
    def _visible_nfc(cls, v: str | None) -> str | None:
        return None if v is None else document_id(v)


class Retrieval(_Strict):
    top_k: int = Field(5, ge=1, le=50)
    # the retrieved chunks in the prompt: best-last (ascending relevance, Block-Attention 3.2), best-first, as-given
    order: Literal[PASSAGE_ORDERS] = DEFAULT_PASSAGE_ORDER  # type: ignore[valid-type]


def _fusion_field(spec: OptionSpec):
    """A FusionOptions field as an optional request field (None: the server's default), bounds from its declaration
    (choices and cross-field rules are checked by FusionOptions itself, naming the field)."""
    kind = list[int] if spec.type is tuple else spec.type
    bounds = {k: getattr(spec, k) for k in ("ge", "le", "gt") if getattr(spec, k) is not None}
    if spec.type is tuple:  # bounds apply to each item
        kind = list[Annotated[int, Field(**bounds)]]
        bounds = {"min_length": 1, **({"max_length": spec.max_items} if spec.max_items else {})}
    return (kind | None, Field(None, description=spec.help, **bounds))


# FusionOptions' fields (ragkv.engine.options), each derived from its one declaration
_FusionFields = create_model("_FusionFields", __base__=_Strict,
                             **{spec.name: _fusion_field(spec) for spec in fusion_option_specs()})


class RagkvExtras(_FusionFields):
    """ragkv's per-request extras: FusionOptions' fields (unset ones take the server's defaults) and the context."""
    documents: list[Union[str, DocumentIn]] | None = None  # inline passages, used as they are
    retrieval: Retrieval | None = None  # retrieve top_k chunks from the ingested documents
    namespace: str | None = Field(None, min_length=1, max_length=256)  # "" is not a name (leave it out: the tenant's)

    def fusion_fields(self) -> dict:
        out = {f: getattr(self, f) for f in _FusionFields.model_fields if getattr(self, f) is not None}
        return {f: tuple(v) if isinstance(v, list) else v for f, v in out.items()}  # the tuple-typed fields


class TextPart(_Loose):
    type: Literal["text"] = "text"
    text: str


class CalledFunction(_Loose):
    name: str = Field(..., min_length=1, max_length=64)
    arguments: Union[str, dict] = "{}"  # OpenAI sends a JSON string; an object is taken too


class ToolCallIn(_Loose):
    """A call an earlier assistant turn made (sent back by the client with the conversation)."""
    id: str | None = Field(None, max_length=128)
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(_Loose):
    role: Literal["system", "developer", "user", "assistant", "tool"]  # a tool's output is a block like any turn
    content: Union[str, list[TextPart], None] = None
    tool_calls: list[ToolCallIn] | None = Field(None, max_length=64)
    tool_call_id: str | None = Field(None, max_length=128)

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ToolFunction(_Loose):
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = Field(None, max_length=8192)
    parameters: dict | None = None  # a JSON schema of the arguments (none: any object)
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, v: dict | None) -> dict | None:
        # OpenAI's rule: a call's arguments are an object, so their schema must say so (or say no type)
        if v is not None and v.get("type", "object") != "object":
            raise ValueError(f"a function's parameters must be the JSON schema of an object (type \"object\"), "
                             f"not of type {json.dumps(v['type'])}")
        return v


class Tool(_Loose):
    type: Literal["function"]
    function: ToolFunction


class ChosenFunction(_Loose):
    name: str = Field(..., min_length=1, max_length=64)


class NamedToolChoice(_Loose):
    type: Literal["function"]
    function: ChosenFunction


class StreamOptions(_Loose):
    include_usage: bool = False


class JsonSchemaFormat(_Loose):
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")  # required, as OpenAI's
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Loose):
    """OpenAI's: free text, any JSON object, or JSON following `json_schema.schema` (strict or not: the output
    follows the schema either way, by constrained decoding: engine/decode/constrained.py)."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise FieldError("response_format.json_schema", 'type "json_schema" needs json_schema.schema, a JSON '
                                                            'schema object')
        return self

    def grammar(self) -> str | None:
        """llguidance's grammar for this format (None: free text); an unusable schema is a 400 naming it."""
        if self.type == "text":
            return None
        from ragkv.engine.decode.constrained import json_grammar
        from ragkv.errors import InvalidRequestError

        schema = self.json_schema.schema_ if self.type == "json_schema" else None
        try:
            return json_grammar(schema)
        except InvalidRequestError as e:
            raise FieldError("response_format.json_schema.schema" if schema is not None else "response_format",
                             str(e), "invalid_response_format") from None


class _Sampling(_Loose):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None   # -1 or 0: off (vLLM's convention)
    min_p: float | None = Field(None, ge=0, le=1)
    min_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS)  # vLLM's: no end before this many tokens
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=100)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: Union[str, Annotated[list[str], Field(max_length=16)], None] = None
    n: int = Field(1, ge=1, le=MAX_N)
    response_format: ResponseFormat | None = None
    user: str | None = None
    # vLLM's top-level RAG documents: the same as ragkv.documents (giving both is a 400)
    documents: list[Union[str, DocumentIn]] | None = None
    # isolates the request's KV: requests share cached blocks only with requests of the same salt
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    ragkv: RagkvExtras | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        if v is not None and v < -1:
            raise ValueError("top_k must be -1 or 0 (off) or a positive number of tokens")
        return v

    @model_validator(mode="after")
    def _one_documents(self):
        if self.documents is not None and self.ragkv is not None and self.ragkv.documents is not None:
            raise FieldError("documents", "documents are given twice, at the top level and in ragkv.documents; "
                                          "send them in one place")
        return self

    def inline_documents(self) -> tuple[list, str]:
        """The request's inline documents and the field they came in."""
        if self.documents is not None:
            return self.documents, "documents"
        return (self.ragkv.documents if self.ragkv is not None else None) or [], "ragkv.documents"

    def logprobs_count(self) -> int | None:
        """None: no log-probabilities; k: each token's and the k most likely (endpoints set this)."""
        return None

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
    messages: list[Message] = Field(..., min_length=1, json_schema_extra={"maxItems": MAX_MESSAGES})
    max_completion_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _few_enough_messages(cls, v):
        # counted before each message is validated: 10,000 messages are refused at once, in our words
        if isinstance(v, list) and len(v) > MAX_MESSAGES:
            raise ValueError(f"{len(v)} messages; a request may hold at most {MAX_MESSAGES}: send the latest turns "
                             "(earlier ones summarized) or documents instead")
        return v

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self):
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise FieldError("tool_choice", "tool_choice needs `tools`: send the functions the model may call")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools]
            if self.tool_choice.function.name not in names:
                raise FieldError("tool_choice", f"tool_choice names {self.tool_choice.function.name!r}, which is not "
                                                f"among the tools ({', '.join(names)})", "unknown_tool")
        return self

    @model_validator(mode="after")
    def _unique_tool_names(self):
        seen: dict[str, int] = {}
        for j, t in enumerate(self.tools or []):
            i = seen.setdefault(t.function.name, j)
            if i != j:
                raise FieldError(f"tools[{j}].function.name", f"tools[{i}] and tools[{j}] are both named "
                                                              f"{t.function.name!r}; give each function its own name")
        return self

    @model_validator(mode="after")
    def _tool_results_answer_calls(self):
        """As OpenAI's API: a `tool` message answers, by its `tool_call_id`, a call an earlier assistant message
        made (its `tool_calls`)."""
        called, ids = False, set()
        for i, m in enumerate(self.messages):
            if m.role == "assistant" and m.tool_calls:
                called = True
                ids.update(c.id for c in m.tool_calls if c.id is not None)
            elif m.role == "tool" and not called:
                raise FieldError(f"messages[{i}]", f"messages[{i}] is a tool's result, but no earlier assistant "
                                                   "message made a tool call; send the assistant message with its "
                                                   "tool_calls before it")
            elif m.role == "tool" and m.tool_call_id not in ids:
                said = "has no tool_call_id" if m.tool_call_id is None else f"answers {m.tool_call_id!r}"
                raise FieldError(f"messages[{i}].tool_call_id",
                                 f"messages[{i}] {said}, which is not the id of a call an earlier assistant message "
                                 f"made ({', '.join(map(repr, sorted(ids))) or 'none had an id'})")
        return self

    def calls_tools(self) -> bool:
        """Whether the model is offered the tools (given, and tool_choice is not "none")."""
        return bool(self.tools) and self.tool_choice != "none"

    def tool_dicts(self) -> list[dict]:
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
        return self

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


PROMPT_FORMS = "a string, a list of strings, a list of token ids, or a list of lists of token ids"


class CompletionRequest(_Sampling):
    # one prompt or several (one choice each, `n` per prompt), as text or as token ids
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # the legacy API: the number of top tokens

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_form(cls, v):
        """One clear message for every shape the API does not define (pydantic's union errors name none of them)."""
        def ids(x) -> bool:
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
        ok = isinstance(v, str) or (isinstance(v, list) and (all(isinstance(p, str) for p in v) or ids(v)
                                                             or all(ids(p) for p in v)))
        if not ok:
            raise ValueError(f"prompt must be {PROMPT_FORMS}")
        if isinstance(v, list) and len(v) > MAX_PROMPTS and not ids(v):
            raise ValueError(f"{len(v)} prompts in one request; the limit is {MAX_PROMPTS}: split them")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and all(isinstance(t, int) for t in p)):
            return [p]
        return list(p)

    def logprobs_count(self) -> int | None:
        return self.logprobs


class TokenizeRequest(_Loose):
    """vLLM's POST /tokenize: a `prompt` (as /v1/completions reads it) or chat `messages` (as /v1/chat/completions
    without documents renders them)."""
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    add_special_tokens: bool = False  # False: exactly the ids this server feeds the model
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise FieldError("prompt", "send either `prompt` (a string) or chat `messages`")
        return self


class DetokenizeRequest(_Loose):
    model: str | None = None
    tokens: list[int] = Field(..., max_length=MAX_TOKENS)


class EmbeddingsRequest(_Loose):
    model: str | None = None
    input: Union[str, Annotated[list[str], Field(min_length=1, max_length=2048)], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None


class DocumentsRequest(_Strict):
    documents: list[DocumentIn] = Field(..., min_length=1)
    wait: bool = True  # false: answer 202 with the ingestion job at once
