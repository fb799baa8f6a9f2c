"""The retrieval half of RAG: ingest files (read, chunk, embed, index) and retrieve the top-k chunks for a question.

Re-ingesting is incremental: chunk ids are content hashes, so an unchanged file costs no embedding, and an edited
one embeds only its new chunks (stale ones are dropped). Each document lands in the library (ragkv.rag.catalog) in
one transaction, after all its chunks are embedded. `on_chunk` fires once per newly indexed chunk, after its
document is searchable, which is where the caller precomputes the chunk's KV.

`ingest_steps` does the same in small units, yielding between them, so that a server can interleave ingestion
with answering (and cancel it between two units).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

from ragkv.errors import RagkvError
from ragkv.rag.chunking import Chunk, ChunkConfig, CountTokens, chunk_document
from ragkv.rag.documents import Document, DocumentError, find_document_files, read_document
from ragkv.rag.catalog import Catalog
from ragkv.rag.embedding import Embedder, get_embedder
from ragkv.rag.index import DocumentInfo, VectorIndex
from ragkv.settings import DEFAULT_TENANT

EMBED_BATCH = 8   # chunks embedded per unit: a unit must stay short when a server interleaves it with answers


@dataclass
class IngestReport:
    documents: int = 0          # documents read (including unchanged ones)
    unchanged: int = 0          # documents whose chunks were all indexed already
    chunks_added: int = 0       # newly embedded and indexed
    chunks_removed: int = 0     # stale chunks of edited documents
    errors: list[DocumentError] = field(default_factory=list)  # skipped files (only with on_error)


class Retriever:
    """Reads, chunks, embeds and indexes one tenant's documents; retrieves chunks by cosine similarity."""

    def __init__(self, index_dir: str | Path, embedder: Embedder | None = None,
                 chunking: ChunkConfig = ChunkConfig(), tenant: str = DEFAULT_TENANT,
                 catalog: Catalog | None = None):
        self.embedder = embedder or get_embedder()
        self.chunking = chunking
        self.tenant = tenant
        self.catalog = catalog or Catalog(index_dir, embedding_model=self.embedder.name)

    def for_tenant(self, tenant: str) -> "Retriever":
        """The same library (one database connection), seen as another tenant."""
        return Retriever(self.catalog.folder, self.embedder, self.chunking, tenant, self.catalog)

    @property
    def index(self) -> VectorIndex:
        """This tenant's chunks as searched now (what any process committed so far)."""
        return self.catalog.index(self.tenant)

    def ingest(self, paths: Iterable[str | Path], count_tokens: CountTokens,
               on_chunk: Callable[[Chunk], None] | None = None,
               on_error: Callable[[DocumentError], None] | None = None, progress: bool = False) -> IngestReport:
        """Ingest files and folders (see `documents.find_document_files`).

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
        """Chunk, embed and index documents already in memory (e.g. sent inline to the server)."""
        steps = self.ingest_steps(docs, count_tokens, on_chunk, progress)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def _changed_documents(self, docs: Sequence[Document], count_tokens: CountTokens):
        """[(document, its chunks, the ids already indexed)] of the documents that changed, and a report of the
        unchanged ones."""
        report = IngestReport(documents=len(docs))
        indexed = self.catalog.chunk_ids(self.tenant)
        todo = []
        for doc in {d.doc_id: d for d in docs}.values():  # the last version of a repeated id wins
            chunks = chunk_document(doc, count_tokens, self.chunking)
            old = indexed.get(doc.doc_id, set())
            if old == {c.chunk_id for c in chunks}:
                report.unchanged += 1
                continue
            todo.append((doc, chunks, old))
        return todo, report

    def new_chunks(self, docs: Sequence[Document], count_tokens: CountTokens) -> list[Chunk]:
        """The chunks ingesting `docs` would add to the library now: those its precompute encodes."""
        todo, _ = self._changed_documents(docs, count_tokens)
        return [c for _, chunks, old in todo for c in chunks if c.chunk_id not in old]

    def ingest_steps(self, docs: Sequence[Document], count_tokens: CountTokens,
                     on_chunk: Callable[[Chunk], None] | None = None, progress: bool = False,
                     status: dict | None = None, on_commit: Callable[[str], None] | None = None):
        """`ingest_documents` as a generator: yields after each unit (one embedding batch, one document's commit,
        one `on_chunk` call); returns the IngestReport. `status`, when given, is kept up to date (chunks_total,
        chunks_done, chunks_committed, documents_done) for progress reports; `on_commit(doc_id)` is called once each document is in
        the library (at once for the unchanged ones), which is what a durable job records."""
        todo, report = self._changed_documents(docs, count_tokens)
        if on_commit is not None:
            changed = {doc.doc_id for doc, _, _ in todo}
            for doc_id in dict.fromkeys(d.doc_id for d in docs):
                if doc_id not in changed:
                    on_commit(doc_id)
        status = status if status is not None else {}
        status.update(chunks_total=sum(len(c) - len(old & {x.chunk_id for x in c}) for _, c, old in todo),
                      chunks_done=0, chunks_committed=0, documents_done=report.unchanged,
                      documents_total=report.documents)
        bar = None
        if progress and status["chunks_total"]:
            from tqdm.auto import tqdm
            bar = tqdm(total=status["chunks_total"], desc="indexing", unit="chunk")
        try:
            for doc, chunks, old in todo:
                new = [c for c in chunks if c.chunk_id not in old]
                kept = [c for c in chunks if c.chunk_id in old]
                vectors = {}
                if kept:
                    vectors.update(zip([c.chunk_id for c in kept], self.catalog.vectors(self.tenant,
                                                                                    [c.chunk_id for c in kept])))
                for lo in range(0, len(new), EMBED_BATCH):
                    batch = new[lo:lo + EMBED_BATCH]
                    vectors.update(zip([c.chunk_id for c in batch], self.embedder.encode([c.passage for c in batch])))
                    yield
                self.catalog.put_document(self.tenant, doc.doc_id, doc.title, doc.source, chunks,
                                          [vectors[c.chunk_id] for c in chunks])
                report.chunks_added += len(new)
                report.chunks_removed += len(old) - len(kept)
                status["documents_done"] += 1
                status["chunks_committed"] += len(new)  # of chunks_total, those whose document is in the library
                if on_commit is not None:
                    on_commit(doc.doc_id)
                yield
                for chunk in new:
                    if on_chunk is not None:
                        on_chunk(chunk)
                        yield
                    status["chunks_done"] += 1
                    if bar is not None:
                        bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return report

    def retrieve(self, question: str, top_k: int = 5,
                 doc_ids: Iterable[str] | None = None) -> list[tuple[Chunk, float]]:
        """The `top_k` chunks most similar to `question` (cosine, best first), optionally only from `doc_ids`."""
        if not question.strip():
            raise RagkvError("the question is empty")
        index = self.index
        if len(index) == 0:
            return []
        return index.search(self.embedder.encode([question])[0], top_k, doc_ids)

    def remove(self, doc_id: str) -> int:
        """Drop a document's chunks; returns how many chunks were removed."""
        return self.catalog.remove(self.tenant, [doc_id])

    def documents(self) -> list[DocumentInfo]:
        return self.catalog.documents(self.tenant)
