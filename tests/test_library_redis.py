"""The document library shared by replicas: a library in Redis or a Redis Cluster (`--library`) that
several servers read and write, each document whole or absent, tenants isolated as in the embedded library, and a
document added through one `ragkv serve` retrievable through another within a second."""

import argparse
import os
import subprocess
import sys
import time

import httpx
import pytest
import redis

from ragkv.bench.serve import ServerProcess, started_together
from ragkv.cli import main
from ragkv.cli.common import library_location
from ragkv.errors import InvalidRequestError
from ragkv.rag.catalog import CatalogError, open_catalog
from ragkv.rag.documents import Document
from ragkv.rag.pipeline import Retriever
from ragkv.rag.redis_catalog import DEFAULT_PREFIX, LibraryUnavailableError, RedisCatalog
from ragkv.store.redis_server import private_redis
from redis_cluster_fixture import empty, redis_cluster  # noqa: F401
from redis_fixture import free_port
from test_library_durable import HashEmbedder, doc, words, write_concurrently
from tiny import make_tiny_served

pytestmark = pytest.mark.redis


@pytest.fixture(params=["redis", "cluster"])
def library_url(request):
    """An empty shared library: a single Redis node, then a Redis Cluster."""
    if request.param == "redis":
        return request.getfixturevalue("redis_url")
    return empty(request.getfixturevalue("redis_cluster"))


def replica(url: str) -> Retriever:
    """What one server holds: its own connection to the shared library."""
    return Retriever(url, HashEmbedder(), catalog=open_catalog(url, HashEmbedder.name))


def doc_ids(r: Retriever) -> set[str]:
    return {d.doc_id for d in r.documents()}


def test_replicas_see_each_others_adds_edits_and_removals_at_once(library_url):
    a, b = replica(library_url), replica(library_url)
    assert isinstance(a.catalog, RedisCatalog)
    a.ingest_documents([doc(1), doc(2)], words)
    assert doc_ids(b) == {"doc1", "doc2"} and len(b.index) == sum(d.chunks for d in a.documents())
    wanted = a.index.chunks("doc1")[1]
    assert [c.chunk_id for c, _ in b.retrieve(wanted.passage, 1)] == [wanted.chunk_id]  # the same vector
    edited = Document.from_text("Document 1, edited. " + " ".join(f"new{j}" for j in range(300)), doc_id="doc1")
    report = b.ingest_documents([edited], words)
    assert report.chunks_removed > 0
    assert {c.text for c in a.index.chunks("doc1")} == {c.text for c in b.index.chunks("doc1")}
    assert all("word1x" not in c.text for c in a.index.chunks())  # the stale chunks went with the edit
    assert a.remove("doc2") > 0 and doc_ids(b) == {"doc1"} and not b.index.chunks("doc2")


def test_tenants_are_isolated_across_replicas(library_url):
    a, b = replica(library_url), replica(library_url)
    a.for_tenant("alice").ingest_documents([doc(1)], words)
    b.for_tenant("bob").ingest_documents([doc(2)], words)
    assert doc_ids(b.for_tenant("alice")) == {"doc1"} and doc_ids(a.for_tenant("bob")) == {"doc2"}
    assert a.documents() == [] and len(a.index) == 0  # tenant default
    assert {c.doc_id for c, _ in b.for_tenant("bob").retrieve(doc(1).text, 5)} == {"doc2"}
    assert b.for_tenant("bob").remove("doc1") == 0 and doc_ids(a.for_tenant("alice")) == {"doc1"}


def test_concurrent_writers_keep_each_others_documents(library_url):
    a, b = replica(library_url), replica(library_url)
    write_concurrently(a, b, 6)
    expected = {f"doc{i}" for i in list(range(6)) + list(range(100, 106))}
    assert doc_ids(a) == doc_ids(b) == expected
    assert len(a.index) == len(b.index) == a.catalog.count("default") == sum(d.chunks for d in b.documents())


def test_another_embedding_model_is_refused(library_url):
    RedisCatalog(library_url, embedding_model="m1")
    with pytest.raises(CatalogError, match="embedding model"):
        RedisCatalog(library_url, embedding_model="m2")
    RedisCatalog(library_url + "?prefix=other:", embedding_model="m2")  # another library in the same Redis


def test_a_corrupt_record_is_a_clear_error(redis_url):  # noqa: F811
    r = replica(redis_url)
    r.ingest_documents([doc(1)], words)
    redis.Redis.from_url(redis_url).hset(DEFAULT_PREFIX + "{default}:docs", "doc1", b"not json")
    with pytest.raises(CatalogError, match="corrupt"):
        replica(redis_url).documents()


