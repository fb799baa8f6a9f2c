"""Bounded memory in `ragkv serve`, over real HTTP against a real server process serving a tiny random
model (byte tokenizer, 8 KiB of KV per token): abandoned streams give their KV and their memory back, n choices do
not multiply the prompt's KV, a request whose KV cannot fit now waits, and one that never could gets a 400 naming
the limit."""

import json
import threading
import time

import httpx
import pytest

from ragkv.bench.serve import ServerProcess
from tiny import make_tiny_served

MiB = 1 << 20
KV_LIMIT = 384 * MiB
PER_TOKEN = 8192  # 2 x 4 layers x 4 KV heads x 64 x fp32


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("server-memory")
    model = make_tiny_served(root)
    (root / "cache").mkdir()
    extra = ("--served-model-name", "tiny", "--max-batch", "8", "--kv-memory", "384MiB", "--timeout", "600")
    with ServerProcess(model=str(model), dtype="float32", device="cpu", store="memory:16MiB", startup_s=300,
                       cache_dir=root / "cache", extra=extra) as s:
        yield s


def chat_body(n=1, max_tokens=8, stream=False, content="Tell me a story."):
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "n": n, "max_tokens": max_tokens,
            "stream": stream, "temperature": 0}


def health(server) -> dict:
    return httpx.get(server.url + "/health", timeout=30).json()


