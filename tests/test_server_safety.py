"""A server that is safe to share, against a real `ragkv serve` on 127.0.0.1 with two tenants' keys:
every bad input is a 4xx naming the field and the server keeps answering; keys and tenants separate documents and
KV; ingestion runs as a background job that can be polled and cancelled."""

import json
import time

import httpx
import pytest

from ragkv.bench.serve import ServerProcess
from tiny import default_model_available

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(not default_model_available(), reason="default model not converted")]

KEY_A, KEY_B = "key-tenant-a-0001", "key-tenant-b-0002"
A = {"Authorization": f"Bearer {KEY_A}"}
B = {"Authorization": f"Bearer {KEY_B}"}
MAX_BODY, MAX_DOCS, MAX_CHARS = 200_000, 4, 20_000
HI = {"model": "smollm2", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"# tenant B's key\n{KEY_B} tenantB\n")
    extra = ("--api-key", f"{KEY_A}:tenantA", "--api-keys", str(keys), "--max-body", str(MAX_BODY),
             "--max-documents", str(MAX_DOCS), "--max-document-chars", str(MAX_CHARS), "--timeout", "120")
    with ServerProcess(dtype="float32", device="cpu", store="memory:256MiB", startup_s=180,
                       cache_dir=tmp_path_factory.mktemp("serve-safety"), extra=extra) as s:
        yield s


def chat(**kw) -> dict:
    return {**HI, **kw}


def with_ragkv(**extras) -> dict:
    return chat(ragkv={"documents": ["Lintwick Tower was built in 1893."], **extras})


