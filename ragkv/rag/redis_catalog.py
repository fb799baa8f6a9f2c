"""The document library in Redis or a Redis Cluster (`--library redis://...`): one library for every server.

The embedded SQLite library (ragkv.rag.catalog) is a file of one machine; replicas behind a load balancer need
the documents one of them was given to be retrievable through all the others. Here chunk texts and vectors live
in Redis, each tenant's keys under one hash tag, so that a cluster keeps them in one slot and one MULTI writes
them together:

    PREFIX{TENANT}:docs      hash doc_id -> JSON {title, source, added_at, chunks: [chunk ids, in order]}
    PREFIX{TENANT}:chunks    hash chunk_id -> JSON {doc_id, idx, title, text, source}
    PREFIX{TENANT}:vectors   hash chunk_id -> float32 unit vector bytes
    PREFIX{TENANT}:version   counter, incremented by every write of the tenant's documents
    PREFIX meta              hash: format, embedding_model
    PREFIX jobs              hash job id -> JSON record of an ingestion job (ragkv.rag.jobs)
    PREFIX job:ID:documents  JSON list of the documents job ID accepted, until it ends

A document is added or removed in one MULTI/EXEC (WATCHing the docs hash, retried when another writer got there
first), and a reader takes its snapshot in one MULTI, so it sees whole documents only. Each server keeps every
tenant's search matrix in memory and rebuilds it when the tenant's version moved: one GET per retrieval, so a
document added through one server is searched by the others at their next request.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from typing import Sequence

import numpy as np
import redis

from ragkv.rag.catalog_meta import FORMAT, CatalogError, check_meta
from ragkv.rag.chunking import Chunk
from ragkv.rag.index import DocumentInfo, VectorIndex
from ragkv.store.errors import StoreSpecError
from ragkv.store.redis_cluster import RedisClusterStore, cluster_client
from ragkv.store.redis_store import redact
from ragkv.store.spec import RedisClusterTierSpec, RedisTierSpec, parse_spec

DEFAULT_PREFIX = "ragkv:lib:"
ERRORS = RedisClusterStore.ERRORS  # a single node's and a cluster's failures alike
SYNTAX = "write redis://HOST:PORT/DB or redis+cluster://HOST:PORT[,HOST:PORT...], optionally with ?prefix=P"


class LibraryUnavailableError(CatalogError):
    """The library's Redis cannot be reached or failed a command; the message names it."""


def parse_library_url(text: str) -> tuple[str, str, bool]:
    """`--library` -> (URL for redis-py, key prefix, whether it is a cluster); hosts, ports and seed nodes are
    checked as the store spec checks a Redis tier's."""
    if "," in text and "+cluster://" not in text.lower():  # only a cluster lists several nodes
        raise CatalogError(f"--library {text!r} names no single Redis; {SYNTAX}")
    try:
        tiers = parse_spec(text).tiers
    except StoreSpecError as e:
        raise CatalogError(f"--library {text!r}: {e}") from None
    tier = tiers[0]
    if len(tiers) != 1 or not isinstance(tier, RedisTierSpec):
        raise CatalogError(f"--library {text!r} names no single Redis; {SYNTAX}")
    if tier.ttl_s or tier.cost is not None or getattr(tier, "kv", None):
        raise CatalogError(f"--library {text!r}: the library takes only ?prefix=P of ragkv's options (documents "
                           "never expire); remove ttl, cost and kv")
    return tier.url, tier.prefix if tier.prefix is not None else DEFAULT_PREFIX, isinstance(tier, RedisClusterTierSpec)


def _document(raw: bytes | None, where: str) -> dict | None:
    """A docs-hash record, validated (the library is read from Redis: refuse what ragkv did not write)."""
    if raw is None:
        return None
    try:
        record = json.loads(raw)
    except ValueError as e:
        record = e
    fields = {"title": str, "source": str, "added_at": (int, float), "chunks": list}
    if not (isinstance(record, dict) and all(isinstance(record.get(f), t) for f, t in fields.items())):
        raise CatalogError(f"document library entry {where} is corrupt (not ragkv's JSON record of a document); "
                           "remove that document and add it again")
    return record


