"""The comparison peers: the same prompt as ragkv's in plain chat messages, their cells, and ragkv's ratios to
them; llama.cpp's OpenAI server (`--peer llama-cpp`: finding and starting it) here, vLLM's CPU backend
(`--peer vllm-cpu`) in peer_vllm.py."""

from __future__ import annotations

import time
from pathlib import Path

from ragkv.bench.serve.clients import connect, describe_cell, measure_cell
from ragkv.bench.serve.config import BenchRequest, ServeBenchConfig
from ragkv.bench.serve.servers import PeerServerProcess, default_threads, find_venv_python, model_gguf
from ragkv.errors import InvalidRequestError

PEER_PACKAGE = "llama-cpp-python[server]==0.3.36"
DEFAULT_PEER_PYTHON = ".venv-peer/bin/python"
PEER_INSTALL_HINT = (f"install it with `bash scripts/install_peer.sh` (builds {PEER_PACKAGE} from source into "
                     ".venv-peer; 10+ minutes on 2 cores), or pass --peer-python PATH to a python that has it")
# Each peer's request fields that make its greedy decoding ragkv's: llama-cpp-python's server samples with
# repeat_penalty 1.1 unless told otherwise; vLLM is told the same in its own field's name.
PEER_SAMPLING = {"llama-cpp": {"repeat_penalty": 1.0}, "llama-server": {"repeat_penalty": 1.0},
                 "vllm-cpu": {"repetition_penalty": 1.0}, "openvino": {}}  # openvino_server.py: greedy, no penalty


def peer_user_text(req: BenchRequest) -> str:
    """Passages and question as one user message: the text ragkv puts between the chat template's head and tail
    (its blocks, then its query), so the peer's rendered chat prompt is ragkv's prompt, character for character."""
    from ragkv.engine.request.segments import Passage, PromptFormat, render_passage

    fmt = PromptFormat()
    blocks = [render_passage(Passage(d["text"], d.get("title") or ""), fmt) for d in req.documents
              if d.get("text", "").strip()]  # ragkv skips empty passages too
    return "".join(blocks) + fmt.query_template.format(question=req.question)


def peer_payload(req: BenchRequest, system: str, peer: str = "llama-cpp") -> tuple[list[dict], dict]:
    return ([{"role": "system", "content": system}, {"role": "user", "content": peer_user_text(req)}],
            dict(PEER_SAMPLING[peer]))


PEER_RATIO_KEYS = {  # ratio name -> (cell key, lower is better)
    "ttft_p50": ("ttft_p50_ms", True), "latency_p50": ("latency_p50_ms", True),
    "latency_mean": ("latency_mean_ms", True), "requests_per_s": ("requests_per_s", False),
    "decode_tokens_per_s": ("decode_tokens_per_s", False), "output_tokens_per_s": ("output_tokens_per_s", False)}


def peer_ratios(cells: list[dict], peer: str) -> dict:
    """Each ragkv mode over the peer at the same concurrency: {mode: {concurrency: {ratio name: mine / peer's}}}.
    Below 1 is better for times (TTFT, latency), above 1 for rates (req/s, tokens/s)."""
    theirs = {c["concurrency"]: c for c in cells if c.get("system") == peer}
    out = {}
    for c in cells:
        p = theirs.get(c["concurrency"])
        if c.get("system", "ragkv") != "ragkv" or p is None:
            continue
        out.setdefault(c["mode"], {})[str(c["concurrency"])] = {
            name: round(c[key] / p[key], 3) if c.get(key) is not None and p.get(key) else None
            for name, (key, _) in PEER_RATIO_KEYS.items()}
    return out


def find_peer_python(path: str | None = None) -> Path:
    """The python that has llama-cpp-python[server]: `path`, else .venv-peer in the working directory or beside
    the ragkv checkout. Raises with the install instructions when there is none."""
    probe = "import llama_cpp.server, llama_cpp; print(llama_cpp.__version__)"
    return find_venv_python(path, DEFAULT_PEER_PYTHON, probe, "llama_cpp.server", PEER_INSTALL_HINT)


class LlamaCppServer(PeerServerProcess):
    """llama.cpp's OpenAI server (`python -m llama_cpp.server` of llama-cpp-python) on the same model's GGUF, on a
    free 127.0.0.1 port; a context manager.

    Flags that differ from its defaults, and why: `--interrupt_requests False` (by default a new request cancels
    the one streaming), `--logits_all False` (by default it keeps logits for every prompt token, which only
    logprobs need), `--n_ctx 4096` (default 2048 is shorter than a 4-passage prompt plus answer), and
    `--n_threads`/`--n_threads_batch` = ragkv's thread count (default: half the cores / all the cores).
    """

    name = "llama.cpp server"
    log_name = "llama-cpp"
    ready_path = "/v1/models"  # it loads the model before it listens

    def __init__(self, model: str = "smollm2", python: str | None = None, gguf: str | Path | None = None,
                 threads: int | None = None, n_ctx: int = 4096, startup_s: float = 300.0,
                 extra: tuple[str, ...] = ()):
        self.model = model
        self.gguf = Path(gguf) if gguf else model_gguf(model)
        if not self.gguf.exists():
            raise InvalidRequestError(f"--peer-gguf {self.gguf} does not exist")
        self.python = find_peer_python(python)
        self.threads = threads or default_threads()
        self.cmd = [str(self.python), "-m", "llama_cpp.server", "--model", str(self.gguf), "--model_alias", model,
                    "--host", "127.0.0.1", "--n_threads", str(self.threads), "--n_threads_batch", str(self.threads),
                    "--n_ctx", str(n_ctx), "--interrupt_requests", "False", "--logits_all", "False", *extra]
        self.startup_s = startup_s

    def version(self) -> str | None:
        return self._python_prints("import llama_cpp; print(llama_cpp.__version__)")

    def describe(self) -> dict:
        return {"gguf": str(self.gguf)}


