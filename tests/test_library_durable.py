"""The document library is durable and shared: several processes write one SQLite library without
losing each other's documents, a SIGKILL mid-add leaves every document whole or absent, and a server sees what
another process added without a restart."""

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from ragkv.bench.serve import ServerProcess, started_together
from ragkv.rag.catalog import DB_FILE, Catalog
from ragkv.rag.chunking import chunk_document
from ragkv.rag.documents import Document
from ragkv.rag.pipeline import Retriever
from tiny import default_model_available, make_tiny_served

needs_model = pytest.mark.skipif(not default_model_available(), reason="default model not converted")


class HashEmbedder:
    """Deterministic unit vectors from the text's hash: the library's bookkeeping without the MiniLM model."""
    name = "hash-embedder"

    def encode(self, texts):
        out = []
        for t in texts:
            v = np.random.default_rng(abs(hash(t)) % (2**32)).standard_normal(16).astype(np.float32)
            out.append(v / np.linalg.norm(v))
        return np.stack(out)


def words(text):
    return len(text.split())


def write_concurrently(a, b, per_writer: int) -> None:
    """Two libraries (replicas, or connections as two processes have) each add `per_writer` documents at the same
    time: doc0.. through `a`, doc100.. through `b`. Any writer's exception fails the test."""
    errors = []

    def write(r, start):
        try:
            for i in range(start, start + per_writer):
                r.ingest_documents([doc(i)], words)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=write, args=(a, 0)), threading.Thread(target=write, args=(b, 100))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors


def doc(i: int) -> Document:
    return Document.from_text(f"Document {i}. " + " ".join(f"word{i}x{j}" for j in range(900)), doc_id=f"doc{i}")


WRITER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from test_library_durable import HashEmbedder, doc, words
    from ragkv.rag.pipeline import Retriever
    r = Retriever({index!r}, embedder=HashEmbedder())
    print("ready", flush=True)
    for i in range(10_000):
        r.ingest_documents([doc(i)], words)
