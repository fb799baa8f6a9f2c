"""The official `openai` client against real `ragkv serve` processes on 127.0.0.1 (default model, fp32)."""

import http.client
import threading
import time
from pathlib import Path

import httpx
import pytest

from ragkv.bench.serve import ServerProcess as BenchServerProcess
from tiny import default_model_available

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(not default_model_available(), reason="default model not converted")]
openai = pytest.importorskip("openai")

DOCS = [{"title": "Alpaca Farm", "text": "The Alpaca Farm in Lintwick keeps forty-two alpacas named after rivers."},
        {"title": "Lintwick Tower", "text": "Lintwick Tower was built in 1893 from red sandstone by Ada Morrow."}]
QUESTION = "Who built Lintwick Tower?"


class ServerProcess(BenchServerProcess):
    """A started `ragkv serve` with its cache folder in `tmp` (so a restart or a second server can share it)."""

    def __init__(self, tmp: Path, store: str, extra=()):
        super().__init__(dtype="float32", device="cpu", store=store, startup_s=120, cache_dir=tmp,
                         extra=tuple(extra))
        self.__enter__()
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def stop(self):
        self.__exit__()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("serve")


@pytest.fixture(scope="module")
def server(workdir):
    s = ServerProcess(workdir, f"memory:512MiB,disk:{workdir}/kv:2GiB")
    yield s
    s.stop()


def ask_docs(client, mode="reuse", stream=False, max_tokens=12, **kw):
    return client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": QUESTION}], max_tokens=max_tokens, stream=stream,
        extra_body={"ragkv": {"mode": mode, "documents": DOCS, **kw}})


def test_models_and_plain_chat(server):
    assert [m.id for m in server.client.models.list()] == ["smollm2"]
    r = server.client.chat.completions.create(model="smollm2", max_tokens=8,
                                              messages=[{"role": "user", "content": "Say hello."}])
    assert r.choices[0].message.content and r.usage.completion_tokens > 0
    assert r.usage.prompt_tokens > 0 and r.choices[0].finish_reason in ("stop", "length")


def test_stream_equals_non_stream_with_inline_documents(server):
    whole = ask_docs(server.client, mode="blend")
    pieces = [c.choices[0].delta.content or "" for c in ask_docs(server.client, mode="blend", stream=True)
              if c.choices]
    assert "".join(pieces) == whole.choices[0].message.content
    extra = whole.model_extra["ragkv"]["stats"]
    assert extra["mode"] == "blend" and whole.usage.model_extra["reused_tokens"] > 0


def test_health_counts_the_pooled_blocks_that_shared_requests_read(server):
    before = httpx.get(server.url + "/health").json()["block_pool_bytes"]
    ask_docs(server.client, mode="reuse", max_tokens=2, kv_layout="shared",  # a block no other test pools
             documents=["The pooled-block passage: Lintwick has twelve bridges over the Mardle."])
    health = httpx.get(server.url + "/health").json()
    assert health["block_pool_bytes"] > before >= 0 and health["kv_bytes_in_use"] >= 0


def test_completions_endpoint(server):
    r = server.client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=5)
    assert r.choices[0].text and r.usage.completion_tokens <= 5


def test_an_idle_connection_outlives_the_clients_own_expiry(server):
    """A connection idle for longer than httpx's 5 s expiry is still open: the server never closes one at the
    instant a client reuses it (with uvicorn's 5 s, requests met "Server disconnected without sending a response")."""
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("GET", "/health")
        assert conn.getresponse().read() and conn.sock is not None
        first = conn.sock
        time.sleep(5.5)
        conn.request("GET", "/health")  # on the same socket: a closed one raises RemoteDisconnected here
        assert conn.sock is first and conn.getresponse().status == 200
    finally:
        conn.close()