def token_counter(model: str):
    """count(messages, answer) -> (prompt tokens of the rendered chat prompt, answer tokens), with the model's
    own tokenizer (the converted folder of a known model, or the model folder itself)."""
    from transformers import AutoTokenizer

    from ragkv.models.registry import resolve_model_path

    tok = AutoTokenizer.from_pretrained(str(resolve_model_path(model)))

    def count(messages: list[dict], answer: str) -> tuple[int, int]:
        prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return (len(tok(prompt, add_special_tokens=False)["input_ids"]),
                len(tok(answer, add_special_tokens=False)["input_ids"]) if answer else 0)

    return count


def run_peer(cfg: ServeBenchConfig, work: dict, url: str, progress, result: dict, count,
             server_cpu=lambda: None):
    """Connect to the peer and warm it up; returns `cells(level, concurrency)`, which runs its cell at one
    concurrency level (the same requests as ragkv's cells there)."""
    base, client, model = connect(url, cfg)
    peer = cfg.peer
    # Warm-up: one request, not streamed (its usage is reported): loads the weights into the page cache and
    # checks that the peer tokenizes the prompt to as many tokens as the client-side count says.
    messages, extra = peer_payload(work["peer_warmup"], work["system"], peer)
    t0 = time.perf_counter()
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=1, temperature=0,
                                           extra_body=extra)
    result["peer"] = {"name": peer, "url": base, "model": model, "sampling": extra,
                      "warmup_s": round(time.perf_counter() - t0, 2),
                      "prompt_tokens_reported": reply.usage.prompt_tokens if reply.usage else None,
                      "prompt_tokens_counted": count(messages, "")[0]}
    progress(f"[serve bench] {peer}: warm-up request in {result['peer']['warmup_s']} s; prompt tokens "
             f"{result['peer']['prompt_tokens_reported']} (server) vs {result['peer']['prompt_tokens_counted']} "
             f"(tokenizer)")

    def cells(level: int, c: int, rate: float | None = None) -> list[str]:
        payloads = [peer_payload(r, work["system"], peer) for r in work["plans"][level]]
        name = f"c={c}" if rate is None else f"rate={rate}"
        cell = measure_cell(result["cells" if rate is None else "rate_cells"], client, model, payloads, peer, peer,
                            c, cfg, server_cpu, count, rate=rate)
        progress(f"[serve bench] {peer} {name}: {describe_cell(cell)}")
        return [f"{peer} {name}"]
    return cells


def make_peer(name: str, model: str, dtype: str = "float32", python: str | None = None, threads: int | None = None,
              ctx: int = 4096, gguf: str | None = None, extra: tuple[str, ...] = (), binary: str | None = None,
              slots: int = 16):
    """The peer server `name` to start here (not yet started): llama.cpp's (llama-cpp-python's, or upstream
    `llama-server` with `slots` slots) on the model's GGUF, or vLLM's CPU backend on the model's converted folder
    in ragkv's dtype."""
    if binary and name != "llama-server":
        raise InvalidRequestError("--peer-binary is for --peer llama-server; the other peers are python programs "
                                  "(--peer-python)")
    if name == "llama-server":
        from ragkv.bench.serve.peer_llama_server import LlamaServer

        if python:
            raise InvalidRequestError("--peer-python is for the python peers; give llama-server as --peer-binary")
        return LlamaServer(model, binary, gguf, threads, ctx, slots, extra=extra)
    if name == "openvino":
        from ragkv.bench.serve.peer_openvino import OpenVinoServer

        if gguf:
            raise InvalidRequestError("--peer-gguf is for --peer llama-cpp or llama-server; OpenVINO exports the "
                                      "model's folder")
        return OpenVinoServer(model, python, dtype, threads, extra=extra)
    if name == "vllm-cpu":
        from ragkv.bench.serve.peer_vllm import VllmCpuServer

        if gguf:
            raise InvalidRequestError("--peer-gguf is for --peer llama-cpp or llama-server; vLLM loads the model's "
                                      "folder")
        return VllmCpuServer(model, python, dtype, threads, ctx, extra=extra)
    return LlamaCppServer(model, python, gguf, threads, ctx, extra=extra)
