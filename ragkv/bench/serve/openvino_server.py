"""A minimal OpenAI chat server over OpenVINO GenAI's continuous-batching pipeline: the `--peer openvino` of
`ragkv bench serve` (Intel's own stack for LLMs on CPUs). Run by the peer's python (.venv-ov, from
scripts/install_openvino_peer.sh), never imported by ragkv: it needs only the standard library and openvino_genai.

    python openvino_server.py --model-dir OV_FOLDER --served-model-name NAME --precision bf16 --threads 2 --port P

One thread steps the pipeline while any request is unfinished (requests join the running batch as they come,
prefix caching on); each HTTP request adds its prompt (the model's chat template applied) and streams its tokens
as OpenAI's `chat.completion.chunk` events. Greedy only: what the benchmark sends."""

from __future__ import annotations

import argparse
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class Engine:
    def __init__(self, args):
        import openvino_genai as ov_genai

        self.ov_genai = ov_genai
        sched = ov_genai.SchedulerConfig()
        sched.enable_prefix_caching = True
        sched.cache_size = args.kv_cache_gib  # GB of KV cache
        props = {"INFERENCE_PRECISION_HINT": args.precision, "KV_CACHE_PRECISION": args.precision,
                 "INFERENCE_NUM_THREADS": args.threads}
        self.pipe = ov_genai.ContinuousBatchingPipeline(args.model_dir, sched, "CPU", props)
        self.tokenizer = self.pipe.get_tokenizer()
        self.config_path = str(Path(args.model_dir) / "generation_config.json")
        self.lock = threading.Condition()
        self.ids = iter(range(1 << 62))
        self.worker = threading.Thread(target=self._loop, daemon=True, name="ov-step")
        self.worker.start()

    def _loop(self):
        while True:
            with self.lock:
                while not self.pipe.has_non_finished_requests():
                    self.lock.wait(0.05)
            self.pipe.step()

    def prompt(self, messages: list[dict]) -> str:
        history = [{"role": m["role"], "content": m.get("content") or ""} for m in messages]
        return self.tokenizer.apply_chat_template(history, add_generation_prompt=True)

    def prompt_tokens(self, text: str) -> int:
        return int(self.tokenizer.encode(text, add_special_tokens=False).input_ids.get_shape()[1])

    def start(self, text: str, max_tokens: int, min_tokens: int):
        gc = self.ov_genai.GenerationConfig(self.config_path)  # the model's end-of-sequence tokens
        gc.max_new_tokens, gc.min_new_tokens = max_tokens, min_tokens
        gc.do_sample, gc.repetition_penalty = False, 1.0
        with self.lock:
            handle = self.pipe.add_request(next(self.ids), text, gc)
            self.lock.notify()
        return handle

    def tokens(self, handle):
        """The answer's token ids as they are generated (lists of new ids)."""
        running = self.ov_genai.GenerationStatus.RUNNING
        while True:
            if handle.can_read():
                for out in handle.read().values():
                    if out.generated_ids:
                        yield list(out.generated_ids)
            elif handle.get_status() != running:
                if not handle.can_read():
                    return
            else:
                time.sleep(0.001)


def make_handler(engine: Engine, served: str):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):  # quiet: the benchmark reads its own timings
            pass

        def _json(self, code: int, body: dict):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path in ("/v1/models", "/health"):
                self._json(200, {"object": "list", "data": [{"id": served, "object": "model"}]})
            else:
                self._json(404, {"error": {"message": "not found"}})

        def do_POST(self):
            if self.path != "/v1/chat/completions":
                return self._json(404, {"error": {"message": "not found"}})
            body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
            text = engine.prompt(body["messages"])
            handle = engine.start(text, int(body.get("max_tokens") or 64), int(body.get("min_tokens") or 0))
            rid, created = "chatcmpl-" + uuid.uuid4().hex[:16], int(time.time())
            base = {"id": rid, "created": created, "model": served}
            ids, sent = [], ""
            if not body.get("stream"):
                for new in engine.tokens(handle):
                    ids += new
                answer = engine.tokenizer.decode(ids, skip_special_tokens=True)
                usage = {"prompt_tokens": engine.prompt_tokens(text), "completion_tokens": len(ids)}
                usage["total_tokens"] = usage["prompt_tokens"] + len(ids)
                return self._json(200, {**base, "object": "chat.completion", "usage": usage, "choices": [{
                    "index": 0, "message": {"role": "assistant", "content": answer},
                    "finish_reason": "length" if len(ids) >= int(body.get("max_tokens") or 64) else "stop"}]})
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()

            def event(delta: dict, finish=None):
                chunk = {**base, "object": "chat.completion.chunk",
                         "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
                data = f"data: {json.dumps(chunk)}\n\n".encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            event({"role": "assistant", "content": ""})
            for new in engine.tokens(handle):
                ids += new
                text_now = engine.tokenizer.decode(ids, skip_special_tokens=True)
                if len(text_now) > len(sent) and not text_now.endswith("\ufffd"):
                    event({"content": text_now[len(sent):]})
                    sent = text_now
            event({}, "length" if len(ids) >= int(body.get("max_tokens") or 64) else "stop")
            done = b"data: [DONE]\n\n"
            self.wfile.write(f"{len(done):x}\r\n".encode() + done + b"\r\n0\r\n\r\n")
            self.wfile.flush()

    return Handler


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True, help="a folder exported by optimum-cli export openvino")
    ap.add_argument("--served-model-name", default="model")
    ap.add_argument("--precision", default="bf16", choices=("bf16", "f32"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-gib", type=int, default=2)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    engine = Engine(args)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(engine, args.served_model_name))
    server.daemon_threads = True
    print(f"openvino peer ready on {args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
