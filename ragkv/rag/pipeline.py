"""The retrieval half of RAG: ingest files (read, chunk, embed, index) and retrieve the top-k chunks for a question.

Re-ingesting is incremental: chunk ids are content hashes, so an unchanged file costs no embedding, and an edited
one embeds only its new chunks (stale ones are dropped). `on_chunk` fires once per newly indexed chunk, which is
where the caller precomputes the chunk's KV.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

from ragkv.errors import RagkvError
from ragkv.rag.chunking import Chunk, ChunkConfig, CountTokens, chunk_document
from ragkv.rag.documents import Document, DocumentError, find_document_files, read_document
from ragkv.rag.embedding import Embedder, get_embedder
from ragkv.rag.index import DocumentInfo, VectorIndex

EMBED_BATCH = 64    # chunks embedded, indexed and handed to on_chunk per step
SAVE_EVERY_S = 60   # during a long ingest, persist the index at least this often


@dataclass
class IngestReport:
    documents: int = 0          # documents read (including unchanged ones)
    unchanged: int = 0          # documents whose chunks were all indexed already
    chunks_added: int = 0       # newly embedded and indexed
    chunks_removed: int = 0     # stale chunks of edited documents
    errors: list[DocumentError] = field(default_factory=list)  # skipped files (only with on_error)


class Retriever:
    """Reads, chunks, embeds and indexes documents; retrieves chunks by cosine similarity to a question."""

    def __init__(self, index_dir: str | Path, embedder: Embedder | None = None,
                 chunking: ChunkConfig = ChunkConfig()):
        self.embedder = embedder or get_embedder()
        self.chunking = chunking
        self.index = VectorIndex.open(index_dir, embedding_model=self.embedder.name)

    def ingest(self, paths: Iterable[str | Path], count_tokens: CountTokens,
               on_chunk: Callable[[Chunk], None] | None = None,
               on_error: Callable[[DocumentError], None] | None = None, progress: bool = False) -> IngestReport:
        """Ingest files and folders (see `documents.find_document_files`) and save the index.

        Args:
            paths: files and folders.
            count_tokens: token count under the LLM's tokenizer (chunk sizes are in its tokens).
            on_chunk: called with each newly indexed chunk, after it is searchable.
            on_error: called with each unreadable file, which is then skipped; without it the first one raises.
            progress: show a progress bar over the chunks to embed.
        Raises:
            DocumentError: a path is missing or a file unreadable (without `on_error`).
        """
        docs, errors = [], []
        for path in find_document_files(paths):
            try:
                docs.extend(read_document(path))
            except DocumentError as e:
                if on_error is None:
                    raise
                on_error(e)
                errors.append(e)
        report = self.ingest_documents(docs, count_tokens, on_chunk, progress)
        report.errors = errors
        return report

    def ingest_documents(self, docs: Sequence[Document], count_tokens: CountTokens,
                         on_chunk: Callable[[Chunk], None] | None = None, progress: bool = False) -> IngestReport:
        """Chunk, embed and index documents already in memory (e.g. sent inline to the server); saves the index."""
        report = IngestReport(documents=len(docs))
        indexed: dict[str, set[str]] = {}
        for c in self.index.chunks():
            indexed.setdefault(c.doc_id, set()).add(c.chunk_id)
        pending, edited, kept = [], [], []
        for doc in {d.doc_id: d for d in docs}.values():  # the last version of a repeated id wins
            chunks = chunk_document(doc, count_tokens, self.chunking)
            old = indexed.get(doc.doc_id, set())
            new = [c for c in chunks if c.chunk_id not in old]
            if not new and len(old) == len(chunks):
                report.unchanged += 1
                continue
            if old:  # edited: drop it, re-add the chunks it kept (their index may have moved) with stored vectors
                edited.append(doc.doc_id)
                kept.extend(c for c in chunks if c.chunk_id in old)
            pending.extend(new)
        if edited:
            kept_vectors = self.index.vectors([c.chunk_id for c in kept])
            report.chunks_removed = self.index.remove_documents(edited) - len(kept)
            self.index.add(kept, kept_vectors)
        bar = None
        if progress and pending:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(pending), desc="indexing", unit="chunk")
        try:
            last_save = time.monotonic()
            for lo in range(0, len(pending), EMBED_BATCH):
                batch = pending[lo:lo + EMBED_BATCH]
                added = self.index.add(batch, self.embedder.encode([c.passage for c in batch]))
                report.chunks_added += len(added)
                for chunk in added:
                    if on_chunk is not None:
                        on_chunk(chunk)
                    if bar is not None:
                        bar.update(1)
                if time.monotonic() - last_save > SAVE_EVERY_S:  # a long ingest (KV precompute) keeps its progress
                    self.index.save()
                    last_save = time.monotonic()
        finally:  # whatever was indexed before an error stays consistent on disk
            if bar is not None:
                bar.close()
            self.index.save()
        return report

    def retrieve(self, question: str, top_k: int = 5,
                 doc_ids: Iterable[str] | None = None) -> list[tuple[Chunk, float]]:
        """The `top_k` chunks most similar to `question` (cosine, best first), optionally only from `doc_ids`."""
        if not question.strip():
            raise RagkvError("the question is empty")
        if len(self.index) == 0:
            return []
        return self.index.search(self.embedder.encode([question])[0], top_k, doc_ids)

    def reload(self) -> None:
        """Re-read the index from disk (another process, e.g. `ragkv ingest`, may have saved a newer one)."""
        self.index = VectorIndex.open(self.index.path, embedding_model=self.embedder.name)

    def remove(self, doc_id: str) -> int:
        """Drop a document's chunks and save; returns how many chunks were removed."""
        removed = self.index.remove(doc_id)
        if removed:
            self.index.save()
        return removed

    def documents(self) -> list[DocumentInfo]:
        return self.index.documents()