def wait_for(cond, timeout_s=20.0, every_s=0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(every_s)
    return cond()


def abandon(server, body, lines=6) -> None:
    """Send a streamed request, read its first lines (the choices' role chunks: it is decoding), close the
    connection. Few decode steps run: the tiny random model's bytes rarely make text, and a loaded machine is slow."""
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i >= lines:
                break


def completion_tokens(server) -> float:
    for line in httpx.get(server.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("ragkv_completion_tokens_total "):
            return float(line.split()[1])
    return 0.0


def test_abandoned_streams_give_their_kv_and_their_memory_back(server):
    """Abandoned n=8, max_tokens 3000 streams: reserved and in-use KV back to 0 at once, the answers stopped (not
    decoded to the end), and the server's RSS back near where it was (it cloned 8 x (prompt + max_tokens) rows
    per request and kept them after the client left)."""
    httpx.post(server.url + "/v1/chat/completions", json=chat_body(n=8, max_tokens=32), timeout=120).raise_for_status()
    assert wait_for(lambda: health(server)["kv_bytes_reserved"] == 0)
    time.sleep(1.0)  # the idle server trims its heap
    rss0 = server.rss_bytes()
    tokens0 = completion_tokens(server)
    body = chat_body(n=8, max_tokens=3000, stream=True)
    for _ in range(3):
        abandon(server, body)
        assert wait_for(lambda: (lambda h: h["kv_bytes_reserved"] == 0 and h["kv_bytes_in_use"] == 0)(health(server)),
                        timeout_s=10)
    assert completion_tokens(server) - tokens0 < 3 * 8 * 3000 / 4  # cancelled, not decoded on
    assert wait_for(lambda: server.rss_bytes() - rss0 < 48 * MiB, timeout_s=15), \
        f"RSS {server.rss_bytes() / MiB:.0f} MiB, was {rss0 / MiB:.0f} MiB"
    h = health(server)
    assert h["batch_size"] == 0 and h["queue_depth"] == 0 and h["kv_bytes_limit"] == KV_LIMIT


def test_n_choices_hold_the_prompt_kv_once(server):
    """8 choices of a ~3K-token prompt: the KV in use while they decode is about one prompt's, not eight; the
    reservation counts the prompt once plus 8 x max_tokens."""
    body = chat_body(n=8, max_tokens=1000, stream=True, content="word " * 600)
    seen = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i in (0, 4):  # decoding by now
                seen.append(health(server))
            if i >= 4:
                break
    prompt_tokens = len(("word " * 600).strip()) + 20  # one token per byte, plus the chat template's
    for h in seen:
        assert h["batch_size"] == 8
        assert PER_TOKEN * (prompt_tokens - 40 + 8 * 1000) <= h["kv_bytes_reserved"] <= \
            PER_TOKEN * (prompt_tokens + 40 + 8 * 1000)
        assert h["kv_bytes_in_use"] < 1.6 * PER_TOKEN * prompt_tokens  # eight copies would be 8x
    assert wait_for(lambda: health(server)["kv_bytes_in_use"] == 0, timeout_s=10)


def test_a_request_that_cannot_fit_now_waits_for_memory(server):
    """Two requests of ~230 MB each (n=4: both fit the batch of 8) under a 384 MiB limit: the second waits
    (answering nothing yet) until the first leaves, then runs."""
    body = chat_body(n=4, max_tokens=7000, stream=True)
    got_first = threading.Event()

    def second():
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for _ in r.iter_lines():
                got_first.set()
                break

    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(lines)
        t = threading.Thread(target=second, daemon=True)
        t.start()
        assert wait_for(lambda: health(server)["kv_waiting"] == 1, timeout_s=10)
        h = health(server)
        assert h["kv_bytes_reserved"] <= KV_LIMIT and h["queue_depth"] == 1 and not got_first.is_set()
    assert got_first.wait(60)  # the first stream closed: its memory went back and the second one started
    t.join(20)
    assert wait_for(lambda: health(server)["kv_bytes_reserved"] == 0, timeout_s=10)


def test_a_request_that_can_never_fit_gets_a_400_naming_the_limit(server):
    r = httpx.post(server.url + "/v1/chat/completions", json=chat_body(n=8, max_tokens=8000), timeout=60)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "max_tokens" and err["code"] == "kv_memory_exceeded"
    assert "--kv-memory" in err["message"] and "384.0 MiB" in err["message"] and "n=8" in err["message"]
    streamed = httpx.post(server.url + "/v1/chat/completions", json=chat_body(n=8, max_tokens=8000, stream=True),
                          timeout=60)
    assert streamed.status_code == 400
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    for name in ("ragkv_kv_bytes_reserved", "ragkv_kv_bytes_in_use", "ragkv_kv_bytes_limit"):
        assert f"\n{name} " in metrics
    assert health(server)["kv_bytes_reserved"] == 0


def test_blend_over_pooled_blocks_gives_back_what_it_did_not_keep(server):
    """blend with kv_layout=shared reserves the whole prompt before its prefill (how many rows it recomputes is not
    known yet), then keeps only those and the query's: the reservation while it decodes is smaller than blend over
    its own copy's, which holds every prompt row."""
    docs = [{"title": f"Note {i}", "text": f"Passage {i} says the river bends twice. " * 15} for i in range(3)]

    def reserved_while_decoding(kv_layout):
        body = {**chat_body(max_tokens=400, stream=True, content="Where does the river bend?"),
                "ragkv": {"mode": "blend", "ratio": 0.15, "kv_layout": kv_layout, "documents": docs}}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for i, _ in enumerate(r.iter_lines()):
                if i >= 2:  # decoding by now
                    return health(server)["kv_bytes_reserved"]

    copied, shared = reserved_while_decoding("copied"), reserved_while_decoding("shared")
    prompt = sum(len(d["text"]) for d in docs)  # one token per byte
    assert copied >= PER_TOKEN * (prompt + 400)  # every prompt row, and the answer's
    assert PER_TOKEN * 400 < shared < copied - PER_TOKEN * prompt // 2
    assert wait_for(lambda: health(server)["kv_bytes_reserved"] == 0, timeout_s=10)


def test_a_generation_the_deadline_ends_keeps_its_text(tmp_path):
    """--timeout 2 and 8,000 forced tokens (thousands of decode steps, several seconds even for the tiny model): the
    non-streamed and the streamed reply are a 200 with the text decoded so far, finish_reason "length" (as
    llama-server's time limit ends one) and `ragkv.stopped: "deadline"`; a 504 threw the work away (the hostile soak)."""
    model = make_tiny_served(tmp_path)
    extra = ("--served-model-name", "tiny", "--timeout", "2", "--no-startup-profile")
    body = chat_body(max_tokens=8000) | {"min_tokens": 8000}
    (tmp_path / "cache").mkdir()
    with ServerProcess(model=str(model), dtype="float32", device="cpu", store="memory:16MiB", startup_s=300,
                       cache_dir=tmp_path / "cache", extra=extra) as s:
        r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["choices"][0]["finish_reason"] == "length" and out["ragkv"]["stopped"] == "deadline"
        assert 0 < out["usage"]["completion_tokens"] < 8000 and out["choices"][0]["message"]["content"]
        with httpx.stream("POST", s.url + "/v1/chat/completions", json=body | {"stream": True}, timeout=60) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2][len("data: "):])
        assert last["choices"][0]["finish_reason"] == "length" and last["ragkv"]["stopped"] == "deadline"
