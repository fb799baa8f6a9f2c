"""The durable document library: every tenant's documents, chunks and their vectors in one SQLite database.

Why SQLite (WAL mode): several processes (`ragkv ingest`, one or more servers) read and write one library. Each
document is added or replaced in one transaction, so a crash at any point leaves the state before or after that
document, never a mixture, and no process overwrites another's writes (the file-per-save index it replaces let
the last writer win). Readers see other processes' commits at once: the in-memory search matrix of a tenant is
rebuilt when `PRAGMA data_version` says the database changed.

Search stays an exact cosine product over a numpy matrix per tenant (ragkv.rag.index.VectorIndex, in memory):
thousands to tens of thousands of 384-dim vectors take milliseconds. A new library in a folder of the file-based
index of earlier versions imports its documents once (ragkv.rag.legacy_index).

Ingestion jobs live here too (ragkv.rag.jobs): each job's record and the documents it accepted, so that a job
survives the process that ran it.

This embedded library is the default; `open_catalog` opens the one in Redis (ragkv.rag.redis_catalog) instead when
given a Redis URL, so that several servers on several machines share one library.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from ragkv.rag.catalog_meta import FORMAT, CatalogError, check_meta
from ragkv.rag.chunking import Chunk
from ragkv.rag.index import DocumentInfo, VectorIndex
from ragkv.rag.legacy_index import has_legacy_index, read_legacy_index

DB_FILE = "library.sqlite3"
BUSY_TIMEOUT_MS = 30_000  # a writer waits this long for another process's transaction

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS documents (
    tenant TEXT NOT NULL, doc_id TEXT NOT NULL, title TEXT NOT NULL, source TEXT NOT NULL, added_at REAL NOT NULL,
    PRIMARY KEY (tenant, doc_id));
CREATE TABLE IF NOT EXISTS chunks (
    id INTEGER PRIMARY KEY, tenant TEXT NOT NULL, doc_id TEXT NOT NULL, chunk_id TEXT NOT NULL,
    idx INTEGER NOT NULL, title TEXT NOT NULL, text TEXT NOT NULL, source TEXT NOT NULL, vector BLOB NOT NULL,
    UNIQUE (tenant, chunk_id),
    FOREIGN KEY (tenant, doc_id) REFERENCES documents (tenant, doc_id) ON DELETE CASCADE);
CREATE INDEX IF NOT EXISTS chunks_by_doc ON chunks (tenant, doc_id);
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, state TEXT NOT NULL, owner TEXT NOT NULL, updated_at REAL NOT NULL,
    record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS job_documents (
    job_id TEXT NOT NULL, position INTEGER NOT NULL, document TEXT NOT NULL, PRIMARY KEY (job_id, position));
"""


LIBRARY_URL_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")


def is_library_url(location) -> bool:
    """Whether `location` names a shared library in Redis rather than a folder."""
    scheme, sep, _ = str(location).partition("://")
    return isinstance(location, str) and bool(sep) and scheme.lower() in LIBRARY_URL_SCHEMES


def library_exists(location: str | Path) -> bool:
    """Whether a library is (or may be) there already: a Redis URL, or a folder holding one (never created)."""
    return is_library_url(location) or (Path(location).expanduser() / DB_FILE).exists()


def open_catalog(location: str | Path, embedding_model: str | None = None):
    """The library at `location`: a folder (the embedded SQLite library) or a Redis URL (redis://HOST:PORT/DB,
    redis+cluster://HOST:PORT,...) that several servers share."""
    if is_library_url(location):
        from ragkv.rag.redis_catalog import RedisCatalog
        return RedisCatalog(str(location), embedding_model)
    return Catalog(location, embedding_model)


