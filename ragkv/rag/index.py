"""A persisted vector index: exact cosine search over a numpy matrix, chunk metadata beside it as JSONL.

Why not faiss or hnswlib: at this scale (thousands to tens of thousands of chunks of dim 384) an exact search
is one matrix-vector product, ~20K x 384 floats = 30 MB, ~1-3 ms on one CPU core, with perfect recall and no
extra dependency or index build/tuning. An approximate index only pays from millions of vectors.

On disk (in the index folder):
    index.json                 manifest: format, generation, count, dim, embedding model
    vectors-<generation>.npy   float32 [count, dim] unit vectors, row i belongs to line i of the chunks file
    chunks-<generation>.jsonl  one Chunk per line
A save writes a new generation's files, then atomically replaces the manifest (the commit point), then deletes
the old generation, so a reader or a crash never sees vectors and metadata from different saves. Saves from
several processes are serialized by a lock file, but each writes its own in-memory view: the last save wins.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from ragkv.errors import RagkvError
from ragkv.rag.chunking import Chunk

FORMAT = 1
MANIFEST = "index.json"


class VectorIndexError(RagkvError):
    pass


@dataclass(frozen=True)
class DocumentInfo:
    doc_id: str
    title: str
    source: str
    chunks: int


def _corrupt(path: Path, reason: str) -> VectorIndexError:
    return VectorIndexError(f"vector index at {path} is unusable ({reason}); delete that folder and ingest "
                            "your documents again")


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class VectorIndex:
    """Chunks and their unit vectors; thread-safe; `save()` persists, nothing is written before."""

    def __init__(self, path: str | Path, embedding_model: str | None = None):
        self.path = Path(path).expanduser()
        self.embedding_model = embedding_model
        self._lock = threading.RLock()
        self._vecs = np.zeros((0, 0), dtype=np.float32)  # [capacity, dim]; rows >= len(self) unused
        self._chunks: list[Chunk] = []
        self._row: dict[str, int] = {}
        self._dirty = False

    @classmethod
    def open(cls, path: str | Path, embedding_model: str | None = None) -> VectorIndex:
        """Open the index in `path` (empty if the folder or its manifest does not exist yet).

        Raises:
            VectorIndexError: files are corrupt or inconsistent, or were built with another embedding model.
        """
        index = cls(path, embedding_model)
        if not (index.path / MANIFEST).exists():
            return index
        for attempt in range(3):  # a concurrent save may delete the generation between manifest and data reads
            generation, dim, count, model = index._read_manifest()
            try:
                vecs = np.load(index.path / f"vectors-{generation}.npy", allow_pickle=False)
                with open(index.path / f"chunks-{generation}.jsonl", encoding="utf-8") as f:
                    chunks = [Chunk(**json.loads(line)) for line in f if line.strip()]
                break
            except FileNotFoundError as e:
                if attempt == 2 or index._read_manifest()[0] == generation:
                    raise _corrupt(index.path, f"missing {Path(e.filename).name}") from None
            except (OSError, ValueError, TypeError) as e:
                raise _corrupt(index.path, f"{type(e).__name__}: {e}") from None
        if vecs.ndim != 2 or vecs.dtype != np.float32 or vecs.shape[1] != dim:
            raise _corrupt(index.path, f"vectors are {vecs.dtype} {vecs.shape}, expected float32 [N, {dim}]")
        if not (len(vecs) == len(chunks) == count):
            raise _corrupt(index.path, f"{len(vecs)} vectors but {len(chunks)} chunk records "
                                       f"(manifest says {count})")
        row = {c.chunk_id: i for i, c in enumerate(chunks)}
        if len(row) != len(chunks):
            raise _corrupt(index.path, "duplicate chunk ids")
        index._vecs, index._chunks, index._row = vecs, chunks, row
        index.embedding_model = embedding_model or model
        return index

    def _read_manifest(self) -> tuple[str, int, int, str | None]:
        try:
            manifest = json.loads((self.path / MANIFEST).read_text())
            generation, dim, count = str(manifest["generation"]), int(manifest["dim"]), int(manifest["count"])
            model, fmt = manifest.get("embedding_model"), manifest.get("format")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise _corrupt(self.path, f"bad {MANIFEST}: {e}") from None
        if fmt != FORMAT:
            raise _corrupt(self.path, f"format {fmt!r}, this version reads {FORMAT}")
        if self.embedding_model and model and model != self.embedding_model:
            raise VectorIndexError(f"vector index at {self.path} was built with embedding model {model!r}, not "
                                   f"{self.embedding_model!r}; use another index folder or delete it and ingest again")
        return generation, dim, count, model

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
            self._dirty = True
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
                self._dirty = True
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

    def save(self) -> None:
        """Persist atomically (new generation files, then the manifest swap); a no-op when nothing changed."""
        with self._lock:
            if not self._dirty and (self.path / MANIFEST).exists():
                return
            self.path.mkdir(parents=True, exist_ok=True)
            with open(self.path / ".lock", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
                self._save_locked()

    def _save_locked(self) -> None:
        gen = uuid.uuid4().hex[:12]
        n, dim = len(self), self.dim or 0
        vecs = np.ascontiguousarray(self._vecs[:n]) if n else np.zeros((0, dim), dtype=np.float32)
        _write_atomic(self.path / f"vectors-{gen}.npy", lambda f: np.save(f, vecs, allow_pickle=False))
        lines = "".join(json.dumps(dataclasses.asdict(c), ensure_ascii=False) + "\n" for c in self._chunks)
        _write_atomic(self.path / f"chunks-{gen}.jsonl", lambda f: f.write(lines.encode("utf-8")))
        manifest = {"format": FORMAT, "generation": gen, "count": n, "dim": dim,
                    "embedding_model": self.embedding_model}
        _write_atomic(self.path / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
        for old in [*self.path.glob("vectors-*.npy"), *self.path.glob("chunks-*.jsonl")]:
            if old.name not in (f"vectors-{gen}.npy", f"chunks-{gen}.jsonl"):
                old.unlink(missing_ok=True)
