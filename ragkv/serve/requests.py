"""An HTTP request body -> what the engine runs (`Prepared`): the tenant's KV namespace, inline and retrieved
documents, fusion and generation options, the prompt's segments, the number of choices. Every refusal is a domain
error (FieldError naming the field, NamespaceForbidden); the routers turn them into HTTP answers.

This runs on the request handler's worker thread, never on the model thread: retrieval (the embedder, the index)
and tokenization do not hold the engine lock, so a slow retrieval stalls no running answer. The tokenizer is a
Hugging Face fast tokenizer, whose encode and decode may run on several threads at once (Server warms it once at
start, so no thread changes its truncation or padding settings later)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Callable

from ragkv.engine.decode.constrained import check_finite, lark_grammar
from ragkv.engine.modes import get_mode, mode_names
from ragkv.engine.options import FusionOptions, GenerationOptions, validate_fusion
from ragkv.engine.request.segments import Passage, Segments
from ragkv.serve.tools import call_grammar, render_calls, render_result, tag_tokens, tools_system
from ragkv.errors import InvalidRequestError, OptionError, RagkvError
from ragkv.rag.order import order_passages
from ragkv.serve.budget import TenantBudget, check_cost
from ragkv.serve.schemas import ChatRequest, CompletionRequest, FieldError, NamedToolChoice, RagkvExtras
from ragkv.settings import DEFAULT_TENANT, SERVE


class NamespaceForbidden(RagkvError):
    """A request naming another tenant's KV namespace (a 403)."""

    param, code = "ragkv.namespace", "namespace_forbidden"


@dataclass
class Prepared:
    segs: Segments
    fusion: FusionOptions
    gen: GenerationOptions
    namespace: str | None
    sources: list[dict]
    n: int = 1  # choices: one prefill, n sequences decoding in the batch
    tenant: str = DEFAULT_TENANT  # whose turn its prefill takes (the scheduler serves tenants round-robin)
    tools: tuple[str, ...] = ()  # the functions offered: its answers are parsed for calls to them (serve/tools.py)
    calls_required: bool = False  # tool_choice required or named: an answer without a call is an error
    cost: int = 0  # its prefill's token-layers at most (cold cache, its mode's worst case: check_prompt)


def salted_namespace(namespace: str, salt: str) -> str:
    """The namespace of a `cache_salt`: requests share cached KV only with the same salt (and tenant). The hash
    covers the whole namespace and salt; the readable front keeps the name within the store's 64 characters."""
    digest = hashlib.sha256(f"{namespace}\0{salt}".encode()).hexdigest()[:16]
    return f"{namespace[:40]}.salt-{digest}"


def request_namespace(keys, extras: RagkvExtras | None, tenant: str, cache_salt: str | None,
                      default: str) -> str | None:
    """The KV namespace of a request: its tenant's when keys are configured (naming another is refused), made its
    own by a `cache_salt`; None means the engine's (`default`)."""
    asked = extras.namespace if extras is not None else None
    if not keys:
        ns = asked if asked is not None else (None if tenant == DEFAULT_TENANT else tenant)
    elif asked is not None and asked != tenant:
        raise NamespaceForbidden(f"namespace {asked!r} belongs to another tenant; this key's is {tenant!r}")
    else:
        ns = tenant
    return ns if cache_salt is None else salted_namespace(ns or default, cache_salt)


def as_passage(doc) -> Passage:
    """An inline document (a string, or an object with text and title) as a passage."""
    return Passage(doc) if isinstance(doc, str) else Passage(doc.text, doc.title or "")


def chat_turns(req: ChatRequest) -> tuple[str | None, list[dict], str]:
    """A chat's system message (with the tools' definitions, as Qwen2.5's template writes them: serve/tools.py),
    its turns as the template renders them, and the last turn's own text (what retrieval searches for)."""
    msgs = req.messages
    system = next((m.text() for m in msgs if m.role in ("system", "developer")), None)
    turns = [m for m in msgs if m.role in ("user", "assistant", "tool")]
    # the definitions stay in the prompt with tool_choice "none" (as vLLM does): an agent's last step, which may only
    # answer, then starts as its earlier steps did and finds them cached
    tools = bool(req.tools)
    last = ("user", "tool") if tools else ("user",)  # an agent's next step follows a tool's result
    if not turns or turns[-1].role not in last:
        raise FieldError("messages", "the last message must come from the user" + (" or a tool" if tools else ""))
    if tools:
        system = tools_system(system, req.tool_dicts())
    return system, [render_message(m, tools) for m in turns], turns[-1].text()