DEEP = b'{"model": "smollm2", "messages": ' + b"[" * 90_000 + b"]" * 90_000 + b"}"
# (name, method, path, body: dict | bytes | None, extra headers, status, a word the error must contain)
CASES = [
    # JSON itself
    ("not json", "POST", "/v1/chat/completions", b"{not json", {}, 400, "JSON"),
    ("empty body", "POST", "/v1/chat/completions", b"", {}, 400, "JSON"),
    ("array body", "POST", "/v1/chat/completions", b"[1, 2]", {}, 400, "object"),
    ("string body", "POST", "/v1/chat/completions", b'"hi"', {}, 400, "object"),
    ("NaN literal", "POST", "/v1/chat/completions", b'{"temperature": NaN, "messages": []}', {}, 400, "NaN"),
    ("Infinity literal", "POST", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi"}], "ragkv": {"ape_temperature": Infinity}}', {}, 400,
     "Infinity"),
    ("-Infinity literal", "POST", "/v1/chat/completions", b'{"top_p": -Infinity, "messages": []}', {}, 400,
     "Infinity"),
    ("lone surrogate", "POST", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}', {}, 400, "surrogate"),
    ("deep nesting", "POST", "/v1/chat/completions", DEEP, {}, 400, "nested"),
    ("invalid utf-8", "POST", "/v1/chat/completions", b'{"messages": "\xff\xfe"}', {}, 400, "JSON"),
    # messages
    ("no messages", "POST", "/v1/chat/completions", {"model": "smollm2"}, {}, 400, "messages"),
    ("empty messages", "POST", "/v1/chat/completions", chat(messages=[]), {}, 400, "messages"),
    ("messages not a list", "POST", "/v1/chat/completions", chat(messages="hi"), {}, 400, "messages"),
    ("bad role", "POST", "/v1/chat/completions", chat(messages=[{"role": "robot", "content": "x"}]), {}, 400, "role"),
    ("content a number", "POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": 5}]), {}, 400,
     "content"),
    ("last message from assistant", "POST", "/v1/chat/completions",
     chat(messages=[{"role": "assistant", "content": "x"}]), {}, 400, "user"),
    ("empty user message", "POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": "  "}]), {},
     400, "empty"),
    ("image part", "POST", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), {}, 400,
     "content"),
    # sampling fields
    ("max_tokens 1e12", "POST", "/v1/chat/completions", chat(max_tokens=10**12), {}, 400, "max_tokens"),
    ("max_tokens above the model", "POST", "/v1/chat/completions", chat(max_tokens=100_000), {}, 400, "max_tokens"),
    ("max_tokens negative", "POST", "/v1/chat/completions", chat(max_tokens=-1), {}, 400, "max_tokens"),
    ("max_tokens a string", "POST", "/v1/chat/completions", chat(max_tokens="many"), {}, 400, "max_tokens"),
    ("max_completion_tokens huge", "POST", "/v1/chat/completions", chat(max_completion_tokens=10**9), {}, 400,
     "max_completion_tokens"),
    ("seed 2^80", "POST", "/v1/chat/completions", chat(seed=2**80), {}, 400, "seed"),
    ("seed below -2^63", "POST", "/v1/chat/completions", chat(seed=-2**63 - 1), {}, 400, "seed"),
    ("temperature 3", "POST", "/v1/chat/completions", chat(temperature=3), {}, 400, "temperature"),
    ("temperature negative", "POST", "/v1/chat/completions", chat(temperature=-0.1), {}, 400, "temperature"),
    ("top_p 0", "POST", "/v1/chat/completions", chat(top_p=0), {}, 400, "top_p"),
    ("top_p 1.5", "POST", "/v1/chat/completions", chat(top_p=1.5), {}, 400, "top_p"),
    ("n 0", "POST", "/v1/chat/completions", chat(n=0), {}, 400, "n"),
    ("n above --max-batch", "POST", "/v1/chat/completions", chat(n=17), {}, 400, "--max-batch"),
    ("top_k -5", "POST", "/v1/chat/completions", chat(top_k=-5), {}, 400, "top_k"),
    ("min_p 2", "POST", "/v1/chat/completions", chat(min_p=2), {}, 400, "min_p"),
    ("repetition_penalty 0", "POST", "/v1/chat/completions", chat(repetition_penalty=0), {}, 400,
     "repetition_penalty"),
    ("cache_salt empty", "POST", "/v1/chat/completions", chat(cache_salt=""), {}, 400, "cache_salt"),
    ("documents twice", "POST", "/v1/chat/completions", chat(documents=["a"], ragkv={"documents": ["b"]}), {}, 400,
     "documents"),
    ("stop a number", "POST", "/v1/chat/completions", chat(stop=5), {}, 400, "stop"),
    ("17 stop strings", "POST", "/v1/chat/completions", chat(stop=["x"] * 17), {}, 400, "stop"),
    ("stream a string", "POST", "/v1/chat/completions", chat(stream="maybe"), {}, 400, "stream"),
    ("unknown model", "POST", "/v1/chat/completions", chat(model="gpt-9"), {}, 404, "gpt-9"),
    # OpenAI fields: unsupported ones, and out-of-range values of supported ones
    ("tools", "POST", "/v1/chat/completions", chat(tools=[{"type": "function"}]), {}, 400, "tools"),
    ("tool_choice", "POST", "/v1/chat/completions", chat(tool_choice="auto"), {}, 400, "tool_choice"),
    ("response_format schema", "POST", "/v1/chat/completions",
     chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}), {}, 400,
     "response_format"),
    ("response_format type", "POST", "/v1/chat/completions", chat(response_format={"type": "xml"}), {}, 400,
     "response_format"),
    ("5,000 messages", "POST", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": "a"}] * 5_000), {}, 400, "at most 256"),
    ("logprobs a string", "POST", "/v1/chat/completions", chat(logprobs="many"), {}, 400, "logprobs"),
    ("top_logprobs without logprobs", "POST", "/v1/chat/completions", chat(top_logprobs=3), {}, 400,
     "top_logprobs"),
    ("top_logprobs 100", "POST", "/v1/chat/completions", chat(logprobs=True, top_logprobs=100), {}, 400,
     "top_logprobs"),
    ("presence_penalty 3", "POST", "/v1/chat/completions", chat(presence_penalty=3), {}, 400, "presence_penalty"),
    ("frequency_penalty -3", "POST", "/v1/chat/completions", chat(frequency_penalty=-3), {}, 400,
     "frequency_penalty"),
    ("logit_bias", "POST", "/v1/chat/completions", chat(logit_bias={"1": 5}), {}, 400, "logit_bias"),
    ("echo", "POST", "/v1/completions", {"prompt": "x", "max_tokens": 1, "echo": True}, {}, 400, "echo"),
    ("best_of", "POST", "/v1/completions", {"prompt": "x", "max_tokens": 1, "best_of": 3}, {}, 400, "best_of"),
    ("suffix", "POST", "/v1/completions", {"prompt": "x", "max_tokens": 1, "suffix": "y"}, {}, 400, "suffix"),
    ("functions", "POST", "/v1/chat/completions", chat(functions=[{"name": "f"}]), {}, 400, "functions"),
    # ragkv extras
    ("unknown ragkv key", "POST", "/v1/chat/completions", with_ragkv(moed="reuse"), {}, 400, "moed"),
    ("unknown mode", "POST", "/v1/chat/completions", with_ragkv(mode="warp"), {}, 400, "mode"),
    ("ratio 3", "POST", "/v1/chat/completions", with_ragkv(mode="blend", ratio=3), {}, 400, "ratio"),
    ("ratio negative", "POST", "/v1/chat/completions", with_ragkv(mode="blend", ratio=-0.1), {}, 400, "ratio"),
    ("ape_temperature 0", "POST", "/v1/chat/completions", with_ragkv(mode="ape", ape_temperature=0), {}, 400,
     "ape_temperature"),
    ("ape_scale huge", "POST", "/v1/chat/completions", with_ragkv(mode="ape", ape_scale=1e9), {}, 400, "ape_scale"),
    ("check layer 0", "POST", "/v1/chat/completions", with_ragkv(mode="blend", check_layers=[0]), {}, 400,
     "check"),
    ("check layer past the model", "POST", "/v1/chat/completions", with_ragkv(mode="blend", check_layers=[99]), {},
     400, "check"),
    ("check layers unsorted", "POST", "/v1/chat/completions", with_ragkv(mode="blend", check_layers=[4, 2]), {},
     400, "check_layers"),
    ("deviation q", "POST", "/v1/chat/completions", with_ragkv(mode="blend", deviation="q"), {}, 400, "deviation"),
    ("sink tokens negative", "POST", "/v1/chat/completions", with_ragkv(mode="blend", sink_tokens=-1), {}, 400,
     "sink_tokens"),
    ("top_k 0", "POST", "/v1/chat/completions", chat(ragkv={"retrieval": {"top_k": 0}}), {}, 400, "top_k"),
    ("top_k 500", "POST", "/v1/chat/completions", chat(ragkv={"retrieval": {"top_k": 500}}), {}, 400, "top_k"),
    ("documents not a list", "POST", "/v1/chat/completions", chat(ragkv={"documents": "text"}), {}, 400,
     "documents"),
    ("too many inline documents", "POST", "/v1/chat/completions", chat(ragkv={"documents": ["a"] * 5}), {}, 400,
     "--max-documents"),
    ("inline document too long", "POST", "/v1/chat/completions", chat(ragkv={"documents": ["a" * 20_001]}), {},
     400, "--max-document-chars"),
    ("another tenant's namespace", "POST", "/v1/chat/completions", with_ragkv(namespace="tenantB"), {}, 403,
     "namespace"),
    ("a namespace outside the tenant", "POST", "/v1/chat/completions", with_ragkv(namespace="../x"), {}, 403,
     "namespace"),
    # bodies and prompts
    ("body over --max-body", "POST", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": "x" * (MAX_BODY + 10)}]), {}, 413, "--max-body"),
    ("prompt over the model", "POST", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": "word " * 9000}]), {}, 400, "8192"),
    ("completion prompt empty", "POST", "/v1/completions", {"prompt": "  ", "max_tokens": 1}, {}, 400, "prompt"),
    ("completion prompt missing", "POST", "/v1/completions", {"max_tokens": 1}, {}, 400, "prompt"),
    # documents API
    ("documents missing", "POST", "/v1/documents", {}, {}, 400, "documents"),
    ("documents empty", "POST", "/v1/documents", {"documents": []}, {}, 400, "documents"),
    ("document without text", "POST", "/v1/documents", {"documents": [{"title": "t"}]}, {}, 400, "text"),
    ("document text empty", "POST", "/v1/documents", {"documents": [{"text": "   "}]}, {}, 400, "no text"),
    ("document id with a newline", "POST", "/v1/documents", {"documents": [{"text": "x", "id": "a\nb"}]}, {}, 400,
     "id"),
    ("document id too long", "POST", "/v1/documents", {"documents": [{"text": "x", "id": "i" * 300}]}, {}, 400,
     "id"),
    ("unknown document field", "POST", "/v1/documents", {"documents": [{"text": "x", "txt": "y"}]}, {}, 400, "txt"),
    ("too many documents", "POST", "/v1/documents", {"documents": [{"text": "x"}] * 5}, {}, 400, "--max-documents"),
    ("document too long", "POST", "/v1/documents", {"documents": [{"text": "y" * 20_001}]}, {}, 400,
     "--max-document-chars"),
    ("delete an unknown document", "DELETE", "/v1/documents/nope", None, {}, 404, "nope"),
    ("an unknown job", "GET", "/v1/documents/jobs/ingest-nope", None, {}, 404, "ingest-nope"),
    ("cancel an unknown job", "DELETE", "/v1/documents/jobs/ingest-nope", None, {}, 404, "ingest-nope"),
    # keys
    ("no key", "POST", "/v1/chat/completions", HI, {"Authorization": ""}, 401, "API key"),
    ("wrong key", "POST", "/v1/chat/completions", HI, {"Authorization": "Bearer key-of-nobody-000"}, 401, "API key"),
    ("basic auth", "GET", "/v1/models", None, {"Authorization": f"Basic {KEY_A}"}, 401, "API key"),
    ("no key on documents", "GET", "/v1/documents", None, {"Authorization": ""}, 401, "API key"),
    ("no key on jobs", "GET", "/v1/documents/jobs/x", None, {"Authorization": ""}, 401, "API key"),
    # routes
    ("unknown route", "GET", "/v1/nothing", None, {}, 404, ""),
    ("wrong method", "GET", "/v1/chat/completions", None, {}, 405, ""),
]


def send(server, method, path, body, headers=None):
    hdrs = {**A, **(headers or {})}
    hdrs = {k: v for k, v in hdrs.items() if v}
    kw = {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
    return httpx.request(method, server.url + path, headers=hdrs, timeout=120, **kw)


@pytest.mark.parametrize("name,method,path,body,headers,status,needle", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_a_4xx_naming_it_and_the_server_keeps_answering(server, name, method, path, body, headers,
                                                                      status, needle):
    r = send(server, method, path, body, headers)
    assert r.status_code == status, (name, r.status_code, r.text[:300])
    if needle:
        err = r.json()["error"]
        assert needle.lower() in (err["message"] + " " + str(err.get("param"))).lower(), (name, err)
        assert err["type"] and err["message"]
    if status == 401:
        assert r.headers.get("www-authenticate") == "Bearer"
    ok = send(server, "POST", "/v1/chat/completions", HI)
    assert ok.status_code == 200 and ok.json()["choices"], (name, ok.text[:300])


@pytest.mark.parametrize("stream", [False, True])
def test_a_vanishing_temperature_is_answered_greedily(server, stream):
    """temperature 2e-288 (a fuzzer's) is valid and greedy: it used to hang its request until the server's
    timeout (and its stream for ever)."""
    body = {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 3, "frequency_penalty": -1.0,
            "seed": 2130, "stream": stream}
    texts = []
    for temperature in (0, 2.3751195567713764e-288):
        r = httpx.post(f"{server.url}/v1/completions", json={**body, "temperature": temperature}, headers=A,
                       timeout=60)
        assert r.status_code == 200, r.text
        if stream:
            texts.append("".join(json.loads(line[6:])["choices"][0]["text"] for line in r.text.splitlines()
                                 if line.startswith("data: {")))
        else:
            texts.append(r.json()["choices"][0]["text"])
    assert texts[0] == texts[1] and texts[0]


def test_health_and_metrics_are_open_everything_else_needs_a_key(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/v1/models", headers=B).status_code == 200


def test_tenants_see_only_their_own_documents(server):
    secret = "Tenant A confidential: the launch password is SWORDFISH-99."
    r = send(server, "POST", "/v1/documents", {"documents": [{"text": secret, "id": "plans/launch", "title": "x"}]})
    assert r.status_code == 200, r.text
    assert [d["doc_id"] for d in send(server, "GET", "/v1/documents", None).json()["data"]] == ["plans/launch"]
    listed_b = httpx.get(server.url + "/v1/documents", headers=B).json()["data"]
    assert listed_b == []
    asked = httpx.post(server.url + "/v1/chat/completions", headers=B, timeout=120, json={
        **HI, "max_tokens": 16, "messages": [{"role": "user", "content": "What is the launch password?"}],
        "ragkv": {"retrieval": {"top_k": 5}}}).json()
    assert "SWORDFISH" not in json.dumps(asked) and asked["ragkv"]["sources"] == []
    assert httpx.delete(server.url + "/v1/documents/plans/launch", headers=B).status_code == 404
    mine = send(server, "POST", "/v1/chat/completions", {**HI, "messages": [
        {"role": "user", "content": "What is the launch password?"}], "ragkv": {"retrieval": {"top_k": 5}}}).json()
    assert [s["doc_id"] for s in mine["ragkv"]["sources"]] == ["plans/launch"]
    assert send(server, "DELETE", "/v1/documents/plans/launch", None).json()["deleted"]  # a "/" round-trips


def test_ingestion_is_a_background_job_to_poll_or_cancel(server):
    docs = [{"text": (f"Paragraph {i} about the harbour of Lintwick and its {i} boats. " * 40), "id": f"d{i}"}
            for i in range(4)]
    r = send(server, "POST", "/v1/documents", {"documents": docs, "wait": False})
    assert r.status_code == 202 and r.json()["status"] == "running"
    job = r.json()["id"]
    assert httpx.get(server.url + f"/v1/documents/jobs/{job}", headers=B).status_code == 404  # not B's
    deadline = time.monotonic() + 120
    while (state := send(server, "GET", f"/v1/documents/jobs/{job}", None).json())["status"] == "running":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert state["status"] == "succeeded" and state["chunks_added"] >= 4 and state["documents_done"] == 4
    more = [{"text": f"Another note {i}. " * 200, "id": f"e{i}"} for i in range(4)]
    job = send(server, "POST", "/v1/documents", {"documents": more, "wait": False}).json()["id"]
    cancelled = send(server, "DELETE", f"/v1/documents/jobs/{job}", None).json()
    assert cancelled["cancel_requested"]
    while (state := send(server, "GET", f"/v1/documents/jobs/{job}", None).json())["status"] == "running":
        time.sleep(0.2)
    assert state["status"] in ("cancelled", "succeeded")  # cancelled between units, unless it had finished
    ids = {d["doc_id"] for d in send(server, "GET", "/v1/documents", None).json()["data"]}
    assert {f"d{i}" for i in range(4)} <= ids and len(ids - {f"d{i}" for i in range(4)}) == state["documents_done"]


def test_sigterm_stops_within_a_bounded_time_during_a_generation_and_an_ingest(tmp_path):
    import signal
    import threading

    with ServerProcess(dtype="float32", device="cpu", store="memory:256MiB", startup_s=180, cache_dir=tmp_path) as s:
        results = {}

        def long_answer():
            try:
                results["chat"] = httpx.post(s.url + "/v1/chat/completions", timeout=120, json={
                    **HI, "max_tokens": 4000, "messages": [{"role": "user", "content": "Tell a very long story."}]})
            except httpx.HTTPError as e:
                results["chat"] = e

        t = threading.Thread(target=long_answer)
        t.start()
        job = httpx.post(s.url + "/v1/documents", timeout=60, json={"wait": False, "documents": [
            {"text": f"Section {i}. " + "The harbour holds boats. " * 300, "id": f"s{i}"} for i in range(8)]})
        assert job.status_code == 202
        time.sleep(2.0)  # both are running now
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        s.proc.wait(timeout=30)
        took = time.monotonic() - t0
        t.join(timeout=30)
        assert took < 20, f"SIGTERM took {took:.1f} s"
        chat = results["chat"]
        assert isinstance(chat, httpx.HTTPError) or chat.status_code in (200, 503)