def test_documents_and_retrieval(server):
    resp = httpx.post(server.url + "/v1/documents", json={"documents": [{**d, "id": d["title"]} for d in DOCS]},
                      timeout=120)
    assert resp.status_code == 200 and resp.json()["added_chunks"] == 2
    listed = httpx.get(server.url + "/v1/documents").json()["data"]
    assert {d["doc_id"] for d in listed} >= {"Alpaca Farm", "Lintwick Tower"}
    r = server.client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": QUESTION}], max_tokens=12,
        extra_body={"ragkv": {"retrieval": {"top_k": 1}}})
    sources = r.model_extra["ragkv"]["sources"]
    assert sources[0]["doc_id"] == "Lintwick Tower"
    assert r.model_extra["ragkv"]["stats"]["cache_misses"] == 0  # precomputed when the document was added
    assert httpx.delete(server.url + "/v1/documents/Alpaca%20Farm").status_code == 200
    assert httpx.delete(server.url + "/v1/documents/Alpaca%20Farm").status_code == 404


def test_retrieved_passages_go_best_last_by_default_and_every_reply_states_its_fidelity(server):
    """Block-Attention 3.2: ascending relevance, the best chunk next to the question; best-first on request."""
    httpx.post(server.url + "/v1/documents", json={"documents": [{**d, "id": d["title"]} for d in DOCS]},
               timeout=120).raise_for_status()

    def ask(**retrieval):
        return server.client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": QUESTION}], max_tokens=2,
            extra_body={"ragkv": {"mode": "blend", "select": "query", "retrieval": {"top_k": 2, **retrieval}}})

    default, first = ask(), ask(order="best-first")
    scores = [s["score"] for s in default.model_extra["ragkv"]["sources"]]
    assert scores == sorted(scores) and scores[-1] > scores[0]
    assert [s["doc_id"] for s in first.model_extra["ragkv"]["sources"]] == \
        [s["doc_id"] for s in reversed(default.model_extra["ragkv"]["sources"])]
    fidelity = default.usage.model_extra["fidelity"]
    assert fidelity["mode"] == "blend" and fidelity["select"] == "query" and fidelity["exact"] is False
    assert fidelity["signal"] is not None and fidelity["signal"] >= 0
    full = server.client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": QUESTION}], max_tokens=2,
        extra_body={"ragkv": {"mode": "full", "retrieval": {"top_k": 2}}})
    assert full.usage.model_extra["fidelity"] == {"mode": "full", "exact": True}


@pytest.mark.parametrize("body,status,code", [
    (b"{not json", 400, None),
    (b'{"model": "smollm2"}', 400, None),
    (b'{"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}', 404, "model_not_found"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "ragkv": {"mode": "warp", "documents": ["a"]}}', 400, None),
    (b'{"messages": [{"role": "user", "content": "hi"}], "ragkv": {"ratio": 3, "mode": "blend", "documents": ["a"]}}',
     400, None),
])
def test_malformed_requests_get_openai_errors(server, body, status, code):
    r = httpx.post(server.url + "/v1/chat/completions", content=body, timeout=60)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["code"] == code