def test_unreachable_or_failing_redis_is_a_library_error(tmp_path):
    with pytest.raises(LibraryUnavailableError, match="is Redis running"):
        RedisCatalog(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5)
    with private_redis(tmp_path) as url:
        r = replica(url)
        r.ingest_documents([doc(1)], words)
    with pytest.raises(LibraryUnavailableError):  # redis-server is gone now
        r.retrieve("word1x5")


@pytest.mark.parametrize("bad, says", [("http://host:1", "Redis URL"), ("redis://host:1/0?ttl=5", "only [?]prefix"),
                                       ("redis+cluster://host", "HOST:PORT"), ("redis://:1/0", "no host"),
                                       ("redis://h:1/0,memory:1GiB", "single Redis")])
def test_bad_library_flags_are_refused_naming_the_flag(bad, says):
    with pytest.raises(InvalidRequestError, match=says) as err:
        library_location(argparse.Namespace(library=bad, index="unused"))
    assert "--library" in str(err.value)


@pytest.mark.parametrize("command", [["serve"], ["ingest", "docs"], ["ask", "what?"]])
def test_commands_refuse_a_bad_library_before_loading_the_model(capsys, command):
    code = main([*command, "--model", "/no/such/model", "--library", "redis://h:1/0?ttl=5"])
    err = capsys.readouterr().err
    assert code == 2 and "--library" in err and "/no/such/model" not in err, err


def test_two_servers_share_one_library_through_redis(tmp_path, redis_url):  # noqa: F811
    """Two real servers share a Redis library (a tiny random model: the library is under test, the embedder is
    the real one): documents added through one are found through the other at once, tenants stay apart."""
    tiny = str(make_tiny_served(tmp_path))
    keys = ("--api-key", "key-alice:alice", "--api-key", "key-bob0:bob", "--api-key", "key-default:default")
    alice, bob, default = ({"Authorization": f"Bearer {k}"} for k in ("key-alice", "key-bob0", "key-default"))
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "harbour.md").write_text("# Lintwick Harbour\n\nThe harbour of Lintwick shelters forty fishing boats.")
    # each server its own cache folder (and so its own embedded index): what they share is the Redis library
    servers = []
    for name in "ab":
        (tmp_path / name).mkdir()
        servers.append(ServerProcess(model=tiny, dtype="float32", device="cpu", store="memory:256MiB", startup_s=240,
                                     cache_dir=tmp_path / name, extra=("--library", redis_url, *keys)))
    with started_together(servers) as (a, b):
        question = {"query": "Who built Lintwick Tower?", "top_k": 1}
        # B searches alice's (empty) library first: its embedder is loaded and its in-memory index built
        assert httpx.post(b.url + "/v1/retrieve", headers=alice, timeout=120, json=question).json()["data"] == []
        # the first job waits for the server's start-up profiling (a few recomputes) and the embedder
        r = httpx.post(a.url + "/v1/documents", headers=alice, timeout=600, json={"documents": [
            {"text": "Lintwick Tower was built in 1893 by Ada Morrow.", "id": "tower", "title": "Lintwick Tower"}]})
        assert r.status_code == 200, r.text
        added = time.monotonic()
        found = httpx.post(b.url + "/v1/retrieve", headers=alice, timeout=30, json=question).json()["data"]
        assert time.monotonic() - added < 1.0 and [d["doc_id"] for d in found] == ["tower"]
        answer = httpx.post(b.url + "/v1/chat/completions", headers=alice, timeout=300, json={
            "max_tokens": 2, "messages": [{"role": "user", "content": "Who built Lintwick Tower?"}],
            "ragkv": {"retrieval": {"top_k": 1}}}).json()
        assert answer["ragkv"]["sources"][0]["title"] == "Lintwick Tower"
        for server in (a, b):  # bob sees none of alice's documents, through either server
            assert httpx.get(server.url + "/v1/documents", headers=bob).json()["data"] == []
            assert all(d["doc_id"] != "tower" for d in httpx.post(
                server.url + "/v1/retrieve", headers=bob, timeout=60, json={"query": "Lintwick Tower"}).json()["data"])
        ingest = subprocess.run([sys.executable, "-m", "ragkv.cli", "ingest", str(docs), "--library", redis_url,
                                 "--model", tiny, "--dtype", "float32", "--device", "cpu", "--store", "memory:256MiB"],
                                env=dict(os.environ, RAGKV_CACHE_DIR=str(tmp_path / "cli")), capture_output=True,
                                text=True, timeout=600)
        assert ingest.returncode == 0, ingest.stderr
        listed = httpx.get(b.url + "/v1/documents", headers=default).json()["data"]
        assert [d["title"] for d in listed] == ["Lintwick Harbour"]  # `ragkv ingest --library`: tenant default
        assert httpx.delete(b.url + "/v1/documents/tower", headers=alice).status_code == 200
        assert httpx.get(a.url + "/v1/documents", headers=alice).json()["data"] == []