class RedisCatalog:
    """Documents, chunks and vectors per tenant in Redis; the same methods as the embedded Catalog.

    Args:
        url: redis://[[user]:password@]HOST:PORT/DB or redis+cluster://HOST:PORT[,HOST:PORT...], with an
            optional ?prefix=P (several libraries in one Redis).
        embedding_model: recorded on first use; a library built with another model is refused.

    Raises:
        CatalogError: a malformed URL, or a library of another format or embedding model.
        LibraryUnavailableError: Redis cannot be reached.
    """

    def __init__(self, url: str, embedding_model: str | None = None, timeout_s: float = 5.0):
        self.folder = url  # where the library is, as Retriever.for_tenant passes it on (never a folder here)
        client_url, self.prefix, cluster = parse_library_url(url)
        self.where = redact(client_url) + (f"?prefix={self.prefix}" if self.prefix != DEFAULT_PREFIX else "")
        self.embedding_model = embedding_model
        self._cluster = cluster  # keys of several slots: no MULTI across them
        self._search: dict[str, tuple[int, VectorIndex]] = {}  # tenant -> (version, in-memory index)
        self._lock = threading.Lock()
        with self._reach("connect"):
            self.client = cluster_client(client_url, timeout_s) if cluster else redis.Redis.from_url(
                client_url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
            self._check_meta()

    @contextlib.contextmanager
    def _reach(self, what: str):
        try:
            yield
        except ERRORS as e:
            raise LibraryUnavailableError(f"the document library at {self.where} failed to {what} "
                                          f"({type(e).__name__}: {e}); is Redis running and reachable?") from e

    def _key(self, tenant: str, part: str) -> str:
        return f"{self.prefix}{{{tenant}}}:{part}"

    def _check_meta(self) -> None:
        meta_key = self.prefix + "meta"
        meta = {k.decode(): v.decode() for k, v in self.client.hgetall(meta_key).items()}
        check_meta(meta, self.where, self.embedding_model, "use another library (?prefix=P)")
        self.client.hsetnx(meta_key, "format", FORMAT)
        if self.embedding_model:
            self.client.hsetnx(meta_key, "embedding_model", self.embedding_model)
        self.embedding_model = self.embedding_model or meta.get("embedding_model")

    # -- reads ----------------------------------------------------------------------------------------------
    def _docs(self, tenant: str, raw: dict) -> list[tuple[str, dict]]:
        """(doc_id, record) of a docs hash, in the order they were added."""
        docs = [(k.decode(), _document(v, f"{self._key(tenant, 'docs')}[{k.decode()}]")) for k, v in raw.items()]
        return sorted(docs, key=lambda d: (d[1]["added_at"], d[0]))

    def index(self, tenant: str) -> VectorIndex:
        """The tenant's chunks and vectors for search, rebuilt when any server changed its documents."""
        with self._reach("read"):
            version = int(self.client.get(self._key(tenant, "version")) or 0)
        with self._lock:
            cached = self._search.get(tenant)
        if cached is not None and cached[0] == version:
            return cached[1]
        with self._reach("read"):
            pipe = self.client.pipeline(transaction=True)  # one snapshot: whole documents only
            pipe.get(self._key(tenant, "version"))
            for part in ("docs", "chunks", "vectors"):
                pipe.hgetall(self._key(tenant, part))
            version, docs, chunks, vectors = pipe.execute()
        rows = []
        for doc_id, record in self._docs(tenant, docs):
            for cid in record["chunks"]:
                meta, vector = chunks.get(cid.encode()), vectors.get(cid.encode())
                try:
                    m = json.loads(meta)
                    rows.append((cid, doc_id, m["title"], m["text"], int(m["idx"]), m["source"], vector))
                except (TypeError, ValueError, KeyError) as e:
                    raise CatalogError(f"document library {self.where}: chunk {cid} of {doc_id!r} is missing or "
                                       f"corrupt ({e}); remove that document and add it again") from None
        index = VectorIndex.from_rows(rows)
        with self._lock:
            self._search[tenant] = (int(version or 0), index)
        return index

    def chunk_ids(self, tenant: str) -> dict[str, set[str]]:
        """doc_id -> its chunk ids."""
        with self._reach("read"):
            raw = self.client.hgetall(self._key(tenant, "docs"))
        return {doc_id: set(record["chunks"]) for doc_id, record in self._docs(tenant, raw)}

    def vectors(self, tenant: str, chunk_ids: Sequence[str]) -> np.ndarray:
        if not chunk_ids:
            return np.zeros((0, 0), np.float32)
        with self._reach("read"):
            got = self.client.hmget(self._key(tenant, "vectors"), list(chunk_ids))
        missing = [c for c, v in zip(chunk_ids, got) if v is None]
        if missing:
            raise KeyError(f"chunks not in the library: {missing[:3]}")
        return np.stack([np.frombuffer(v, dtype=np.float32) for v in got])

    def documents(self, tenant: str) -> list[DocumentInfo]:
        with self._reach("read"):
            raw = self.client.hgetall(self._key(tenant, "docs"))
        return [DocumentInfo(doc_id, r["title"], r["source"], len(r["chunks"]))
                for doc_id, r in self._docs(tenant, raw)]

    def count(self, tenant: str) -> int:
        with self._reach("read"):
            return self.client.hlen(self._key(tenant, "chunks"))

    # -- writes: one MULTI/EXEC each ---------------------------------------------------------------------------
    def put_document(self, tenant: str, doc_id: str, title: str, source: str, chunks: Sequence[Chunk],
                     vectors: np.ndarray) -> None:
        """Add or replace a document with all its chunks and vectors, atomically."""
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if vectors.ndim != 2 or len(vectors) != len(chunks):
            raise ValueError(f"one vector per chunk: {len(chunks)} chunks, vectors {vectors.shape}")
        record = json.dumps({"title": title, "source": source, "added_at": time.time(),
                             "chunks": [c.chunk_id for c in chunks]})
        texts = {c.chunk_id: json.dumps({"doc_id": doc_id, "idx": c.index, "title": c.title, "text": c.text,
                                         "source": c.source}) for c in chunks}
        vecs = {c.chunk_id: v.tobytes() for c, v in zip(chunks, vectors)}
        docs, text_key, vector_key = (self._key(tenant, p) for p in ("docs", "chunks", "vectors"))

        def write(pipe):
            old = _document(pipe.hget(docs, doc_id), f"{docs}[{doc_id}]")
            stale = set(old["chunks"]) - set(texts) if old else set()
            pipe.multi()
            if stale:
                pipe.hdel(text_key, *stale)
                pipe.hdel(vector_key, *stale)
            if texts:
                pipe.hset(text_key, mapping=texts)
                pipe.hset(vector_key, mapping=vecs)
            pipe.hset(docs, doc_id, record)
            pipe.incr(self._key(tenant, "version"))

        with self._reach("add a document"):
            self.client.transaction(write, docs)

    def remove(self, tenant: str, doc_ids: Sequence[str]) -> int:
        """Delete documents (and their chunks); returns how many chunks went."""
        doc_ids = list(doc_ids)
        docs, text_key, vector_key = (self._key(tenant, p) for p in ("docs", "chunks", "vectors"))

        def delete(pipe) -> int:
            records = [_document(r, f"{docs}[{d}]") for d, r in zip(doc_ids, pipe.hmget(docs, doc_ids))] \
                if doc_ids else []
            gone = [cid for r in records if r for cid in r["chunks"]]
            pipe.multi()
            if doc_ids:
                pipe.hdel(docs, *doc_ids)
            if gone:
                pipe.hdel(text_key, *gone)
                pipe.hdel(vector_key, *gone)
            pipe.incr(self._key(tenant, "version"))
            return len(gone)

        with self._reach("remove documents"):
            return self.client.transaction(delete, docs, value_from_callable=True)

    # -- ingestion jobs (ragkv.rag.jobs) ---------------------------------------------------------------------
    def put_job(self, record: dict, documents: Sequence[dict] | None = None) -> None:
        with self._reach("write an ingestion job"):
            pipe = self.client.pipeline(transaction=documents is not None and not self._cluster)
            pipe.hset(self.prefix + "jobs", record["id"], json.dumps(record))
            if documents is not None:
                pipe.set(self._job_documents(record["id"]), json.dumps(list(documents)))
            pipe.execute()

    def claim_job(self, record: dict, owner_was: str) -> bool:
        jobs, claimed = self.prefix + "jobs", []

        def swap(pipe):
            raw = pipe.hget(jobs, record["id"])
            if raw is None or json.loads(raw).get("owner") != owner_was:
                return
            pipe.multi()
            pipe.hset(jobs, record["id"], json.dumps(record))
            claimed.append(True)

        with self._reach("claim an ingestion job"):
            self.client.transaction(swap, jobs)
        return bool(claimed)

    def get_job(self, job_id: str) -> dict | None:
        with self._reach("read an ingestion job"):
            raw = self.client.hget(self.prefix + "jobs", job_id)
        return None if raw is None else json.loads(raw)

    def jobs(self, states: Sequence[str]) -> list[dict]:
        with self._reach("read ingestion jobs"):
            raw = self.client.hgetall(self.prefix + "jobs")
        return [r for r in (json.loads(v) for v in raw.values()) if r.get("state") in states]

    def _job_documents(self, job_id: str) -> str:
        return f"{self.prefix}job:{job_id}:documents"

    def job_documents(self, job_id: str) -> list[dict]:
        with self._reach("read an ingestion job's documents"):
            raw = self.client.get(self._job_documents(job_id))
        return [] if raw is None else json.loads(raw)

    def drop_job_documents(self, job_id: str) -> None:
        with self._reach("drop an ingestion job's documents"):
            self.client.delete(self._job_documents(job_id))

    def prune_jobs(self, states: Sequence[str], before: float) -> int:
        old = [r["id"] for r in self.jobs(states) if r.get("updated_at", 0) < before]
        with self._reach("prune ingestion jobs"):
            for job_id in old:
                self.client.hdel(self.prefix + "jobs", job_id)
                self.client.delete(self._job_documents(job_id))
        return len(old)

    def close(self) -> None:
        self.client.close()