def test_overlong_prompt_is_refused_and_server_keeps_serving(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.client.chat.completions.create(model="smollm2", max_tokens=4,
                                              messages=[{"role": "user", "content": "word " * 9000}])
    assert e.value.body["code"] == "context_length_exceeded" and "8192" in e.value.body["message"]
    assert server.client.chat.completions.create(model="smollm2", max_tokens=2,
                                                 messages=[{"role": "user", "content": "Hi"}]).choices


def test_sixteen_concurrent_clients_get_the_answers_each_gets_alone(server):
    """Batched with 15 others (decode rows together, prefills in units beside them), each greedy answer is the one
    its request gets alone (the rows' sums may differ in the last bits: 4 greedy tokens of a real model do not)."""
    modes = ("reuse", "blend", "ape", "full")
    alone = {m: ask_docs(server.client, mode=m, max_tokens=4).choices[0].message.content for m in modes}
    results, errors = {}, []

    def one(i):
        try:
            r = ask_docs(server.client, mode=modes[i % 4], max_tokens=4)
            results[i] = r.choices[0].message.content
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    [t.start() for t in threads]
    [t.join(timeout=300) for t in threads]
    assert not errors and len(results) == 16
    assert {i: results[i] for i in range(16)} == {i: alone[modes[i % 4]] for i in range(16)}


def completion_tokens(server) -> int:
    text = httpx.get(server.url + "/metrics").text
    return int(float(next(line.split()[1] for line in text.splitlines()  # prometheus-client writes "16.0"
                          if line.startswith("ragkv_completion_tokens_total"))))


def test_disconnect_mid_stream_frees_the_model(server):
    before = completion_tokens(server)
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60, json={
            "model": "smollm2", "stream": True, "max_tokens": 400,
            "messages": [{"role": "user", "content": "Write a very long story about a lighthouse."}]}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 6:
                break  # the client goes away
    r2 = server.client.chat.completions.create(model="smollm2", max_tokens=2,
                                               messages=[{"role": "user", "content": "Hi"}])
    assert r2.choices
    assert completion_tokens(server) - before < 100  # the abandoned stream stopped long before 400 tokens


def test_concurrent_requests_are_batched_and_answer_as_alone(server):
    """Continuous batching: four different requests decoded together give each one's solo answer (greedy)."""
    modes = ("reuse", "full", "blend", "ape")
    alone = [ask_docs(server.client, mode=m, max_tokens=16).choices[0].message.content for m in modes]
    before = httpx.get(server.url + "/health").json()
    together = [None] * 4

    def one(i):
        together[i] = ask_docs(server.client, mode=modes[i], max_tokens=16).choices[0].message.content

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join(timeout=300) for t in threads]
    after = httpx.get(server.url + "/health").json()
    assert together == alone
    steps = after["decode_steps"] - before["decode_steps"]
    assert 0 < steps < 4 * 15  # fewer forwards than decoding the four one after another


def test_non_streamed_client_that_leaves_frees_its_slot(server):
    before = completion_tokens(server)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/chat/completions", timeout=2.0, json={
            "model": "smollm2", "max_tokens": 2000,
            "messages": [{"role": "user", "content": "Write a very long story about a lighthouse."}]})
    r2 = server.client.chat.completions.create(model="smollm2", max_tokens=2,
                                               messages=[{"role": "user", "content": "Hi"}])
    assert r2.choices
    # the server sees the client gone at its next disconnect poll: the slot is free within seconds, not at 2000 tokens
    deadline = time.monotonic() + 30
    while httpx.get(server.url + "/health").json()["batch_size"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert httpx.get(server.url + "/health").json()["batch_size"] == 0
    assert completion_tokens(server) - before < 400  # the abandoned request stopped long before 2000 tokens


def test_restarted_server_hits_the_disk_cache(workdir, server):
    ask_docs(server.client, mode="reuse")  # computed (or already there) and written through to disk
    again = ServerProcess(workdir, f"memory:512MiB,disk:{workdir}/kv:2GiB")
    try:
        stats = ask_docs(again.client, mode="reuse").model_extra["ragkv"]["stats"]
        assert stats["cache_misses"] == 0 and stats["cache_hits"] == 3  # prefix + 2 passages
    finally:
        again.stop()


@pytest.mark.redis
def test_two_servers_share_the_redis_tier(tmp_path, redis_server):  # noqa: F811
    a = ServerProcess(tmp_path, f"memory:256MiB,{redis_server}")
    try:
        first = ask_docs(a.client, mode="blend").model_extra["ragkv"]["stats"]
        assert first["cache_misses"] == 3
    finally:
        a.stop()
    (tmp_path / "b").mkdir()
    b = ServerProcess(tmp_path / "b", f"memory:256MiB,{redis_server}")
    try:
        second = ask_docs(b.client, mode="blend").model_extra["ragkv"]["stats"]
        assert second["cache_misses"] == 0 and second["cache_hits"] == 3
    finally:
        b.stop()
