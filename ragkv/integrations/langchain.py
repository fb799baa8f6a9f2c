"""LangChain over `ragkv serve`: a chat model that sends a retriever's Documents as ragkv blocks (not pasted into
the prompt, so each one's KV is computed once and reused at any position), and a retriever over the server's
document library.

    llm = ChatRagkv(base_url="http://127.0.0.1:8000", max_tokens=128)
    retriever = RagkvRetriever(base_url="http://127.0.0.1:8000", top_k=4)
    chain = {"context": retriever, "question": RunnablePassthrough()} | create_blocks_chain(llm)
    chain.invoke("Who built Lintwick Tower?")  # or llm.invoke(question, documents=docs), llm.bind(documents=docs)
"""

from __future__ import annotations

import json
from typing import Any, Iterator, Sequence

try:
    from langchain_core.callbacks import CallbackManagerForLLMRun, CallbackManagerForRetrieverRun
    from langchain_core.documents import Document
    from langchain_core.language_models import BaseChatModel
    from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
    from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
    from langchain_core.prompts import BasePromptTemplate, ChatPromptTemplate
    from langchain_core.retrievers import BaseRetriever
    from langchain_core.runnables import Runnable, RunnableLambda
    from pydantic import Field, SecretStr

    from ragkv.integrations.client import RagkvClient, Reply, document  # needs httpx
    from ragkv.rag.order import check_order, order_passages
    from ragkv.settings import DEFAULT_PASSAGE_ORDER
except ImportError as e:
    raise ImportError(f"ragkv.integrations.langchain needs langchain-core and httpx ({e}): "
                      "pip install 'ragkv[langchain]'") from e

ROLES = {"human": "user", "ai": "assistant", "system": "system"}


def message_text(message: BaseMessage) -> str:
    """The text of a message whose content is a string or a list of content blocks (non-text blocks dropped)."""
    content = message.content
    if isinstance(content, str):
        return content
    return "".join(b if isinstance(b, str) else b.get("text", "") for b in content
                   if isinstance(b, str) or b.get("type") == "text")


def to_openai(message: BaseMessage) -> dict:
    if message.type == "tool":  # a tool's result, answering the call `tool_call_id`
        return {"role": "tool", "content": message_text(message), "tool_call_id": message.tool_call_id}
    role = message.role if message.type == "chat" else ROLES.get(message.type)  # type: ignore[attr-defined]
    if role not in ("user", "assistant", "system", "developer"):
        raise ValueError(f"ragkv serve accepts system, user, assistant and tool messages, not {message.type!r}")
    out = {"role": role, "content": message_text(message)}
    calls = getattr(message, "tool_calls", None)
    if role == "assistant" and calls:  # the calls an earlier step made, sent back with the conversation
        out["content"] = out["content"] or None
        out["tool_calls"] = [{"id": c.get("id"), "type": "function",
                              "function": {"name": c["name"], "arguments": json.dumps(c.get("args") or {})}}
                             for c in calls]
    return out


def from_openai_calls(calls: list[dict]) -> list[dict]:
    """OpenAI's tool_calls -> LangChain's (name, args as an object, id)."""
    out = []
    for c in calls:
        fn = c.get("function") or {}
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except ValueError:
            args = {"__raw__": fn.get("arguments")}
        out.append({"name": fn.get("name"), "args": args, "id": c.get("id"), "type": "tool_call"})
    return out


def to_ragkv_document(doc: Document | str | dict) -> dict:
    """A LangChain Document -> a ragkv block: its page_content, its metadata's title (part of the block, so a
    library chunk's title finds the KV the server precomputed) and its id."""
    if isinstance(doc, str):
        return document(doc)
    if isinstance(doc, dict):
        return document(doc["text"], doc.get("title"), doc.get("id"))
    return document(doc.page_content, doc.metadata.get("title"), doc.id)


def usage_metadata(reply: Reply) -> dict:
    u = reply.usage
    return {"input_tokens": u.get("prompt_tokens", 0), "output_tokens": u.get("completion_tokens", 0),
            "total_tokens": u.get("total_tokens", 0), "input_token_details": {"cache_read": reply.cached_tokens}}


def response_metadata(reply: Reply) -> dict:
    """What LangChain users read off `response_metadata`: the model, why it stopped, and ragkv's block stats."""
    return {"model_name": reply.model, "finish_reason": reply.finish_reason,
            "ragkv": {"usage": reply.usage, "stats": reply.stats, "sources": reply.sources}}


