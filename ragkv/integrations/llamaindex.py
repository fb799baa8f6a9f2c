"""LlamaIndex over `ragkv serve`: an LLM that takes retrieved nodes as ragkv blocks (`documents=`), a query engine
that sends a retriever's nodes that way instead of pasting them into a prompt template, and a retriever over the
server's document library.

    llm = RagkvLLM(base_url="http://127.0.0.1:8000", max_tokens=128)
    engine = RagkvQueryEngine(retriever=index.as_retriever(), llm=llm)  # any LlamaIndex retriever
    engine.query("Who built Lintwick Tower?")  # .metadata["usage"]["reused_tokens"]: tokens read from the cache
"""

from __future__ import annotations

from typing import Any, Sequence

try:
    from llama_index.core.base.response.schema import Response, StreamingResponse
    from llama_index.core.llms import (ChatMessage, ChatResponse, ChatResponseGen, CompletionResponse,
                                       CompletionResponseGen, CustomLLM, LLMMetadata, MessageRole)
    from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
    from llama_index.core.query_engine import CustomQueryEngine
    from llama_index.core.retrievers import BaseRetriever
    from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore, QueryBundle, TextNode
    from pydantic import Field

    from ragkv.integrations.client import RagkvClient, Reply, document  # needs httpx
    from ragkv.rag.order import order_passages
    from ragkv.settings import DEFAULT_PASSAGE_ORDER
except ImportError as e:
    raise ImportError(f"ragkv.integrations.llamaindex needs llama-index-core and httpx ({e}): "
                      "pip install 'ragkv[llamaindex]'") from e

ROLES = {MessageRole.SYSTEM: "system", MessageRole.DEVELOPER: "developer", MessageRole.USER: "user",
         MessageRole.ASSISTANT: "assistant"}


def to_openai(message: ChatMessage) -> dict:
    role = ROLES.get(message.role)
    if role is None:
        raise ValueError(f"ragkv serve accepts system, user and assistant messages, not {message.role.value!r}")
    return {"role": role, "content": message.content or ""}


def to_ragkv_document(node: BaseNode | NodeWithScore | str | dict) -> dict:
    """A node -> a ragkv block: its text without metadata (the metadata would change the block's tokens), its
    metadata's title (a library chunk's title finds the KV precomputed at ingest) and its id."""
    if isinstance(node, NodeWithScore):
        node = node.node
    if isinstance(node, str):
        return document(node)
    if isinstance(node, dict):
        return document(node["text"], node.get("title"), node.get("id"))
    return document(node.get_content(metadata_mode=MetadataMode.NONE), node.metadata.get("title"), node.node_id)


def reply_details(reply: Reply) -> dict:
    """What the server says about a reply: `usage` (reused_tokens, ...), `stats` (cache hits and misses) and
    `sources`; LlamaIndex keeps it in `additional_kwargs` (responses) or `metadata` (query engine)."""
    return {"usage": reply.usage, "stats": reply.stats, "sources": reply.sources, "finish_reason": reply.finish_reason}


