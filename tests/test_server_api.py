"""Answers that match the API, jobs that survive a restart, a store that starts degraded and metrics that tell the
truth, each through a real HTTP client against the real app (uvicorn on 127.0.0.1, in this
process, over the default model loaded once; one test starts `ragkv serve` itself)."""

import contextlib
import errno
import json
import os
import socket
import shutil
import subprocess
import tempfile
import threading
import time
import unicodedata

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ragkv.net import free_port
from ragkv.rag.catalog import Catalog
from ragkv.rag.jobs import INTERRUPTED, MAX_RESUMES, JobBook
from ragkv.serve.app import create_app
from ragkv.serve.server import Server
from ragkv.store.spec import open_store
from tiny import default_model_available, make_tiny_served

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(not default_model_available(), reason="default model not converted")]

DOCS = ["Lintwick Tower was built in 1893 from red sandstone by Ada Morrow.",
        "The Alpaca Farm in Lintwick keeps forty-two alpacas named after rivers."]


@contextlib.contextmanager
def serving(server: Server):
    """`server`'s app behind uvicorn on 127.0.0.1: its base URL while the block runs."""
    import uvicorn

    http = uvicorn.Server(uvicorn.Config(create_app(server), host="127.0.0.1", port=free_port(),
                                         log_level="warning"))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not http.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{http.config.port}"
    finally:
        http.should_exit = True
        thread.join(timeout=10)


def make_server(engine, store_spec="memory:256MiB", index_dir=None, worker_thread=True, **kw) -> Server:
    return Server(engine.with_store(open_store(store_spec, must_reach=False)), "smollm2", index_dir,
                  max_batch=4, worker_thread=worker_thread, **kw)


@pytest.fixture(scope="module")
def api(default_engine, tmp_path_factory):
    server = make_server(default_engine, index_dir=tmp_path_factory.mktemp("api-index"))
    with serving(server) as url:
        yield url
    server.scheduler.stop()


def post(url, path, body, timeout=300):
    return httpx.post(url + path, json=body, timeout=timeout)


# -- completions as the API defines them ------------------------------------------------------------------------
PROMPTS = ["The capital of France is", " Once upon a time"]


