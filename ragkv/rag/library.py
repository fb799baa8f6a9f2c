"""Documents the engine answers from: each tenant's retrieval library plus each chunk's KV precomputed into the
store (in that tenant's namespace).

Used by `ragkv ingest`, `ragkv ask` (retrieval) and the server's /v1/documents.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ragkv.engine.options import FusionOptions
from ragkv.engine.request.segments import Passage
from ragkv.rag.catalog import open_catalog
from ragkv.rag.embedding import get_embedder
from ragkv.rag.pipeline import Retriever
from ragkv.settings import DEFAULT_TENANT


@dataclass
class Retrieved:
    passage: Passage
    score: float
    chunk_id: str
    doc_id: str


class DocumentLibrary:
    """A tenant's documents: retrieval through its library, each new chunk's KV precomputed into the store.

    Args:
        engine: computes each new chunk's KV into the store.
        index_dir: the embedded library's folder, or a Redis URL (redis://..., redis+cluster://...) of a library
            several servers share (ragkv.rag.redis_catalog).
    """

    def __init__(self, engine, index_dir: str | Path, retriever: Retriever | None = None):
        self.engine = engine
        if retriever is None:
            embedder = get_embedder()
            retriever = Retriever(index_dir, embedder, catalog=open_catalog(index_dir, embedder.name))
        self.retriever = retriever

    def tenant(self, tenant: str) -> "DocumentLibrary":
        """The same library seen as `tenant`: its documents only, its chunks' KV in its namespace."""
        if tenant == self.retriever.tenant:
            return self
        return DocumentLibrary(self.engine, None, self.retriever.for_tenant(tenant))

    @property
    def namespace(self) -> str | None:
        return None if self.retriever.tenant == DEFAULT_TENANT else self.retriever.tenant

    def count_tokens(self, text: str) -> int:
        return len(self.engine.tokenize(text))

    def _precompute(self, chunk) -> None:
        """Store the chunk's block KV (conditioning: none, used by reuse and blend) right after indexing."""
        segs = self.engine.context_segments([Passage(chunk.text, chunk.title)])
        self.engine.warm(segs, FusionOptions(mode="reuse"), namespace=self.namespace)

    def precompute_cost(self, docs: list[dict]) -> int:
        """Token-layers the precompute of `docs` may run, as a prefill is counted (cold cache): the prefix and
        every new chunk's block through every layer. Chunks already in the library cost nothing."""
        chunks = self.retriever.new_chunks(self.parse(docs), self.count_tokens)
        if not chunks:
            return 0
        segs = self.engine.context_segments([Passage(c.text, c.title) for c in chunks])
        return segs.num_tokens * self.engine.num_layers

    def ingest_paths(self, paths, progress: bool = False, on_error=None):
        return self.retriever.ingest(paths, self.count_tokens, on_chunk=self._precompute, on_error=on_error,
                                     progress=progress)

    @staticmethod
    def parse(docs: list[dict]):
        """[{"text": ..., "title"?: ..., "id"?: ...}] -> Documents (a clear error for an empty text; the server
        refuses one earlier, naming its position)."""
        from ragkv.rag.documents import Document

        return [Document.from_text(d["text"], title=d.get("title"), source="api", doc_id=d.get("id"))
                for d in docs]

    def add_documents(self, docs: list[dict]):
        """docs: [{"text": ..., "title"?: ..., "id"?: ...}] -> IngestReport."""
        return self.retriever.ingest_documents(self.parse(docs), self.count_tokens, on_chunk=self._precompute)

    def add_steps(self, docs: list[dict], status: dict | None = None, on_commit=None):
        """`add_documents` in short units (a generator returning the IngestReport), for background jobs;
        `on_commit(doc_id)` once each document is in the library."""
        return self.retriever.ingest_steps(self.parse(docs), self.count_tokens, on_chunk=self._precompute,
                                           status=status, on_commit=on_commit)

    def retrieve(self, question: str, top_k: int = 5) -> list[Retrieved]:
        return [Retrieved(Passage(c.text, c.title), float(score), c.chunk_id, c.doc_id)
                for c, score in self.retriever.retrieve(question, top_k)]

    def remove(self, doc_id: str) -> int:
        return self.retriever.remove(doc_id)

    def documents(self):
        return self.retriever.documents()