""")


def test_sigkill_mid_add_leaves_every_document_whole_or_absent(tmp_path):
    index = tmp_path / "index"
    Retriever(index, embedder=HashEmbedder())  # creates the database
    proc = subprocess.Popen([sys.executable, "-c", WRITER.format(tests=str(Path(__file__).parent),
                                                                   index=str(index))],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    deadline, watcher = time.monotonic() + 60, Catalog(index)
    while watcher.count("default") < 30 and time.monotonic() < deadline:  # mid-stream of adds
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    db = sqlite3.connect(index / DB_FILE)
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    catalog = Catalog(index)
    docs = catalog.documents("default")
    assert len(docs) >= 3
    for info in docs:  # every committed document has exactly its chunks, none half-written
        i = int(info.doc_id.removeprefix("doc"))
        assert info.chunks == len(chunk_document(doc(i), words)) > 1
    orphans = db.execute("SELECT COUNT(*) FROM chunks c LEFT JOIN documents d ON c.tenant = d.tenant AND "
                         "c.doc_id = d.doc_id WHERE d.doc_id IS NULL").fetchone()[0]
    assert orphans == 0
    again = Retriever(index, embedder=HashEmbedder())  # and the library keeps working
    again.ingest_documents([doc(99_999)], words)
    assert "doc99999" in {d.doc_id for d in again.documents()}


def test_two_writers_keep_each_others_documents_and_readers_see_them_at_once(tmp_path):
    a = Retriever(tmp_path / "index", embedder=HashEmbedder())
    b = Retriever(tmp_path / "index", embedder=HashEmbedder())  # another connection, as another process has
    write_concurrently(a, b, 10)
    expected = {f"doc{i}" for i in list(range(10)) + list(range(100, 110))}
    assert {d.doc_id for d in a.documents()} == {d.doc_id for d in b.documents()} == expected
    assert len(a.index) == len(b.index) == sum(d.chunks for d in a.documents())
    b.remove("doc3")
    assert "doc3" not in {c.doc_id for c in a.index.chunks()}  # a sees b's delete without reopening
    assert a.for_tenant("other").documents() == []


def _write_legacy_index(folder: Path, chunks, vectors, model: str) -> None:
    """A folder as the file-based index of earlier versions left it (ragkv.rag.legacy_index)."""
    import dataclasses
    import json

    np.save(folder / "vectors-g1.npy", np.asarray(vectors, dtype=np.float32))
    (folder / "chunks-g1.jsonl").write_text("".join(json.dumps(dataclasses.asdict(c)) + "\n" for c in chunks))
    (folder / "index.json").write_text(json.dumps({"format": 1, "generation": "g1", "count": len(chunks),
                                                   "dim": int(np.shape(vectors)[1]), "embedding_model": model}))


def test_legacy_index_folder_is_imported_once(tmp_path):
    chunks = chunk_document(doc(1), words)
    _write_legacy_index(tmp_path, chunks, HashEmbedder().encode([c.passage for c in chunks]), HashEmbedder.name)
    r = Retriever(tmp_path, embedder=HashEmbedder())
    assert [d.doc_id for d in r.documents()] == ["doc1"] and len(r.index) == len(chunks)


def test_unreadable_legacy_index_leaves_the_library_empty(tmp_path):
    chunks = chunk_document(doc(1), words)
    _write_legacy_index(tmp_path, chunks[:-1] if len(chunks) > 1 else [], HashEmbedder().encode(
        [c.passage for c in chunks]), HashEmbedder.name)  # fewer chunk records than vectors
    r = Retriever(tmp_path, embedder=HashEmbedder())
    assert r.documents() == [] and (tmp_path / "index.json").exists()  # the old files stay where they are


def test_a_different_embedding_model_is_refused(tmp_path):
    Catalog(tmp_path, embedding_model="m1")
    with pytest.raises(Exception, match="embedding model"):
        Catalog(tmp_path, embedding_model="m2")


def test_cli_ingest_and_two_servers_share_one_library(tmp_path):
    """Two real servers and `ragkv ingest` on one library folder (a tiny random model: the library, not the model,
    is under test; the embedder is the real one)."""
    env = dict(os.environ, RAGKV_CACHE_DIR=str(tmp_path))
    tiny = str(make_tiny_served(tmp_path))
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "harbour.md").write_text("# Lintwick Harbour\n\nThe harbour of Lintwick shelters forty fishing boats.")
    served = dict(model=tiny, dtype="float32", device="cpu", store="memory:256MiB", startup_s=180, cache_dir=tmp_path)
    with started_together([ServerProcess(**served), ServerProcess(**served)]) as (a, b):
        ingest = subprocess.Popen([sys.executable, "-m", "ragkv.cli", "ingest", str(docs), "--index",
                                   str(tmp_path / "index"), "--model", tiny, "--dtype", "float32", "--device", "cpu"],
                                  env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        r = httpx.post(a.url + "/v1/documents", timeout=120, json={"documents": [
            {"text": "Lintwick Tower was built in 1893 by Ada Morrow.", "id": "tower"}]})
        assert r.status_code == 200, r.text
        out, err = ingest.communicate(timeout=300)
        assert ingest.returncode == 0, err
        for server in (a, b):  # both documents, through either server, without a restart
            listed = httpx.get(server.url + "/v1/documents").json()["data"]
            assert "Lintwick Harbour" in {d["title"] for d in listed} and "tower" in {d["doc_id"] for d in listed}
        answer = httpx.post(b.url + "/v1/chat/completions", timeout=120, json={
            "max_tokens": 4, "messages": [{"role": "user", "content": "How many boats does the harbour shelter?"}],
            "ragkv": {"retrieval": {"top_k": 1}}}).json()
        assert answer["ragkv"]["sources"][0]["title"] == "Lintwick Harbour"
        assert httpx.delete(b.url + "/v1/documents/tower").status_code == 200
        assert "tower" not in {d["doc_id"] for d in httpx.get(a.url + "/v1/documents").json()["data"]}
