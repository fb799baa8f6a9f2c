"""The in-memory vector index a tenant's retrieval searches: exact cosine search over a numpy matrix.

Why not faiss or hnswlib: at this scale (thousands to tens of thousands of chunks of dim 384) an exact search
is one matrix-vector product, ~20K x 384 floats = 30 MB, ~1-3 ms on one CPU core, with perfect recall and no
extra dependency or index build/tuning. An approximate index only pays from millions of vectors.

Nothing here is saved: the document library (ragkv.rag.catalog, ragkv.rag.redis_catalog) is the truth and
builds each tenant's index from its rows (`VectorIndex.from_rows`) when they changed.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from ragkv.errors import RagkvError
from ragkv.rag.chunking import Chunk


class VectorIndexError(RagkvError):
    pass


@dataclass(frozen=True)
class DocumentInfo:
    doc_id: str
    title: str
    source: str
    chunks: int


class VectorIndex:
    """Chunks and their unit vectors; thread-safe."""

    def __init__(self):
        self._lock = threading.RLock()
        self._vecs = np.zeros((0, 0), dtype=np.float32)  # [capacity, dim]; rows >= len(self) unused
        self._chunks: list[Chunk] = []
        self._row: dict[str, int] = {}

    @classmethod
    def from_rows(cls, rows: Sequence[tuple]) -> "VectorIndex":
        """An index of a library's rows: (chunk_id, doc_id, title, text, idx, source, float32 vector bytes), in
        the order search breaks ties."""
        index = cls()
        if rows:
            vectors = np.stack([np.frombuffer(r[6], dtype=np.float32) for r in rows])
            index.add([Chunk(r[0], r[1], r[2], r[3], r[4], r[5]) for r in rows], vectors)
        return index

    def __len__(self) -> int:
        return len(self._chunks)

    def __contains__(self, chunk_id: str) -> bool:
        return chunk_id in self._row

    @property
    def dim(self) -> int | None:
        return self._vecs.shape[1] if len(self) else None

    def get(self, chunk_id: str) -> Chunk | None:
        with self._lock:
            i = self._row.get(chunk_id)
            return None if i is None else self._chunks[i]

    def vectors(self, chunk_ids: Sequence[str]) -> np.ndarray:
        """Stored vectors of the given chunks, [len(chunk_ids), dim]; raises KeyError for an unknown id."""
        with self._lock:
            return self._vecs[[self._row[c] for c in chunk_ids]].copy()

    def chunks(self, doc_id: str | None = None) -> list[Chunk]:
        with self._lock:
            return [c for c in self._chunks if doc_id is None or c.doc_id == doc_id]

    def add(self, chunks: Sequence[Chunk], vectors: np.ndarray) -> list[Chunk]:
        """Add chunks with their unit vectors [len(chunks), dim]; ids already present are skipped.

        Returns:
            The chunks actually added.
        """
        vectors = np.asarray(vectors, dtype=np.float32)
        if vectors.ndim != 2 or len(vectors) != len(chunks):
            raise ValueError(f"add wants one vector per chunk: {len(chunks)} chunks, vectors {vectors.shape}")
        with self._lock:
            if self.dim is not None and vectors.shape[1] != self.dim:
                raise VectorIndexError(f"vectors of dim {vectors.shape[1]} do not fit an index of dim {self.dim}; "
                                       "use the same embedding model or another index folder")
            keep, seen = [], set()
            for i, c in enumerate(chunks):
                if c.chunk_id not in self._row and c.chunk_id not in seen:
                    keep.append(i)
                    seen.add(c.chunk_id)
            if not keep:
                return []
            n, need = len(self), len(self) + len(keep)
            if n == 0 or need > len(self._vecs):  # grow by doubling: many small adds stay linear
                grown = np.zeros((max(need, 2 * len(self._vecs), 64), vectors.shape[1]), dtype=np.float32)
                if n:
                    grown[:n] = self._vecs[:n]
                self._vecs = grown
            self._vecs[n:need] = vectors[keep]
            added = [chunks[i] for i in keep]
            for j, c in enumerate(added):
                self._row[c.chunk_id] = n + j
            self._chunks.extend(added)
            return added

    def remove(self, doc_id: str) -> int:
        """Remove every chunk of a document; returns how many were removed."""
        return self.remove_documents([doc_id])

    def remove_documents(self, doc_ids: Iterable[str]) -> int:
        """Remove every chunk of these documents in one pass; returns how many were removed."""
        doc_ids = set(doc_ids)
        with self._lock:
            keep = [i for i, c in enumerate(self._chunks) if c.doc_id not in doc_ids]
            removed = len(self._chunks) - len(keep)
            if removed:
                self._vecs = self._vecs[keep]
                self._chunks = [self._chunks[i] for i in keep]
                self._row = {c.chunk_id: i for i, c in enumerate(self._chunks)}
            return removed

    def search(self, vector: np.ndarray, top_k: int = 5,
               doc_ids: Iterable[str] | None = None) -> list[tuple[Chunk, float]]:
        """The `top_k` chunks by cosine similarity to `vector`, best first, optionally only from `doc_ids`."""
        if top_k < 1:
            raise RagkvError(f"top_k must be at least 1, got {top_k}")
        q = np.asarray(vector, dtype=np.float32).reshape(-1)
        with self._lock:
            n = len(self)
            if n == 0:
                return []
            if q.shape[0] != self.dim:
                raise VectorIndexError(f"query vector has dim {q.shape[0]}, the index {self.dim}")
            q = q / max(float(np.linalg.norm(q)), 1e-12)
            scores = self._vecs[:n] @ q  # [n]
            if doc_ids is not None:
                wanted = set(doc_ids)
                scores = np.where([c.doc_id in wanted for c in self._chunks], scores, -np.inf)
            k = min(top_k, n)
            top = np.argpartition(-scores, k - 1)[:k]
            top = top[np.argsort(-scores[top], kind="stable")]
            return [(self._chunks[i], float(scores[i])) for i in top if np.isfinite(scores[i])]

    def documents(self) -> list[DocumentInfo]:
        """Indexed documents in insertion order, with their title, source and chunk count."""
        with self._lock:
            docs: dict[str, list] = {}
            for c in self._chunks:
                docs.setdefault(c.doc_id, [c.title, c.source, 0])[2] += 1
            return [DocumentInfo(d, t, s, n) for d, (t, s, n) in docs.items()]
