"""Documents the engine answers from: the retriever's index plus each chunk's KV precomputed into the store.

Used by `ragkv ingest`, `ragkv ask` (retrieval) and the server's /v1/documents.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ragkv.engine.options import FusionOptions
from ragkv.engine.request import Passage


@dataclass
class Retrieved:
    passage: Passage
    score: float
    chunk_id: str
    doc_id: str


class DocumentLibrary:
    def __init__(self, engine, index_dir: str | Path):
        from ragkv.rag.pipeline import Retriever

        self.engine = engine
        self.retriever = Retriever(index_dir)

    def count_tokens(self, text: str) -> int:
        return len(self.engine.tokenize(text))

    def _precompute(self, chunk) -> None:
        """Store the chunk's block KV (conditioning: none, used by reuse and blend) right after indexing."""
        self.engine.warm(self.engine.context_segments([Passage(chunk.text, chunk.title)]), FusionOptions(mode="reuse"))

    def ingest_paths(self, paths, progress: bool = False, on_error=None):
        return self.retriever.ingest(paths, self.count_tokens, on_chunk=self._precompute, on_error=on_error,
                                     progress=progress)

    def add_documents(self, docs: list[dict]):
        """docs: [{"text": ..., "title"?: ..., "id"?: ...}] -> IngestReport."""
        from ragkv.rag.documents import Document

        parsed = [Document.from_text(d["text"], title=d.get("title"), source="api", doc_id=d.get("id"))
                  for d in docs]
        return self.retriever.ingest_documents(parsed, self.count_tokens, on_chunk=self._precompute)

    def retrieve(self, question: str, top_k: int = 5) -> list[Retrieved]:
        return [Retrieved(Passage(c.text, c.title), float(score), c.chunk_id, c.doc_id)
                for c, score in self.retriever.retrieve(question, top_k)]

    def remove(self, doc_id: str) -> int:
        return self.retriever.remove(doc_id)

    def documents(self):
        return self.retriever.documents()