class RagkvLLM(CustomLLM):
    """An LLM served by `ragkv serve`. `complete` and `chat` take `documents=[node, ...]` (nodes, NodeWithScore,
    strings) and send them as ragkv blocks; without them it is a plain LLM."""

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the model the server runs
    api_key: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    mode: str | None = None  # fusion mode for documents (reuse, blend, ape, full, ...); None: the server's
    ragkv_options: dict = Field(default_factory=dict)  # other `ragkv` fields: ratio, namespace, sink_tokens, ...
    context_window: int = 8192  # the default model's positions; LlamaIndex sizes prompts by it
    timeout: float = 300.0

    @classmethod
    def class_name(cls) -> str:
        return "ragkv_llm"

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(context_window=self.context_window, num_output=self.max_tokens or 256,
                           is_chat_model=True, model_name=self.model or "ragkv")

    def _client(self) -> RagkvClient:
        return RagkvClient(self.base_url, self.api_key, self.timeout)

    def _body(self, messages: list[dict], documents: Sequence | None, stream: bool, **kwargs: Any) -> dict:
        return RagkvClient.chat_body(
            messages, [to_ragkv_document(d) for d in documents or ()], model=self.model,
            max_tokens=kwargs.get("max_tokens", self.max_tokens),
            temperature=kwargs.get("temperature", self.temperature), stop=kwargs.get("stop"),
            mode=kwargs.get("mode", self.mode), options=self.ragkv_options, stream=stream)

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, documents: Sequence | None = None,
                 **kwargs: Any) -> CompletionResponse:
        reply = self._client().chat(self._body([{"role": "user", "content": prompt}], documents, False, **kwargs))
        return CompletionResponse(text=reply.text, additional_kwargs=reply_details(reply))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, documents: Sequence | None = None,
                        **kwargs: Any) -> CompletionResponseGen:
        body = self._body([{"role": "user", "content": prompt}], documents, True, **kwargs)

        def gen() -> CompletionResponseGen:
            text = ""
            for item in self._client().stream_chat(body):
                if isinstance(item, Reply):
                    yield CompletionResponse(text=text, delta="", additional_kwargs=reply_details(item))
                else:
                    text += item
                    yield CompletionResponse(text=text, delta=item)
        return gen()

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], documents: Sequence | None = None,
             **kwargs: Any) -> ChatResponse:
        reply = self._client().chat(self._body([to_openai(m) for m in messages], documents, False, **kwargs))
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=reply.text),
                            additional_kwargs=reply_details(reply))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], documents: Sequence | None = None,
                    **kwargs: Any) -> ChatResponseGen:
        body = self._body([to_openai(m) for m in messages], documents, True, **kwargs)

        def gen() -> ChatResponseGen:
            text = ""
            for item in self._client().stream_chat(body):
                details = reply_details(item) if isinstance(item, Reply) else {}
                text += "" if details else item
                yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text),
                                   delta="" if details else item, additional_kwargs=details)
        return gen()


class RagkvQueryEngine(CustomQueryEngine):
    """Retrieve nodes with any LlamaIndex retriever, then ask `llm` with them as ragkv blocks (the place of a
    response synthesizer that would paste them into its prompt). The response's `metadata` holds the server's
    usage, stats and sources (filled when a streamed answer ends)."""

    retriever: BaseRetriever
    llm: RagkvLLM
    streaming: bool = False
    passage_order: str = DEFAULT_PASSAGE_ORDER  # the retriever's nodes (best first) in the prompt: best-last default

    def custom_query(self, query_str: str) -> Response | StreamingResponse:
        nodes = self.retriever.retrieve(query_str)
        blocks = order_passages(nodes, self.passage_order)
        if not self.streaming:
            answer = self.llm.complete(query_str, documents=blocks)
            return Response(answer.text, source_nodes=nodes, metadata=answer.additional_kwargs)
        metadata: dict = {}

        def tokens():
            for part in self.llm.stream_complete(query_str, documents=blocks):
                if part.additional_kwargs:
                    metadata.update(part.additional_kwargs)
                elif part.delta:
                    yield part.delta
        return StreamingResponse(tokens(), source_nodes=nodes, metadata=metadata)


class RagkvLibraryRetriever(BaseRetriever):
    """The server's document library (`POST /v1/documents`) as a LlamaIndex retriever: the `top_k` chunks as
    TextNodes with metadata title, doc_id and chunk_id. Sent by RagkvLLM, their KV is the one precomputed at
    ingest."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", top_k: int = 5, api_key: str | None = None,
                 timeout: float = 300.0, **kwargs: Any):
        super().__init__(**kwargs)
        self.client, self.top_k = RagkvClient(base_url, api_key, timeout), top_k

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        found = self.client.retrieve(query_bundle.query_str, self.top_k)
        return [NodeWithScore(node=TextNode(text=c["text"], id_=c["chunk_id"],
                                            metadata={"title": c["title"], "doc_id": c["doc_id"],
                                                      "chunk_id": c["chunk_id"]}),
                              score=c["score"]) for c in found]