class Catalog:
    """Documents, chunks and vectors per tenant; safe to share between threads and processes."""

    def __init__(self, folder: str | Path, embedding_model: str | None = None):
        self.folder = Path(folder).expanduser()
        self.path = self.folder / DB_FILE
        self.embedding_model = embedding_model
        self._lock = threading.RLock()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fresh = not self.path.exists()
            self._db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000, check_same_thread=False,
                                       isolation_level=None)  # explicit BEGIN/COMMIT below
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")  # WAL: durable at checkpoints, never corrupt
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.executescript(SCHEMA)
        except sqlite3.DatabaseError as e:
            raise CatalogError(f"document library {self.path} is unusable ({e}); move it away and ingest your "
                               "documents again") from None
        self._check_meta()
        self._search: dict[str, tuple[int, VectorIndex]] = {}  # tenant -> (data version, in-memory index)
        self._writes = 0  # this connection's own commits (data_version only counts other connections')
        if fresh and has_legacy_index(self.folder):
            self._import_legacy()

    # -- set-up -------------------------------------------------------------------------------------------
    def _check_meta(self) -> None:
        with self._lock:
            meta = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
            check_meta(meta, str(self.path), self.embedding_model, "use another --index folder")
            stored = meta.get("embedding_model")
            self._db.execute("INSERT OR IGNORE INTO meta VALUES ('format', ?)", (FORMAT,))
            if self.embedding_model:
                self._db.execute("INSERT OR IGNORE INTO meta VALUES ('embedding_model', ?)", (self.embedding_model,))
            self.embedding_model = self.embedding_model or stored

    def _import_legacy(self, tenant: str = "default") -> None:
        """A folder written by the file-based index of earlier versions: its documents join tenant `default`
        (a one-off migration; unreadable old files leave the library empty and stay where they are)."""
        old = read_legacy_index(self.folder, self.embedding_model)
        if old is None:
            return
        by_doc: dict[str, list[int]] = {}
        for i, c in enumerate(old[0]):
            by_doc.setdefault(c.doc_id, []).append(i)
        for doc_id, rows in by_doc.items():
            chunks = [old[0][i] for i in rows]
            self.put_document(tenant, doc_id, chunks[0].title, chunks[0].source, chunks, old[1][rows])

    # -- reads ----------------------------------------------------------------------------------------------
    def _version(self) -> int:
        return self._db.execute("PRAGMA data_version").fetchone()[0] * 1_000_003 + self._writes

    def index(self, tenant: str) -> VectorIndex:
        """The tenant's chunks and vectors for search, rebuilt when any process changed the library."""
        with self._lock:
            version = self._version()
            cached = self._search.get(tenant)
            if cached is not None and cached[0] == version:
                return cached[1]
            rows = self._db.execute("SELECT chunk_id, doc_id, title, text, idx, source, vector FROM chunks "
                                    "WHERE tenant = ? ORDER BY id", (tenant,)).fetchall()
            index = VectorIndex.from_rows(rows)
            self._search[tenant] = (version, index)
            return index

    def chunk_ids(self, tenant: str) -> dict[str, set[str]]:
        """doc_id -> its chunk ids."""
        out: dict[str, set[str]] = {}
        with self._lock:
            for doc_id, chunk_id in self._db.execute("SELECT doc_id, chunk_id FROM chunks WHERE tenant = ?",
                                                     (tenant,)):
                out.setdefault(doc_id, set()).add(chunk_id)
        return out

    def vectors(self, tenant: str, chunk_ids: Sequence[str]) -> np.ndarray:
        with self._lock:
            got = dict(self._db.execute(
                f"SELECT chunk_id, vector FROM chunks WHERE tenant = ? AND chunk_id IN "
                f"({','.join('?' * len(chunk_ids))})", (tenant, *chunk_ids)).fetchall()) if chunk_ids else {}
        missing = [c for c in chunk_ids if c not in got]
        if missing:
            raise KeyError(f"chunks not in the library: {missing[:3]}")
        return np.stack([np.frombuffer(got[c], dtype=np.float32) for c in chunk_ids]) if chunk_ids else \
            np.zeros((0, 0), np.float32)

    def documents(self, tenant: str) -> list[DocumentInfo]:
        with self._lock:
            rows = self._db.execute(
                "SELECT d.doc_id, d.title, d.source, COUNT(c.id) FROM documents d LEFT JOIN chunks c "
                "ON c.tenant = d.tenant AND c.doc_id = d.doc_id WHERE d.tenant = ? GROUP BY d.doc_id "
                "ORDER BY d.added_at, d.doc_id", (tenant,)).fetchall()
        return [DocumentInfo(*r) for r in rows]

    def count(self, tenant: str) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM chunks WHERE tenant = ?", (tenant,)).fetchone()[0]

    # -- writes: one transaction each --------------------------------------------------------------------------
    def put_document(self, tenant: str, doc_id: str, title: str, source: str, chunks: Sequence[Chunk],
                     vectors: np.ndarray) -> None:
        """Add or replace a document with all its chunks and vectors, atomically."""
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if vectors.ndim != 2 or len(vectors) != len(chunks):
            raise ValueError(f"one vector per chunk: {len(chunks)} chunks, vectors {vectors.shape}")
        rows = [(tenant, doc_id, c.chunk_id, c.index, c.title, c.text, c.source, v.tobytes())
                for c, v in zip(chunks, vectors)]
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("DELETE FROM documents WHERE tenant = ? AND doc_id = ?", (tenant, doc_id))
                self._db.execute("INSERT INTO documents VALUES (?, ?, ?, ?, ?)",
                                 (tenant, doc_id, title, source, time.time()))
                self._db.executemany("INSERT OR REPLACE INTO chunks (tenant, doc_id, chunk_id, idx, title, text, "
                                     "source, vector) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._writes += 1

    def remove(self, tenant: str, doc_ids: Sequence[str]) -> int:
        """Delete documents (and their chunks); returns how many chunks went."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                n = 0
                for doc_id in doc_ids:
                    n += self._db.execute("SELECT COUNT(*) FROM chunks WHERE tenant = ? AND doc_id = ?",
                                          (tenant, doc_id)).fetchone()[0]
                    self._db.execute("DELETE FROM documents WHERE tenant = ? AND doc_id = ?", (tenant, doc_id))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._writes += 1
            return n

    # -- ingestion jobs (ragkv.rag.jobs): a record per job, and the documents it accepted until it ends ----------
    def put_job(self, record: dict, documents: Sequence[dict] | None = None) -> None:
        """Write a job's record (and, when given, the documents it accepted) in one transaction."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("INSERT OR REPLACE INTO jobs VALUES (?, ?, ?, ?, ?, ?)",
                                 (record["id"], record["tenant"], record["state"], record["owner"],
                                  record["updated_at"], json.dumps(record)))
                if documents is not None:
                    self._db.execute("DELETE FROM job_documents WHERE job_id = ?", (record["id"],))
                    self._db.executemany("INSERT INTO job_documents VALUES (?, ?, ?)",
                                         [(record["id"], i, json.dumps(d)) for i, d in enumerate(documents)])
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def claim_job(self, record: dict, owner_was: str) -> bool:
        """Write `record` only if the stored job still has owner `owner_was` (two servers never take one job)."""
        with self._lock:
            n = self._db.execute("UPDATE jobs SET state = ?, owner = ?, updated_at = ?, record = ? WHERE id = ? "
                                 "AND owner = ?", (record["state"], record["owner"], record["updated_at"],
                                                   json.dumps(record), record["id"], owner_was)).rowcount
            return n == 1

    def get_job(self, job_id: str) -> dict | None:
        with self._lock:
            row = self._db.execute("SELECT record FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else json.loads(row[0])

    def jobs(self, states: Sequence[str]) -> list[dict]:
        with self._lock:
            rows = self._db.execute(f"SELECT record FROM jobs WHERE state IN ({','.join('?' * len(states))})",
                                    tuple(states)).fetchall()
        return [json.loads(r[0]) for r in rows]

    def job_documents(self, job_id: str) -> list[dict]:
        with self._lock:
            rows = self._db.execute("SELECT document FROM job_documents WHERE job_id = ? ORDER BY position",
                                    (job_id,)).fetchall()
        return [json.loads(r[0]) for r in rows]

    def drop_job_documents(self, job_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM job_documents WHERE job_id = ?", (job_id,))

    def prune_jobs(self, states: Sequence[str], before: float) -> int:
        """Delete the records of jobs in `states` last updated before `before`; returns how many went."""
        with self._lock:
            ids = [r[0] for r in self._db.execute(
                f"SELECT id FROM jobs WHERE updated_at < ? AND state IN ({','.join('?' * len(states))})",
                (before, *states))]
            for job_id in ids:
                self._db.execute("DELETE FROM job_documents WHERE job_id = ?", (job_id,))
                self._db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
            return len(ids)

    def close(self) -> None:
        with self._lock:
            self._db.close()