class ChatRagkv(BaseChatModel):
    """A chat model served by `ragkv serve`. Documents given as `documents=[Document, ...]` (to `invoke`,
    `stream` or `bind`) are sent as ragkv blocks; without them it is a plain chat model."""

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the model the server runs
    api_key: SecretStr | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    mode: str | None = None  # fusion mode for documents (reuse, blend, ape, full, ...); None: the server's
    ragkv_options: dict = Field(default_factory=dict)  # other `ragkv` fields: ratio, namespace, sink_tokens, ...
    timeout: float = 300.0

    @property
    def _llm_type(self) -> str:
        return "ragkv"

    @property
    def _identifying_params(self) -> dict:
        return {"base_url": self.base_url, "model": self.model, "mode": self.mode, "max_tokens": self.max_tokens,
                "temperature": self.temperature, **self.ragkv_options}

    def _client(self) -> RagkvClient:
        key = self.api_key.get_secret_value() if self.api_key else None
        return RagkvClient(self.base_url, key, self.timeout)

    def bind_tools(self, tools: Sequence, tool_choice: str | dict | None = None, **kwargs: Any) -> Runnable:
        """The model offered `tools` (functions, pydantic models, LangChain tools or OpenAI dicts); `tool_choice`:
        "auto", "none", "any" or "required" (a call is constrained), or a tool's name."""
        from langchain_core.utils.function_calling import convert_to_openai_tool

        choice = tool_choice
        if choice == "any":
            choice = "required"
        elif isinstance(choice, str) and choice not in ("auto", "none", "required"):
            choice = {"type": "function", "function": {"name": choice}}
        return self.bind(tools=[convert_to_openai_tool(t) for t in tools], tool_choice=choice, **kwargs)

    def _body(self, messages: list[BaseMessage], stop: list[str] | None, documents: Sequence | None,
              stream: bool, **kwargs: Any) -> dict:
        unknown = set(kwargs) - {"max_tokens", "temperature", "mode", "tools", "tool_choice"}
        if unknown:
            raise TypeError(f"ChatRagkv got unexpected keyword argument(s) {sorted(unknown)}")
        return RagkvClient.chat_body(
            [to_openai(m) for m in messages], [to_ragkv_document(d) for d in documents or ()], model=self.model,
            max_tokens=kwargs.get("max_tokens", self.max_tokens),
            temperature=kwargs.get("temperature", self.temperature), stop=stop,
            mode=kwargs.get("mode", self.mode), options=self.ragkv_options, stream=stream,
            tools=kwargs.get("tools"), tool_choice=kwargs.get("tool_choice"))

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, documents: Sequence | None = None,
                  **kwargs: Any) -> ChatResult:
        reply = self._client().chat(self._body(messages, stop, documents, False, **kwargs))
        message = AIMessage(reply.text, usage_metadata=usage_metadata(reply),
                            response_metadata=response_metadata(reply), tool_calls=from_openai_calls(reply.tool_calls))
        return ChatResult(generations=[ChatGeneration(message=message)],
                          llm_output={"model_name": reply.model, "token_usage": reply.usage})

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, documents: Sequence | None = None,
                **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        for item in self._client().stream_chat(self._body(messages, stop, documents, True, **kwargs)):
            if isinstance(item, Reply):  # the last chunk carries the usage and stats; merging keeps them
                yield ChatGenerationChunk(message=AIMessageChunk(
                    "", usage_metadata=usage_metadata(item), response_metadata=response_metadata(item)))
                continue
            chunk = ChatGenerationChunk(message=AIMessageChunk(item))
            if run_manager is not None:
                run_manager.on_llm_new_token(item, chunk=chunk)
            yield chunk


def create_blocks_chain(llm: ChatRagkv, prompt: BasePromptTemplate | None = None,
                        documents_key: str = "context", passage_order: str = DEFAULT_PASSAGE_ORDER) -> Runnable:
    """The ragkv counterpart of a "stuff documents" chain: input `{documents_key: [Document], **prompt variables}`,
    output the AIMessage. The documents go as blocks, so the prompt must not contain them (default prompt: one
    user message `{question}`). Put a retriever in front: `{"context": retriever, "question": RunnablePassthrough()}`.
    """
    check_order(passage_order)
    prompt = prompt if prompt is not None else ChatPromptTemplate.from_messages([("human", "{question}")])
    if documents_key in prompt.input_variables:
        raise ValueError(f"the prompt contains {{{documents_key}}}: ragkv sends the documents as blocks, not as "
                         f"prompt text; remove {{{documents_key}}} from the prompt")

    def with_documents(inputs: dict) -> Runnable:  # a returned Runnable is invoked (or streamed) on the same input
        if documents_key not in inputs:
            raise KeyError(f"the chain's input has no {documents_key!r} key (the documents); it has {sorted(inputs)}")
        # a retriever's documents come best first; `passage_order` puts them in the prompt (default: best last)
        return prompt | llm.bind(documents=order_passages(list(inputs[documents_key]), passage_order))

    return RunnableLambda(with_documents, name="ragkv_blocks")


class RagkvRetriever(BaseRetriever):
    """The server's document library (`POST /v1/documents`) as a LangChain retriever: the `top_k` chunks with
    metadata title, doc_id, chunk_id and score. Handed to ChatRagkv, their KV is the one precomputed at ingest."""

    base_url: str = "http://127.0.0.1:8000"
    api_key: SecretStr | None = None
    top_k: int = 5
    timeout: float = 300.0

    def _get_relevant_documents(self, query: str, *,
                                run_manager: CallbackManagerForRetrieverRun | None = None) -> list[Document]:
        key = self.api_key.get_secret_value() if self.api_key else None
        found = RagkvClient(self.base_url, key, self.timeout).retrieve(query, self.top_k)
        return [Document(c["text"], id=c["chunk_id"],
                         metadata={"title": c["title"], "doc_id": c["doc_id"], "chunk_id": c["chunk_id"],
                                   "score": c["score"], "source": "ragkv"}) for c in found]