def render_message(m, tools: bool) -> dict:
    """A message as the text turn the template renders: with tools, earlier calls as call blocks and a tool's
    result as a user turn in <tool_response> (as Qwen2.5's template does); without, as sent."""
    content = m.text()
    if not tools:
        return {"role": m.role, "content": content}
    if m.role == "assistant" and m.tool_calls:
        calls = render_calls([c.model_dump() for c in m.tool_calls])
        return {"role": "assistant", "content": f"{content}\n{calls}" if content else calls}
    if m.role == "tool":
        return {"role": "user", "content": render_result(content)}
    return {"role": m.role, "content": content}


class RequestBuilder:
    """Builds `Prepared` requests against one engine, with the server's keys, limits and fusion defaults;
    `library(tenant)` gives a tenant's document library (retrieval)."""

    def __init__(self, engine, keys, limits, default_fusion: FusionOptions, max_batch: int,
                 library: Callable[[str], object], history_mode: str = SERVE.history_mode,
                 budget: TenantBudget | None = None, documents_fusion: FusionOptions | None = None):
        self.engine, self.keys, self.limits = engine, keys, limits
        self.budget = budget if budget is not None else TenantBudget(None)
        # token-layers one request's prefill may cost (0: no limit)
        limit = getattr(limits, "max_request_cost", None)
        if limit is None:
            limit = int(SERVE.max_request_windows * engine.max_positions * engine.num_layers)
        self.max_request_cost = limit or None
        self.default_fusion = default_fusion  # the server's flags; a request's own `ragkv` fields override them
        # a request with documents that names no mode: --mode's key (its own parameters too)
        self.documents_fusion = documents_fusion if documents_fusion is not None else default_fusion
        self.max_batch, self.library = max_batch, library
        self.history_mode = history_mode  # a chat's turns as blocks, when the request names no mode

    def namespace(self, extras: RagkvExtras | None, tenant: str, cache_salt: str | None = None) -> str | None:
        """The KV namespace of a request (None: the engine's); `request_namespace`."""
        return request_namespace(self.keys, extras, tenant, cache_salt, self.engine.namespace)

    def passages(self, req, question: str, tenant: str = DEFAULT_TENANT) -> tuple[list[Passage], list[dict]]:
        """Inline documents (top-level `documents` or `ragkv.documents`) in the caller's order, then retrieved ones in
        `retrieval.order` (default best-last: the most relevant next to the question)."""
        extras = req.ragkv
        passages, sources = [], []
        docs, field = req.inline_documents()
        # an empty passage is refused as ingestion refuses an empty document: it can only be a client's mistake
        self.check_documents(len(docs), [d if isinstance(d, str) else d.text for d in docs], field,
                             [None if isinstance(d, str) else d.id for d in docs], need_text=True,
                             plain=[isinstance(d, str) for d in docs])
        for d in docs:
            p = as_passage(d)
            passages.append(p)
            sources.append({"title": p.title, "source": "inline"})
        if extras is not None and extras.retrieval is not None:
            found = self.library(tenant).retrieve(question, extras.retrieval.top_k)  # best first
            for r in order_passages(found, extras.retrieval.order):
                passages.append(r.passage)
                sources.append({"title": r.passage.title, "chunk_id": r.chunk_id, "doc_id": r.doc_id,
                                "score": round(r.score, 4)})
        return passages, sources

    def check_documents(self, count: int, texts, field: str, ids=None, need_text: bool = False,
                        plain=()) -> None:
        """The request's documents within the limits; `ids` (one per text, or None) name them in the errors,
        `need_text` refuses an empty one (a document must say something); `plain[i]`: document i was sent as a
        string (the error names `field[i]`, not `field[i].text`)."""
        lim = self.limits
        if count > lim.max_documents:
            raise FieldError(field, f"{count} documents in one request; the limit is {lim.max_documents} "
                                    "(--max-documents)", "too_many_documents")
        ids = list(ids) if ids is not None else []
        for i, text in enumerate(texts):
            doc_id = ids[i] if i < len(ids) else None
            name = f"document {i}" + (f" (id {doc_id!r})" if doc_id is not None else "")
            where = f"{field}[{i}]" if i < len(plain) and plain[i] else f"{field}[{i}].text"
            if len(text) > lim.max_document_chars:
                raise FieldError(where, f"{name} has {len(text)} characters; the limit is {lim.max_document_chars} "
                                        "(--max-document-chars)", "document_too_long")
            if need_text and not text.strip():
                raise FieldError(where, f"{name} contains no text; send its text or leave it out", "empty_document")

    def check_prompt(self, segs: Segments, gen: GenerationOptions, fusion: FusionOptions,
                     field: str = "messages", namespace: str | None = None) -> int:
        """The prompt's tokens within --max-prompt-tokens, the positions its mode lays it out on within the
        model's window (with `ape`, blocks share positions: a prompt longer than the window may fit), and its
        prefill's worst cost within --max-request-cost. Returns that cost (token-layers)."""
        lim = self.limits.max_prompt_tokens
        if lim and segs.num_tokens > lim:
            raise FieldError(field, f"the prompt has {segs.num_tokens} tokens; the limit is {lim} "
                                    "(--max-prompt-tokens)", "context_length_exceeded")
        window, needed = self.engine.max_positions, self.engine.positions_needed(segs, fusion)
        if needed > window:
            shared = "" if needed == segs.num_tokens else f" of its {segs.num_tokens} tokens"
            wide = [m for m in mode_names() if get_mode(m).shares_positions]
            hint = (f"; mode {' or '.join(f'`{m}`' for m in wide)} encodes documents side by side (sharing "
                    "positions) and serves documents longer than the window"
                    if wide and fusion.mode not in wide and segs.blocks else "")
            raise FieldError(field, f"the prompt needs {needed} positions{shared} in mode {fusion.mode!r}; the "
                                    f"model has {window}{hint}", "context_length_exceeded")
        if gen.max_new_tokens > self.engine.max_positions:
            raise FieldError("max_tokens", f"max_tokens {gen.max_new_tokens} exceeds the model's "
                                           f"{self.engine.max_positions} positions")
        layers = self.engine.num_layers
        cost = self.engine.worst_token_layers(segs, fusion, namespace)  # a chat's history: as its path runs it
        check_cost(cost, self.max_request_cost, segs.num_tokens, layers, fusion.mode, field)
        return cost

    def fusion(self, extras: RagkvExtras | None, has_blocks: bool, history: bool = False) -> FusionOptions:
        e = extras or RagkvExtras()
        given = e.fusion_fields()
        base = self.default_fusion
        if "mode" not in given:
            if has_blocks and not history:
                base = self.documents_fusion
            given["mode"] = self.history_mode if history else base.mode if has_blocks else "prefix"
        try:  # validates: unknown mode, r outside [0, 1], T or S <= 0, ...; then what needs the model
            fusion = validate_fusion(replace(base, **given))
            get_mode(fusion.mode).check(self.engine.mode_context, fusion)
        except OptionError as err:  # every extension field is named as the client wrote it: ragkv.<field>
            raise FieldError(f"ragkv.{err.param}", str(err)) from None
        return fusion

    def generation(self, req, default_max: int) -> GenerationOptions:
        # max_completion_tokens wins over max_tokens, even when it is 0 (an answer of no tokens: the prompt is
        # still read, and the choice ends at once with finish_reason "length", as max_tokens 0 does)
        max_new = getattr(req, "max_completion_tokens", None)
        if max_new is None:
            max_new = req.max_tokens
        if req.n > self.max_batch:
            raise FieldError("n", f"n={req.n} choices exceed the {self.max_batch} sequences decoded together "
                                  "(--max-batch)")
        penalty = req.repetition_penalty
        return GenerationOptions(max_new_tokens=default_max if max_new is None else max_new,
                                 min_tokens=req.min_tokens or 0,
                                 temperature=req.temperature or 0.0, top_p=req.top_p or 1.0, seed=req.seed,
                                 stop=req.stops(), top_k=max(req.top_k or 0, 0), min_p=req.min_p or 0.0,
                                 presence_penalty=req.presence_penalty or 0.0,
                                 frequency_penalty=req.frequency_penalty or 0.0,
                                 repetition_penalty=1.0 if penalty is None else penalty,
                                 logprobs=req.logprobs_count(),
                                 grammar=req.response_format.grammar() if req.response_format else None)

    def chat(self, req: ChatRequest, tenant: str = DEFAULT_TENANT) -> Prepared:
        system, rendered, last_text = chat_turns(req)
        tools = req.calls_tools()
        question = rendered[-1]["content"]
        passages, sources = self.passages(req, last_text, tenant)
        if passages:
            fusion = self.fusion(req.ragkv, True)
            # earlier turns: blocks before the passages (exact while the conversation only grows: engine/blocks/history.py)
            segs = self.engine.segments(question, passages, system=system, turns=rendered[:-1])
        else:
            if not question.strip():
                raise FieldError("messages", "the last user message is empty")
            # earlier turns (user, assistant, tool) are blocks: exact while the conversation only grows, fused
            # behind an edit (engine/blocks/history.py)
            segs = self.engine.history_segments(rendered, system)
            fusion = self.fusion(req.ragkv, bool(segs.blocks), history=bool(segs.blocks))
        gen = self.generation(req, 256)
        forced = req.tool_choice == "required" or isinstance(req.tool_choice, NamedToolChoice)
        if tools and forced:
            if gen.grammar is not None:
                raise FieldError("tool_choice", "tool_choice required or named constrains the answer to calls; it "
                                                "cannot be combined with response_format json")
            gen = replace(gen, grammar=self.call_grammar(req))
        segs = self.engine.fit_to_window(segs, fusion, gen.max_new_tokens)
        namespace = self.namespace(req.ragkv, tenant, req.cache_salt)
        cost = self.check_prompt(segs, gen, fusion, namespace=namespace)
        self.budget.charge(tenant, cost)
        names = tuple(t.function.name for t in req.tools) if tools else ()
        return Prepared(segs, fusion, gen, namespace, sources, req.n, tenant,
                        names, tools and forced, cost)

    def call_grammar(self, req: ChatRequest) -> str:
        """The grammar of a `tool_choice` required or named answer; a function's parameters that no finite value
        follows (a `$ref` cycle) or llguidance cannot use are a 400 naming them."""
        name = req.tool_choice.function.name if isinstance(req.tool_choice, NamedToolChoice) else None
        for i, t in enumerate(req.tools):
            if name in (None, t.function.name) and t.function.parameters is not None:
                try:
                    check_finite(t.function.parameters, f"parameters schema of {t.function.name!r}")
                except InvalidRequestError as e:
                    raise FieldError(f"tools[{i}].function.parameters", str(e), "invalid_tool") from None
        try:
            return lark_grammar(call_grammar(req.tool_dicts(), name, req.parallel_tool_calls is not False,
                                             tag_tokens(self.engine.tokenizer)))
        except InvalidRequestError as e:
            raise FieldError("tools", f"a function's parameters cannot be used as a JSON schema: {e}",
                             "invalid_tool") from None

    def completion(self, req: CompletionRequest, tenant: str = DEFAULT_TENANT) -> list[Prepared]:
        """One Prepared per prompt (a list of prompts answers one choice each, `n` per prompt, as OpenAI does)."""
        prompts = req.prompts()
        if not prompts:
            raise FieldError("prompt", "the prompt list is empty; send at least one prompt")
        gen = self.generation(req, 16)
        namespace = self.namespace(req.ragkv, tenant, req.cache_salt)
        out, cost = [], 0
        for i, prompt in enumerate(prompts):
            field = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if isinstance(prompt, list):
                segs, sources, fusion = self.token_prompt(req, prompt, field), [], self.fusion(req.ragkv, False)
            else:
                if not prompt.strip():
                    raise FieldError(field, "the prompt is empty")
                passages, sources = self.passages(req, prompt, tenant)
                fusion = self.fusion(req.ragkv, bool(passages))
                segs = self.engine.segments(prompt, passages) if passages else self.engine.text_segments(prompt)
                if not segs.query:  # e.g. only characters the tokenizer drops (the fuzzer's "\x87"): nothing to read
                    raise FieldError(field, f"the prompt {prompt[:40]!r} tokenizes to no tokens; send text the "
                                            "model's tokenizer keeps")
            segs = self.engine.fit_to_window(segs, fusion, gen.max_new_tokens)
            one = self.check_prompt(segs, gen, fusion, field)
            cost += one
            out.append(Prepared(segs, fusion, gen, namespace, sources, req.n, tenant, cost=one))
        self.budget.charge(tenant, cost)  # the prompts are admitted together or not at all
        return out

    def token_prompt(self, req: CompletionRequest, ids: list[int], field: str) -> Segments:
        """A prompt given as token ids: run as it is (no chat template), like a text prompt without documents."""
        if not ids:
            raise FieldError(field, "the prompt has no token ids")
        docs, where = req.inline_documents()
        if docs or (req.ragkv is not None and req.ragkv.retrieval is not None):
            raise FieldError(field, f"token-id prompts cannot be combined with {where if docs else 'retrieval'} "
                                    "(passages are placed by the prompt template, which needs the text); send the "
                                    "prompt as text")
        vocab = self.engine.model.args.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise FieldError(field, f"token id {bad} is outside the model's vocabulary (0..{vocab - 1})")
        return Segments([], [], list(ids))