def test_a_list_of_prompts_answers_one_choice_per_prompt_with_n_each(api):
    alone = [post(api, "/v1/completions", {"prompt": p, "max_tokens": 4}).json()["choices"][0]["text"]
             for p in PROMPTS]
    r = post(api, "/v1/completions", {"prompt": PROMPTS, "max_tokens": 4, "n": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    # index = prompt index * n + choice, as OpenAI and vLLM number them; greedy: each prompt's own answer
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == [alone[0], alone[0], alone[1], alone[1]]
    assert 0 < body["usage"]["completion_tokens"] <= 4 * 4
    assert len(body["ragkv"]["prompts"]) == 2
    single = post(api, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 4}).json()
    assert body["usage"]["prompt_tokens"] > single["usage"]["prompt_tokens"]
    streamed: dict[int, str] = {}
    with httpx.stream("POST", api + "/v1/completions", timeout=300,
                      json={"prompt": PROMPTS, "max_tokens": 4, "n": 2, "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed[c["index"]] = streamed.get(c["index"], "") + c["text"]
    assert streamed == {i: c["text"] for i, c in enumerate(body["choices"])}


def test_token_id_prompts_work_and_wrong_shapes_say_what_prompt_takes(api):
    ids = httpx.post(api + "/tokenize", json={"prompt": PROMPTS[0]}).json()["tokens"]
    text = post(api, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 4}).json()["choices"][0]["text"]
    r = post(api, "/v1/completions", {"prompt": ids, "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == text and len(r.json()["choices"]) == 1
    two = post(api, "/v1/completions", {"prompt": [ids, ids], "max_tokens": 4}).json()
    assert [c["text"] for c in two["choices"]] == [text, text]
    for bad in ([1.5, 2], {"a": 1}, [["x"], [1]], [True, 3]):
        err = post(api, "/v1/completions", {"prompt": bad, "max_tokens": 1})
        assert err.status_code == 400, (bad, err.text)
        e = err.json()["error"]
        assert e["param"] == "prompt" and "token ids" in e["message"] and "valid string" not in e["message"], e
    e = post(api, "/v1/completions", {"prompt": [10 ** 9], "max_tokens": 1}).json()["error"]
    assert e["param"] == "prompt" and "vocabulary" in e["message"]
    e = post(api, "/v1/completions", {"prompt": ids, "max_tokens": 1, "documents": DOCS}).json()["error"]
    assert e["param"] == "prompt" and "as text" in e["message"]


def test_max_completion_tokens_wins_over_max_tokens_even_at_zero(api):
    def chat(**kw):
        r = post(api, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell a story."}], **kw})
        assert r.status_code == 200, r.text
        return r.json()

    zero = chat(max_tokens=6, max_completion_tokens=0)
    # 0 means what max_tokens 0 means: the prompt is read, no token is generated, the choice ends for its length
    assert zero["usage"]["completion_tokens"] == 0 and zero["choices"][0]["message"]["content"] == ""
    assert zero["choices"][0]["finish_reason"] == "length"
    assert chat(max_tokens=0)["usage"]["completion_tokens"] == 0
    assert chat(max_tokens=8, max_completion_tokens=2)["usage"]["completion_tokens"] == 2
    assert chat(max_tokens=2, max_completion_tokens=5)["usage"]["completion_tokens"] == 5


def sse_events(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=300) as s:
        assert s.status_code == 200, s.read()
        return [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]


def test_a_required_call_whose_argument_holds_the_closing_tag_comes_back_as_a_call_streamed_too(api):
    """The call block is read by a JSON decoder (serve/tools.py): a `</tool_call>` inside an argument's string does
    not end it, so the forced call is a tool call, never text with finish_reason "stop"."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"const": "]</tool_call>x"}}, "required": ["city"]}}}
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [tool], "tool_choice": "required",
            "max_tokens": 60}
    r = post(api, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
    assert [json.loads(c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == \
           [{"city": "]</tool_call>x"}]
    events = sse_events(api, "/v1/chat/completions", body)
    calls = [c for e in events for ch in e["choices"] for c in ch["delta"].get("tool_calls") or []]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "]</tool_call>x"}], events
    assert [ch["finish_reason"] for e in events for ch in e["choices"] if ch["finish_reason"]] == ["tool_calls"]


def test_every_error_is_in_the_api_error_format(api):
    def error_of(r, status):
        assert r.status_code == status, r.text
        body = r.json()
        assert set(body) == {"error"} and body["error"]["message"] and body["error"]["type"], body
        return body["error"]

    e = error_of(httpx.get(api + "/v1/nothing"), 404)
    assert e["code"] == "not_found" and "/v1/nothing" in e["message"]
    r = httpx.get(api + "/v1/chat/completions")
    e = error_of(r, 405)
    assert e["code"] == "method_not_allowed" and "POST" in e["message"] and r.headers["allow"] == "POST"
    error_of(httpx.put(api + "/v1/documents/jobs", json={}), 405)
    error_of(httpx.get(api + "/v1/documents/jobs/ingest-nope"), 404)
    listed = httpx.get(api + "/v1/documents/jobs")  # the tenant's jobs: a list now, not a 405
    assert listed.status_code == 200 and listed.json()["object"] == "list"


# -- ids users can trust ------------------------------------------------------------------------------------------
def test_document_ids_are_nfc_refuse_invisible_characters_and_errors_name_the_document(api):
    nfc, nfd = unicodedata.normalize("NFC", "café-notes"), unicodedata.normalize("NFD", "café-notes")
    assert nfc != nfd
    for text, doc_id in ((DOCS[0], nfc), (DOCS[1], nfd)):
        r = post(api, "/v1/documents", {"documents": [{"text": text, "id": doc_id}]})
        assert r.status_code == 200, r.text
    ids = [d["doc_id"] for d in httpx.get(api + "/v1/documents").json()["data"]]
    assert ids.count(nfc) == 1 and nfd not in ids  # one document, the second version replaced the first

    r = post(api, "/v1/documents", {"documents": [{"text": "x", "id": "ok"}, {"text": "y", "id": "a\u200bb"}]})
    assert r.status_code == 400
    e = r.json()["error"]
    assert e["param"] == "documents[1].id" and "U+200B" in e["message"] and "ZERO WIDTH SPACE" in e["message"]
    e = post(api, "/v1/documents", {"documents": [{"text": "x", "id": "rtl\u202eid"}]}).json()["error"]
    assert e["param"] == "documents[0].id" and "U+202E" in e["message"]

    r = post(api, "/v1/documents", {"documents": [{"text": "x", "id": "a"}, {"text": "y"},
                                                  {"text": "  ", "id": "the-empty-one"}]})
    assert r.status_code == 400
    e = r.json()["error"]
    assert e["param"] == "documents[2].text" and "the-empty-one" in e["message"] and "api" not in e["message"]

    # a delete by either spelling finds the one document
    assert httpx.delete(api + f"/v1/documents/{nfd}", timeout=60).json()["deleted"]
    assert nfc not in [d["doc_id"] for d in httpx.get(api + "/v1/documents").json()["data"]]


def test_hostile_values_get_a_400_naming_the_field_never_a_500(api):
    """What the hostile probe found: a 5,000-digit seed, a boolean for a number, an empty namespace, an id
    of only spaces, an impossible check layer; each is a 400 whose `param` names the field, extension fields as
    `ragkv.<field>`, and the server answers normally afterwards."""
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    raw = json.dumps(chat)[:-1] + ', "seed": ' + "9" * 5000 + "}"
    r = httpx.post(api + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 400 and "5000 digits" in r.json()["error"]["message"], r.text
    cases = [({"temperature": True}, "temperature", "boolean"),
             ({"ragkv": {"mode": "blend", "ratio": True}}, "ragkv.ratio", "boolean"),
             ({"ragkv": {"namespace": ""}}, "ragkv.namespace", "at least 1"),
             ({"ragkv": {"mode": "nonsense"}}, "ragkv.mode", "nonsense"),
             ({"ragkv": {"mode": "blend", "ratio": 2.0}}, "ragkv.ratio", ""),
             ({"ragkv": {"mode": "blend", "check_layers": [100], "documents": ["A passage."]}}, "ragkv.check_layers",
              "does not exist"),
             ({"ragkv": {"documents": [{"text": "x", "id": "\u00a0"}]}}, "ragkv.documents[0].id", "space")]
    for extra, param, words in cases:
        r = post(api, "/v1/chat/completions", {**chat, **extra})
        assert r.status_code == 400, (extra, r.text)
        e = r.json()["error"]
        assert e["param"] == param and words in e["message"], (extra, e)
    t0 = time.perf_counter()  # 10,000 messages: refused before the template renders any (it is quadratic in them)
    r = post(api, "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}] * 10_000, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages" and time.perf_counter() - t0 < 5
    r = post(api, "/v1/documents", {"documents": [{"text": "x", "id": "\u3000 "}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents[0].id"
    assert post(api, "/v1/chat/completions", chat).status_code == 200


def test_requests_are_validated_as_openai_validates_them(api):
    """Each a 400 whose `param` names the field, where OpenAI's API (or ragkv's own ingestion) refuses; and a
    negative seed is taken, as OpenAI takes any integer."""
    hi = [{"role": "user", "content": "Hi"}]
    chat = {"messages": hi, "max_tokens": 1}
    fn = lambda name, **kw: {"type": "function", "function": {"name": name, **kw}}  # noqa: E731
    called = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    cases = [({"tools": [fn("f"), fn("g"), fn("f")]}, "tools[2].function.name", "both named"),
             ({"tools": [fn("f")], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "not a boolean"),
             ({"stream": 1}, "stream", "not a boolean"),
             ({"messages": [{"role": "tool", "tool_call_id": "call_1", "content": "18 C"}] + hi}, "messages[0]",
              "no earlier assistant"),
             ({"messages": hi + [called, {"role": "tool", "tool_call_id": "call_9", "content": "18 C"}] + hi},
              "messages[2].tool_call_id", "'call_9'"),
             ({"messages": hi + [called, {"role": "tool", "content": "18 C"}] + hi}, "messages[2].tool_call_id",
              "no tool_call_id"),
             ({"tools": [fn("f", parameters={"type": "string"})]}, "tools[0].function.parameters", "object"),
             ({"tools": [fn("f", parameters=[1])]}, "tools[0].function.parameters", "dictionary"),
             ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}},
              "response_format.json_schema.name", "required"),
             ({"ragkv": {"documents": ["A passage.", ""]}}, "ragkv.documents[1]", "contains no text"),
             ({"documents": [{"text": "  "}]}, "documents[0].text", "contains no text"),
             ({"seed": -(1 << 63) - 1}, "seed", "greater than")]
    for extra, param, words in cases:
        r = post(api, "/v1/chat/completions", {**chat, **extra})
        assert r.status_code == 400, (extra, r.text)
        e = r.json()["error"]
        assert e["param"] == param and words in e["message"], (extra, e)
    for seed in (-1, -(1 << 63)):
        r = post(api, "/v1/chat/completions", {**chat, "seed": seed, "temperature": 1.0})
        assert r.status_code == 200, r.text
    answered = {"messages": hi + [called, {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}],
                "tools": [fn("f")], "max_tokens": 1}
    assert post(api, "/v1/chat/completions", answered).status_code == 200


# -- jobs survive the process -------------------------------------------------------------------------------------
def job_docs(n: int, tag: str) -> list[dict]:
    return [{"id": f"{tag}-{i}", "text": f"Note {i} of {tag}: the harbour of Lintwick had {i + 3} boats. " * 12}
            for i in range(n)]


def wait_for(url: str, job_id: str, states=("succeeded",), timeout_s=300.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        got = httpx.get(f"{url}/v1/documents/jobs/{job_id}", timeout=60)
        assert got.status_code == 200, got.text
        if got.json()["status"] in states:
            return got.json()
        assert time.monotonic() < deadline, got.json()
        time.sleep(0.1)


def test_an_accepted_job_survives_a_restart_and_resumes(default_engine, tmp_path):
    index = tmp_path / "index"
    first = make_server(default_engine, index_dir=index, worker_thread=False)  # its model thread: driven below
    with serving(first) as url:
        accepted = post(url, "/v1/documents", {"documents": job_docs(4, "kill"), "wait": False})
        assert accepted.status_code == 202, accepted.text
        job_id = accepted.json()["id"]
        assert accepted.json()["status"] == "running" and accepted.json()["documents_done"] == 0
        while len(first.ingest.live[job_id].record["committed"]) < 2:  # some units, then the process "dies"
            first.scheduler._background_unit()
        committed = list(first.ingest.live[job_id].record["committed"])
        chunks = first.ingest.live[job_id].status["chunks_total"]  # of all 4 documents
    # kill -9: no shutdown ran, the record still says running; a new server over the same library
    second = make_server(default_engine, index_dir=index)
    try:
        with serving(second) as url:
            seen = httpx.get(f"{url}/v1/documents/jobs/{job_id}", timeout=60)
            assert seen.status_code == 200, seen.text  # known, not "no ingestion job"
            assert seen.json()["status"] in ("interrupted", "running", "succeeded")
            assert set(committed) <= set(seen.json()["documents_committed"])
            done = wait_for(url, job_id)
            assert done["restarts"] == 1 and done["documents_done"] == 4 and done["documents_total"] == 4
            # the chunks of the documents committed before the restart count too, not only the resumed ones'
            assert done["chunks_total"] == done["chunks_done"] == done["chunks_added"] == chunks > 2, done
            assert sorted(done["documents_committed"]) == [f"kill-{i}" for i in range(4)]
            ids = {d["doc_id"] for d in httpx.get(url + "/v1/documents").json()["data"]}
            assert {f"kill-{i}" for i in range(4)} <= ids  # no accepted document dropped
            assert [j["id"] for j in httpx.get(url + "/v1/documents/jobs").json()["data"]] == [job_id]
    finally:
        second.scheduler.stop()


def test_a_job_stopped_by_a_shutdown_reads_interrupted_then_resumes(default_engine, tmp_path):
    index = tmp_path / "index"
    first = make_server(default_engine, index_dir=index, worker_thread=False)
    with serving(first) as url:
        job_id = post(url, "/v1/documents", {"documents": job_docs(3, "term"), "wait": False}).json()["id"]
        first.scheduler.stop()
        first.scheduler.serve_forever()  # SIGTERM: the worker ends every job it holds
        state = httpx.get(f"{url}/v1/documents/jobs/{job_id}").json()
        assert state["status"] == "interrupted" and state["documents_uncommitted"] == [f"term-{i}" for i in range(3)]
    second = make_server(default_engine, index_dir=index)
    try:
        with serving(second) as url:
            done = wait_for(url, job_id)
            assert done["restarts"] == 1 and done["documents_done"] == 3
    finally:
        second.scheduler.stop()


def test_a_job_interrupted_too_often_lists_its_documents_to_resend(tmp_path):
    catalog = Catalog(tmp_path)
    dead = JobBook(catalog, owner=f"{socket.gethostname()}|{2 ** 22 + 12345}|gone")  # no such process
    docs = [{"id": f"d{i}", "title": "", "text": f"text {i}"} for i in range(3)]
    record = dead.open("ingest-x", "default", docs)
    record["restarts"] = MAX_RESUMES
    dead.committed(record, "d0")
    book = JobBook(catalog)
    assert book.get("default", "ingest-x")["state"] == INTERRUPTED  # its server is gone: not "running"
    assert book.get("other-tenant", "ingest-x") is None
    assert book.recover() == []  # not resumed a fourth time
    given_up = book.get("default", "ingest-x")
    assert given_up["state"] == INTERRUPTED and given_up["uncommitted"] == ["d1", "d2"]
    assert "again" in given_up["error"] and catalog.job_documents("ingest-x") == []


# -- the store: degraded at start, metrics from the tiers' real state ---------------------------------------------
def metrics(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=60).text
    return {(s.name, s.labels.get("tier")): s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("ragkv_store")}


def ask(url: str, docs: list[str]) -> None:
    r = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Who built the tower?"}],
                                           "max_tokens": 1, "ragkv": {"mode": "reuse", "documents": docs}})
    assert r.status_code == 200, r.text


def test_disk_tier_metrics_follow_deleted_files_and_count_failed_writes(default_engine, tmp_path, monkeypatch):
    kv = tmp_path / "kv"
    server = make_server(default_engine, f"disk:{kv}:1GiB")
    tier = f"disk:{kv}:1GiB"
    try:
        with serving(server) as url:
            ask(url, DOCS)
            assert metrics(url)[("ragkv_store_bytes", tier)] > 0
            shutil.rmtree(kv)  # someone deletes the tier's files, directory and all
            m = metrics(url)
            assert m[("ragkv_store_bytes", tier)] == 0 and m[("ragkv_store_tier_faults_total", tier)] == 0
            for code in (errno.ENOSPC, errno.EROFS):
                def refuse(*a, code=code, **k):
                    raise OSError(code, os.strerror(code))
                monkeypatch.setattr(tempfile, "mkstemp", refuse)
                time.sleep(1.1)  # past the backoff of the previous fault
                ask(url, [f"A new passage number {code} about the harbour."])
            m = metrics(url)
            assert m[("ragkv_store_tier_faults_total", tier)] >= 2  # each refused write is a fault
            monkeypatch.undo()
            time.sleep(2.5)
            ask(url, ["Yet another passage, written once the disk is back."])
            assert metrics(url)[("ragkv_store_bytes", tier)] > 0 and kv.is_dir()  # the directory is made again
    finally:
        server.scheduler.stop()


def redis_on(port: int, workdir) -> subprocess.Popen:
    proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(workdir)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)
    import redis

    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis(port=port, socket_connect_timeout=0.2).ping()
            return proc
        except redis.exceptions.ConnectionError:
            assert time.monotonic() < deadline and proc.poll() is None, "redis-server did not start"
            time.sleep(0.05)


@pytest.mark.redis
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_serve_starts_with_its_redis_tier_down_and_uses_it_once_it_answers(tmp_path):
    from ragkv.bench.serve import ServerProcess

    port = free_port()  # nothing listens there: Redis is down at start
    redis_tier = f"redis://127.0.0.1:{port}/0"
    tiny = str(make_tiny_served(tmp_path))  # the store's tiers are under test, not the model
    with ServerProcess(model=tiny, dtype="float32", device="cpu", store=f"memory:64MiB,{redis_tier}",
                       startup_s=180, cache_dir=tmp_path) as s:
        ask(s.url, DOCS)  # served from the other tiers
        m = metrics(s.url)
        assert m[("ragkv_store_tier_faults_total", redis_tier)] >= 1  # counted from the start
        assert m[("ragkv_store_bytes", redis_tier)] == 0 and m[("ragkv_store_tier_up", redis_tier)] == 0
        proc = redis_on(port, tmp_path)
        try:
            deadline = time.monotonic() + 120
            i = 0
            while metrics(s.url).get(("ragkv_store_bytes", redis_tier), 0) == 0:  # retried after its backoff
                assert time.monotonic() < deadline, metrics(s.url)
                ask(s.url, [f"Passage {i} about the harbour of Lintwick."])
                i += 1
                time.sleep(0.5)
        finally:
            proc.terminate()
            proc.wait(timeout=10)
        log = s.log_path.read_text()
    assert log.count("failed on start") == 1, log[-3000:]  # logged once, not once per request


# -- chat history as blocks -------------------------------------------------------------------------------------
def idle(url: str, timeout_s: float = 120.0) -> None:
    """Wait until the server has no background work left (the turns of the last chat encoded as blocks)."""
    deadline = time.monotonic() + timeout_s
    while httpx.get(url + "/health", timeout=10).json().get("background_jobs", 0):
        assert time.monotonic() < deadline, "background work did not finish"
        time.sleep(0.1)


def history_turns(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=60).text
    return {s.labels["kind"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "ragkv_history_turns_total"}


def test_a_stateless_chat_reuses_its_history_exactly_and_fuses_it_behind_an_edit(api):
    counted = history_turns(api)
    facts = ["my cat Tom is orange and sleeps on the piano", "I live in Lisbon by the river Tagus",
             "I cook grilled sardines every Sunday", "I play the cello in an amateur orchestra"]
    msgs = [{"role": "system", "content": "Answer in one short sentence."}]
    for fact in facts:
        msgs.append({"role": "user", "content": f"Remember this: {fact}. " + "Please keep it in mind. " * 20})
        r = post(api, "/v1/chat/completions", {"messages": msgs, "max_tokens": 12})
        assert r.status_code == 200, r.text
        msgs.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
        usage = r.json()["usage"]
        if len(msgs) > 3:  # earlier turns: blocks, but nothing was edited, so the answer is exact
            assert usage["fidelity"]["exact"] is True and usage["history"]["exact"] is True
            assert usage["history"]["turns"] == len(msgs) - 3 and usage["fidelity"]["mode"] == "blend"
            assert usage["prompt_tokens_details"]["cached_tokens"] > 0
    idle(api)
    # a client compacts its history: the first two exchanges become one summary; a tool call and its result join in
    edited = (msgs[:1] + [{"role": "user", "content": "Summary: my cat Tom is orange."},
                          {"role": "assistant", "content": "Noted."}] + msgs[5:]
              + [{"role": "assistant", "content": None, "tool_calls": [
                  {"id": "call_w", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
                 {"role": "tool", "tool_call_id": "call_w", "content": '{"weather": "rain in Lisbon"}'},
                 {"role": "user", "content": "What colour is my cat?"}])
    r = post(api, "/v1/chat/completions", {"messages": edited, "max_tokens": 8})
    assert r.status_code == 200, r.text
    h, fid = r.json()["usage"]["history"], r.json()["usage"]["fidelity"]
    # exact: the summary exchange at the start, and the new call and its tool result computed with the question
    assert h["exact"] is False and h["exact_turns"] == 4 and h["fused_turns"] >= 4, h
    assert fid["history"] == h and fid["exact"] is False and fid["mode"] == "blend", fid
    now = history_turns(api)  # /metrics counts the turns by how they were had
    assert now["fused"] - counted.get("fused", 0) == h["fused_turns"]
    assert now["exact"] - counted.get("exact", 0) >= h["exact_turns"] + sum(range(1, len(facts))) * 2
    # the next turn is exact again: the server prefilled the edited history in the background
    idle(api)
    follow = edited + [{"role": "assistant", "content": "Orange."}, {"role": "user", "content": "And its name?"}]
    r = post(api, "/v1/chat/completions", {"messages": follow, "max_tokens": 8})
    assert r.status_code == 200 and r.json()["usage"]["history"]["exact"] is True, r.json()["usage"]
    # `prefix` keeps it exact: the same request, prefilled after the edit
    r = post(api, "/v1/chat/completions", {"messages": edited, "max_tokens": 8, "ragkv": {"mode": "prefix"}})
    assert r.status_code == 200 and r.json()["usage"]["fidelity"]["exact"] is True
    assert r.json()["usage"]["history"] is None
    idle(api)  # the follow-up's idle-time work done before the module's server stops


def test_a_chat_with_documents_keeps_its_turns_as_blocks_and_is_exact_once_settled(api):
    """Documents stay the conversation's first blocks: a follow-up fuses them and computes its new turns with the
    question; after the idle-time settle, the next follow-up with the same documents is exact."""
    docs = [d + " " + " ".join(["The archive keeps the original drawings, letters and survey notes."] * 6)
            for d in DOCS[:2]]
    msgs = [{"role": "user", "content": "Who built Lintwick Tower?"}]
    body = {"max_tokens": 6, "ragkv": {"mode": "reuse", "documents": docs}}
    r = post(api, "/v1/chat/completions", {**body, "messages": msgs})
    assert r.status_code == 200, r.text and r.json()["usage"]["history"] is None  # one message: no history
    msgs += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or "Ada Morrow."},
             {"role": "user", "content": "In which year?"}]
    r = post(api, "/v1/chat/completions", {**body, "messages": msgs})
    assert r.status_code == 200, r.text
    h = r.json()["usage"]["history"]
    assert h == {**h, "turns": 2, "passages": 2, "fused_passages": 2, "exact_turns": 2, "exact": False}, h
    idle(api)
    msgs += [{"role": "assistant", "content": "1893."}, {"role": "user", "content": "From which stone?"}]
    r = post(api, "/v1/chat/completions", {**body, "messages": msgs})
    assert r.status_code == 200, r.text
    h = r.json()["usage"]["history"]
    assert h["exact"] is True and h["turns"] == 4 and r.json()["usage"]["fidelity"]["exact"] is True, h
    idle(api)


def test_a_request_with_documents_naming_no_mode_gets_the_cli_default_and_one_naming_blend_gets_cacheblend(
        default_engine):
    """`ragkv serve`'s --mode default (settings.DEFAULT_DOCUMENTS_MODE, a mode key: ProphetKV's query-aware selection
    at r=0.14 ranked by the second half of the layers) answers a request with documents that names no mode; a request naming `blend` gets the flags'
    parameters (CacheBlend's deviation selection), not the key's."""
    from ragkv.cli.common import fusion_from_args
    from ragkv.cli.main import build_parser
    from ragkv.settings import DEFAULT_DOCUMENTS_MODE

    args = build_parser().parse_args(["serve"])
    assert args.mode == DEFAULT_DOCUMENTS_MODE == "blend:sel=query,r=0.14,sfrom=0.5"
    server = make_server(default_engine, default_fusion=fusion_from_args(args, key_params=False),
                         documents_fusion=fusion_from_args(args))
    docs = ["CacheBlend recomputes the KV of a few tokens of each block.", "APE scales attention to blocks."]
    try:
        with serving(server) as url:
            def fidelity(ragkv):
                r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
                    "messages": [{"role": "user", "content": "What does CacheBlend recompute?"}], "max_tokens": 2,
                    "ragkv": {"documents": docs, **ragkv}})
                assert r.status_code == 200, r.text
                return r.json()["usage"]["fidelity"]
            unnamed = fidelity({})
            assert unnamed["mode"] == "blend" and unnamed["select"] == "query" and unnamed["exact"] is False, unnamed
            assert fidelity({"mode": "blend"})["select"] == "deviation"
            assert fidelity({"mode": "reuse"})["mode"] == "reuse"
    finally:
        server.scheduler.stop()


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_a_request_alone_prefills_in_one_unit_unless_batch_invariant(batch_invariant, default_engine):
    """A short `full` request alone on the server prefills in one unit of up to the step's budget
    (Scheduler.unit_tokens: its logits those of a prefill at once); under --batch-invariant every prefill keeps
    the fixed --prefill-chunk unit."""
    from ragkv.engine.options import FusionOptions, GenerationOptions
    from ragkv.serve.requests import Prepared

    segs = default_engine.segments("Which city is the capital of France?", ["Paris is the capital of France."] * 3)
    server = make_server(default_engine, prefill_chunk=16, batch_invariant=batch_invariant)
    try:
        job = server.start(Prepared(segs, FusionOptions(mode="full"), GenerationOptions(max_new_tokens=2), None, []))
        job.future.result(timeout=120)
        units = server.scheduler.prefill_units
    finally:
        server.scheduler.stop()
    assert segs.num_tokens > 32
    assert units == (-(-segs.num_tokens // 16) if batch_invariant else 1)
