"""`ragkv bench serve`: load benchmark of the OpenAI-compatible server over a shared passage pool, optionally side
by side with llama.cpp's OpenAI server (`--peer llama-cpp`) on the same requests and the same model.

The workload follows CacheBlend's "Musique extended" (EuroSys'25, section 7.1): many questions over one pool of
real MuSiQue passages; each request is a question plus k passages drawn from the pool (seeded), sent inline
through the official `openai` client. Per mode: a warm-up pass sends every pool passage once (a steady-state
server has seen them), then each concurrency level runs N streamed, greedy requests (up to `max_tokens` new
tokens) from C client threads. TTFT is measured client-side (request sent -> first streamed content chunk),
queueing included.

The peer gets the same text in plain chat messages: the same system prompt, and one user message holding the
passages and the question rendered exactly as ragkv renders its blocks and query (`ragkv.engine.request`), so
both see the same chat prompt. The two servers never run at the same time. The peer reports no usage in its
streams: its prompt and answer tokens are counted client-side with the model's own tokenizer.
"""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from ragkv.errors import InvalidRequestError, RagkvError
from ragkv.net import free_port

POOL_PER_QUESTION = 2  # passages each MuSiQue example adds to the pool: 40 passages -> 20 questions
QUESTION_DOCS = 1  # passages of the question's own example among its k (the rest: anywhere in the pool)

PEERS = ("llama-cpp",)
PEER_PACKAGE = "llama-cpp-python[server]==0.3.36"
DEFAULT_PEER_PYTHON = ".venv-peer/bin/python"
PEER_INSTALL_HINT = (f"install it with `bash scripts/install_peer.sh` (builds {PEER_PACKAGE} from source into "
                     ".venv-peer; 10+ minutes on 2 cores), or pass --peer-python PATH to a python that has it")
# llama-cpp-python's server samples with repeat_penalty 1.1 unless told otherwise: that changes greedy answers.
PEER_SAMPLING = {"repeat_penalty": 1.0}


@dataclass(frozen=True)
class ServeBenchConfig:
    modes: tuple[str, ...] = ("full", "prefix", "reuse", "blend")
    concurrency: tuple[int, ...] = (1, 4, 16)
    requests: int = 32                # per (mode, concurrency) cell
    passages_per_request: int = 4
    pool_size: int = 40
    passage_words: int = 210          # ~300 SmolLM2 tokens (MuSiQue: 1.44 tokens per word)
    max_tokens: int = 64
    seed: int = 0
    warmup: bool = True
    timeout_s: float = 900.0          # per request, client side
    peer: str | None = None           # "llama-cpp": the same requests to llama.cpp's OpenAI server

    def __post_init__(self):
        from ragkv.engine.options import MODES

        bad = [m for m in self.modes if m not in MODES]
        if bad or not (self.modes or self.peer):
            raise InvalidRequestError(f"unknown or no mode(s) {bad}; choose from {', '.join(MODES)}")
        if self.peer is not None and self.peer not in PEERS:
            raise InvalidRequestError(f"unknown peer {self.peer!r}; choose from {', '.join(PEERS)}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise InvalidRequestError(f"concurrency levels must be >= 1, got {self.concurrency}")
        if self.requests < 1 or self.max_tokens < 1 or self.passage_words < 1:
            raise InvalidRequestError("--requests, --max-tokens and --passage-words must be >= 1")
        if not 1 <= self.passages_per_request <= self.pool_size:
            raise InvalidRequestError(f"--passages-per-request must be in [1, --pool-size={self.pool_size}]")


@dataclass(frozen=True)
class BenchRequest:
    question: str
    documents: tuple[dict, ...]


# -- workload -------------------------------------------------------------------------------------------------
def build_pool(pool_size: int, passage_words: int) -> tuple[list[dict], list[str], list[list[int]]]:
    """Pool passages (`POOL_PER_QUESTION` per MuSiQue example, first `passage_words` words, no duplicates), the
    questions of those examples, and for each question the indices of its own passages in the pool."""
    from ragkv.eval.datasets import load_dataset

    pool, questions, owned, seen = [], [], [], set()
    for ex in load_dataset("musique"):
        mine = []
        for p in ex.passages:
            text = " ".join(p.text.split()[:passage_words])
            if text in seen or len(pool) == pool_size or len(mine) == POOL_PER_QUESTION:
                continue
            seen.add(text)
            mine.append(len(pool))
            pool.append({"title": p.title, "text": text})
        if mine:
            questions.append(ex.question)
            owned.append(mine)
        if len(pool) == pool_size:
            return pool, questions, owned
    raise InvalidRequestError(f"MuSiQue holds only {len(pool)} distinct passages; lower --pool-size")


def draw_requests(pool: list[dict], questions: list[str], owned: list[list[int]], n: int, k: int,
                  seed: int) -> list[BenchRequest]:
    """n requests: a question, `QUESTION_DOCS` of its own passages and k - 1 others from the pool, shuffled."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        q = rng.randrange(len(questions))
        picked = rng.sample(owned[q], min(QUESTION_DOCS, k, len(owned[q])))
        rest = [i for i in range(len(pool)) if i not in picked]
        picked += rng.sample(rest, k - len(picked))
        rng.shuffle(picked)
        out.append(BenchRequest(questions[q], tuple(pool[i] for i in picked)))
    return out


def warmup_requests(pool: list[dict], questions: list[str], owned: list[list[int]]) -> list[BenchRequest]:
    """One request per pool passage, alone: caches its block (reuse, blend) or its chain after the prefix (prefix)."""
    owner = {i: q for q, idx in enumerate(owned) for i in idx}
    return [BenchRequest(questions[owner[i]], (p,)) for i, p in enumerate(pool)]


# -- what each server is sent ---------------------------------------------------------------------------------
def system_prompt() -> str:
    """The system prompt ragkv uses for passages by default; both servers are sent it explicitly."""
    from ragkv.engine.request import PromptFormat

    return PromptFormat().system


def ragkv_payload(req: BenchRequest, mode: str, system: str) -> tuple[list[dict], dict]:
    """ragkv: the question as the user message, the passages as blocks in the `ragkv.documents` extra."""
    return ([{"role": "system", "content": system}, {"role": "user", "content": req.question}],
            {"ragkv": {"mode": mode, "documents": list(req.documents)}})


def peer_user_text(req: BenchRequest) -> str:
    """Passages and question as one user message: the text ragkv puts between the chat template's head and tail
    (its blocks, then its query), so the peer's rendered chat prompt is ragkv's prompt, character for character."""
    from ragkv.engine.request import Passage, PromptFormat, render_passage

    fmt = PromptFormat()
    blocks = [render_passage(Passage(d["text"], d.get("title") or ""), fmt) for d in req.documents
              if d.get("text", "").strip()]  # ragkv skips empty passages too
    return "".join(blocks) + fmt.query_template.format(question=req.question)


def peer_payload(req: BenchRequest, system: str) -> tuple[list[dict], dict]:
    return ([{"role": "system", "content": system}, {"role": "user", "content": peer_user_text(req)}],
            dict(PEER_SAMPLING))


# -- client side ----------------------------------------------------------------------------------------------
def percentile(xs: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def timed_request(client, model: str, messages: list[dict], extra_body: dict, max_tokens: int) -> dict:
    """One streamed greedy chat request: TTFT, end-to-end latency, the answer text and the server's ragkv stats."""
    t0 = time.perf_counter()
    ttft, stats, pieces, chunks = None, {}, [], 0
    try:
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True, extra_body=extra_body)
        for chunk in stream:
            if chunk.choices:
                choice = chunk.choices[0]
                if choice.delta is not None and choice.delta.content:
                    pieces.append(choice.delta.content)
                    chunks += 1
                if ttft is None and ((choice.delta is not None and choice.delta.content) or choice.finish_reason):
                    ttft = time.perf_counter() - t0  # the role chunk carries "" and does not count
            extra = (chunk.model_extra or {}).get("ragkv")
            if extra:
                stats = extra.get("stats", {})
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        return {"error": f"{type(e).__name__}: {e}"}
    return {"ttft_s": ttft, "latency_s": time.perf_counter() - t0, "stats": stats, "text": "".join(pieces),
            "content_chunks": chunks}


def run_cell(client, model: str, payloads: list[tuple[list[dict], dict]], mode: str, concurrency: int,
             max_tokens: int, system: str = "ragkv", count=None) -> dict:
    """N requests from `concurrency` closed-loop clients; requests/s over the wall time of all of them.
    `client` may be a list of clients (servers behind one store): request i goes to client i mod their number,
    as a round-robin balancer would send it, and the cell gets a per-server breakdown.

    `count(messages, text) -> (prompt_tokens, completion_tokens)` fills in what the server did not report
    (after the cell, outside the timing)."""
    clients = client if isinstance(client, list) else [client]

    def send(item):
        i, (messages, extra) = item
        return {**timed_request(clients[i % len(clients)], model, messages, extra, max_tokens),
                "server": i % len(clients)}

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(send, enumerate(payloads)))
    wall = time.perf_counter() - t0
    if count is not None:
        for (messages, _), r in zip(payloads, results):
            if "error" not in r and "completion_tokens" not in r["stats"]:
                prompt, completion = count(messages, r["text"])
                r["stats"] = {**r["stats"], "prompt_tokens": prompt, "completion_tokens": completion}
                r["counted"] = True
    cell = summarize(results, wall, mode, concurrency, system)
    if len(clients) > 1:
        cell["per_server"] = [{"server": i, **{k: v for k, v in summarize(
            [r for r in results if r["server"] == i], wall, mode, concurrency, system).items()
            if k in PER_SERVER_KEYS}} for i in range(len(clients))]
    return cell


PER_SERVER_KEYS = ("requests", "ok", "ttft_p50_ms", "ttft_p95_ms", "latency_mean_ms", "server_ttft_p50_ms",
                   "reused_tokens", "recomputed_tokens", "cache_misses")


def summarize(results: list[dict], wall: float, mode: str, concurrency: int, system: str = "ragkv") -> dict:
    ok = [r for r in results if "error" not in r and r["ttft_s"] is not None]
    errors = sorted({r["error"] for r in results if "error" in r})[:5]
    ttft = [r["ttft_s"] for r in ok]
    lat = [r["latency_s"] for r in ok]

    def mean_stat(key):
        vals = [r["stats"][key] for r in ok if key in r["stats"]]
        return round(sum(vals) / len(vals), 1) if vals else None

    def ms(x):
        return None if x is None else round(1000 * x, 1)

    # Decode speed per request: the tokens after the first over the time after the first (needs >= 2 tokens).
    out_tokens = [r["stats"].get("completion_tokens") for r in ok]
    decode = [(n - 1) / (r["latency_s"] - r["ttft_s"]) for r, n in zip(ok, out_tokens)
              if n is not None and n >= 2 and r["latency_s"] > r["ttft_s"]]
    counted = [n for n in out_tokens if n is not None]
    server_ttft = [r["stats"]["ttft_ms"] for r in ok if "ttft_ms" in r["stats"]]
    return {"system": system, "mode": mode, "concurrency": concurrency, "requests": len(results), "ok": len(ok),
            "failed": len(results) - len(ok), "errors": errors, "wall_s": round(wall, 2),
            "requests_per_s": round(len(ok) / wall, 4),
            "ttft_p50_ms": ms(percentile(ttft, 50)), "ttft_p95_ms": ms(percentile(ttft, 95)),
            "latency_p50_ms": ms(percentile(lat, 50)), "latency_p95_ms": ms(percentile(lat, 95)),
            "latency_mean_ms": ms(sum(lat) / len(lat)) if lat else None,
            "decode_tokens_per_s": round(sum(decode) / len(decode), 2) if decode else None,
            "output_tokens_per_s": round(sum(counted) / wall, 2) if counted else None,
            "server_ttft_p50_ms": None if not server_ttft else round(percentile(server_ttft, 50), 1),
            "prompt_tokens": mean_stat("prompt_tokens"), "reused_tokens": mean_stat("reused_tokens"),
            "recomputed_tokens": mean_stat("recomputed_tokens"), "completion_tokens": mean_stat("completion_tokens"),
            "tokens_counted_by": ("tokenizer (client side)" if any(r.get("counted") for r in ok)
                                  else "server" if counted else None),
            "cache_misses": mean_stat("cache_misses"), "decode_ms": mean_stat("decode_ms"),
            "sample_answer": ok[0]["text"][:300] if ok else None}


def slo_ratios(cells: list[dict], baseline: str = "full") -> dict:
    """Throughput ratio to `baseline` at its p95 TTFT: for each baseline cell, the mode's best requests/s among its
    cells whose p95 TTFT is no higher (CacheBlend fig. 11 reads throughput at equal TTFT), over the baseline's."""
    base = [c for c in cells if c["mode"] == baseline and c["ttft_p95_ms"] is not None]
    out = {}
    for mode in dict.fromkeys(c["mode"] for c in cells if c["mode"] != baseline):
        mine = [c for c in cells if c["mode"] == mode and c["ttft_p95_ms"] is not None]
        rows = []
        for b in base:
            fit = [c["requests_per_s"] for c in mine if c["ttft_p95_ms"] <= b["ttft_p95_ms"]]
            rows.append({"baseline_concurrency": b["concurrency"], "p95_ttft_budget_ms": b["ttft_p95_ms"],
                         "ratio": round(max(fit) / b["requests_per_s"], 2) if fit and b["requests_per_s"] else None})
        same_c = {c["concurrency"]: c for c in mine}
        out[mode] = {"at_baseline_p95_ttft": rows, "at_same_concurrency": {
            str(b["concurrency"]): round(same_c[b["concurrency"]]["requests_per_s"] / b["requests_per_s"], 2)
            for b in base if b["concurrency"] in same_c and b["requests_per_s"]}}
    return out


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


# -- servers --------------------------------------------------------------------------------------------------
class _ServerSubprocess:
    """A server subprocess on a free 127.0.0.1 port, its output in a log file, ready once `ready_path` answers
    200; a context manager that stops it on exit. Subclasses set `cmd`, `startup_s`, `name` and `_spawn`."""

    name = "server"
    ready_path = "/health"

    def _wait_ready(self) -> None:
        import httpx

        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._stop()
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self._log_tail()}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self._stop()
        raise RuntimeError(f"{self.name} did not answer {self.ready_path} in {self.startup_s:.0f} s:\n"
                           f"{self._log_tail()}")

    def cpu_seconds(self) -> float | None:
        """User + system CPU time of the server so far (Linux /proc), or None where unavailable."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None

    def _log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""

    def _stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class ServerProcess(_ServerSubprocess):
    """`ragkv serve` as a subprocess on a free port; a context manager.

    Its cache folder (KV disk tier, index, log) is `cache_dir`, or a throw-away one when None.
    """

    name = "ragkv serve"

    def __init__(self, model: str = "smollm2", dtype: str = "float32", device: str = "auto",
                 store: str = "memory:2GiB", startup_s: float = 300.0, cache_dir: Path | None = None,
                 extra: tuple[str, ...] = (), threads: int | None = None):
        self.model = model
        self.threads = threads  # torch's threads in the server (None: its default, every core)
        self.cmd = [sys.executable, "-m", "ragkv.cli", "serve", "--model", model, "--dtype", dtype,
                    "--device", device, "--store", store, *extra]
        self.startup_s = startup_s
        self.cache_dir = cache_dir

    def __enter__(self) -> "ServerProcess":
        from ragkv.config import models_dir

        self.tmp = None if self.cache_dir else tempfile.TemporaryDirectory(prefix="ragkv-bench-serve-",
                                                                           ignore_cleanup_errors=True)
        root = Path(self.cache_dir) if self.cache_dir else Path(self.tmp.name)
        self.port = free_port()
        env = dict(os.environ, RAGKV_CACHE_DIR=str(root), RAGKV_MODELS_DIR=str(models_dir()))
        if self.threads:
            env["OMP_NUM_THREADS"] = str(self.threads)
        self.log_path = root / f"server-{self.port}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd + ["--port", str(self.port), "--index", str(root / "index")],
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready()
        except BaseException:
            if self.tmp is not None:
                self.tmp.cleanup()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stop()
        if self.tmp is not None:
            self.tmp.cleanup()


def model_gguf(model: str) -> Path:
    """The GGUF a known model is converted from (the file the registry converts on first use)."""
    from ragkv.models.registry import KNOWN_MODELS, gguf_path

    known = KNOWN_MODELS.get(model)
    if known is None:
        raise InvalidRequestError(f"--peer needs the model's GGUF: {model!r} is not a known model "
                                  f"({', '.join(KNOWN_MODELS)}); pass --peer-gguf PATH")
    return gguf_path(known)


def find_peer_python(path: str | None = None) -> Path:
    """The python that has llama-cpp-python[server]: `path`, else .venv-peer in the working directory or beside
    the ragkv checkout. Raises with the install instructions when there is none."""
    import shutil

    if path:
        candidates = [Path(path).expanduser()]
    else:
        candidates = [Path(DEFAULT_PEER_PYTHON), Path(__file__).resolve().parents[2] / DEFAULT_PEER_PYTHON]
    for c in candidates:
        found = c if c.exists() else (Path(shutil.which(str(c))) if shutil.which(str(c)) else None)
        if found is None:
            continue
        check = subprocess.run([str(found), "-c", "import llama_cpp.server, llama_cpp; print(llama_cpp.__version__)"],
                               capture_output=True, text=True, timeout=120)
        if check.returncode == 0:
            return found
        raise RagkvError(f"{found} cannot import llama_cpp.server ({check.stderr.strip().splitlines()[-1:]}); "
                         + PEER_INSTALL_HINT)
    raise RagkvError(f"the llama-cpp peer is not installed (no {' or '.join(map(str, candidates))}); "
                     + PEER_INSTALL_HINT)


def default_threads() -> int:
    """The thread count `ragkv serve` computes with by default (torch's intra-op threads)."""
    try:
        import torch
        return torch.get_num_threads()
    except ImportError:
        return os.cpu_count() or 1


class LlamaCppServer(_ServerSubprocess):
    """llama.cpp's OpenAI server (`python -m llama_cpp.server` of llama-cpp-python) on the same model's GGUF, on a
    free 127.0.0.1 port; a context manager.

    Flags that differ from its defaults, and why: `--interrupt_requests False` (by default a new request cancels
    the one streaming), `--logits_all False` (by default it keeps logits for every prompt token, which only
    logprobs need), `--n_ctx 4096` (default 2048 is shorter than a 4-passage prompt plus answer), and
    `--n_threads`/`--n_threads_batch` = ragkv's thread count (default: half the cores / all the cores).
    """

    name = "llama.cpp server"
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
        out = subprocess.run([str(self.python), "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                             capture_output=True, text=True, timeout=120)
        return out.stdout.strip() or None

    def __enter__(self) -> "LlamaCppServer":
        self.tmp = tempfile.TemporaryDirectory(prefix="ragkv-bench-peer-", ignore_cleanup_errors=True)
        self.port = free_port()
        self.log_path = Path(self.tmp.name) / f"llama-cpp-{self.port}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd + ["--port", str(self.port)], stdout=self.log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            self._wait_ready()
        except BaseException:
            self.tmp.cleanup()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stop()
        self.tmp.cleanup()


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


# -- the benchmark --------------------------------------------------------------------------------------------
def run_serve_bench(cfg: ServeBenchConfig, url: str | list[str] | None = None, out_dir: Path = Path("bench_out"),
                    progress=print, server: ServerProcess | None = None, peer: LlamaCppServer | None = None,
                    peer_url: str | None = None, model: str = "smollm2", count=None) -> dict:
    """Run every (mode, concurrency) cell against `url`, or against a server started here (and stopped after);
    several URLs (servers sharing a store) take the requests round-robin, and only the first is warmed up, so
    the others' hits come from the shared tiers;
    then, with `cfg.peer`, the same cells' requests against `peer_url` or a peer started here. Writes
    serve_bench.json, .png and .md under `out_dir`; returns the JSON object. `count` counts the peer's tokens
    (default: `token_counter` of the model)."""
    from ragkv.bench.common import save_json

    work = _workload(cfg)
    result = {"benchmark": "serve", "config": asdict(cfg), "url": None, "server": {},
              "machine": {"cpus": os.cpu_count()}, "warmup": {}, "cells": []}
    if cfg.modes:
        if url is None:
            group = server if isinstance(server, list) else [server or ServerProcess(model)]
            with contextlib.ExitStack() as stack:
                started = [stack.enter_context(s) for s in group]
                _run(cfg, work, started[0].url if len(started) == 1 else [s.url for s in started], progress,
                     result, lambda: _cpu_seconds(started))
                result["server"]["started_here"] = [" ".join(s.cmd) for s in started]
                result["server"]["threads"] = [s.threads for s in started]  # None: torch's default (every core)
        else:
            _run(cfg, work, url, progress, result)
    if cfg.peer:
        count = count or token_counter(getattr(peer, "model", None) or getattr(server, "model", None) or model)
        if peer_url is None:
            with peer or LlamaCppServer(model) as p:
                _run_peer(cfg, work, p.url, progress, result, count, p.cpu_seconds)
                result["peer"].update(started_here=" ".join(p.cmd), version=p.version(), threads=p.threads,
                                      gguf=str(p.gguf))
        else:
            _run_peer(cfg, work, peer_url, progress, result, count)
        result["ratios_vs_peer"] = peer_ratios(result["cells"], cfg.peer)
    ragkv_cells = [c for c in result["cells"] if c["system"] == "ragkv"]
    result["ratios_vs_full"] = slo_ratios(ragkv_cells) if "full" in cfg.modes else {}
    result["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    save_json(out_dir / "serve_bench.json", result)
    plot_serve_bench(result["cells"], out_dir / "serve_bench.png")
    (out_dir / "serve_bench.md").write_text(render_markdown(result) + "\n")
    return result


def _wait_written(base: str, timeout_s: float = 60.0) -> None:
    """Wait until the server at `base` has no new block on its way to a slower tier (its /health
    `write_back_pending`), or `timeout_s`."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while httpx.get(base + "/health", timeout=10).json().get("write_back_pending", 0) and time.monotonic() < deadline:
        time.sleep(0.1)


def _cpu_seconds(servers: list[ServerProcess]) -> float | None:
    """The servers' CPU time so far, together (None where any is unreadable)."""
    cpu = [s.cpu_seconds() for s in servers]
    return None if None in cpu else sum(cpu)


def _workload(cfg: ServeBenchConfig) -> dict:
    pool, questions, owned = build_pool(cfg.pool_size, cfg.passage_words)
    plans = [draw_requests(pool, questions, owned, cfg.requests, cfg.passages_per_request, cfg.seed * 1000 + i)
             for i in range(len(cfg.concurrency))]  # fresh requests per level, the same for every mode and peer
    # The peer's warm-up request is none of the measured ones: llama.cpp reuses the longest common prefix with the
    # prompt it ran last, so warming up on the first measured request would make that one nearly free.
    peer_warmup = draw_requests(pool, questions, owned, 1, cfg.passages_per_request, cfg.seed * 1000 + 999)[0]
    return {"pool": pool, "questions": questions, "owned": owned, "plans": plans, "system": system_prompt(),
            "peer_warmup": peer_warmup}


def _client(url: str, cfg: ServeBenchConfig):
    import openai

    base = url.rstrip("/").removesuffix("/v1")
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=cfg.timeout_s)
    return base, client, client.models.list().data[0].id


def _measure(cells: list[dict], client, model: str, payloads, label: str, system: str, c: int,
             cfg: ServeBenchConfig, server_cpu, count=None) -> dict:
    cpu0 = server_cpu()
    cell = run_cell(client, model, payloads, label, c, cfg.max_tokens, system, count)
    cpu1 = server_cpu()  # CPU time per request: the service demand, whatever share of the cores it got
    cell["server_cpu_s_per_request"] = None if cpu0 is None or cpu1 is None else round(
        (cpu1 - cpu0) / max(cell["ok"], 1), 3)
    cell["loadavg_1m"] = round(os.getloadavg()[0], 2)
    cells.append(cell)
    return cell


def batching_stats(before: dict, after: dict) -> dict:
    """The server's continuous batching during a cell: decode steps, mean batch, prefill pauses per step."""
    steps = after.get("decode_steps", 0) - before.get("decode_steps", 0)
    if steps <= 0 or "batched_tokens" not in after:
        return {}
    stall = after["prefill_stall_ms_total"] - before["prefill_stall_ms_total"]
    return {"decode_steps": steps,
            "mean_batch": round((after["batched_tokens"] - before["batched_tokens"]) / steps, 2),
            "prefill_stall_ms_per_step": round(stall / steps, 2),
            "prefill_stall_ms_max_so_far": after["prefill_stall_ms_max"]}


def _describe(cell: dict) -> str:
    return (f"{cell['requests_per_s']} req/s, TTFT p50 {cell['ttft_p50_ms']} p95 {cell['ttft_p95_ms']} ms, "
            f"e2e mean {cell['latency_mean_ms']} ms, decode {cell['decode_tokens_per_s']} tok/s, "
            f"{cell['completion_tokens']} out tokens, {cell['failed']} failed")


def _run(cfg: ServeBenchConfig, work: dict, url: str | list[str], progress, result: dict,
         server_cpu=lambda: None) -> None:
    import httpx

    servers = [_client(u, cfg) for u in ([url] if isinstance(url, str) else url)]
    models = {m for _, _, m in servers}
    if len(models) > 1:
        raise InvalidRequestError(f"the servers serve different models ({', '.join(sorted(models))}); a shared "
                                  "store's benchmark wants one model behind every URL")
    base, client, model = servers[0]
    health = httpx.get(base + "/health", timeout=10).json()
    result["url"] = base if len(servers) == 1 else [b for b, _, _ in servers]
    result["server"].update(model=model, dtype=health.get("dtype"))
    clients = [c for _, c, _ in servers]  # run_cell round-robins over them (one: every request to it)
    for mode in cfg.modes:
        if cfg.warmup:
            t0 = time.perf_counter()
            for req in warmup_requests(work["pool"], work["questions"], work["owned"]):
                messages, extra = ragkv_payload(req, mode, work["system"])
                client.chat.completions.create(model=model, messages=messages, max_tokens=1, temperature=0,
                                               extra_body=extra)
            result["warmup"][mode] = {"requests": len(work["pool"]), "seconds": round(time.perf_counter() - t0, 2)}
            if len(servers) > 1:  # the others should find the warm-up's blocks in the shared tiers, written by now
                _wait_written(base)
            progress(f"[serve bench] {mode}: warm-up, {len(work['pool'])} single-passage requests in "
                     f"{result['warmup'][mode]['seconds']} s")
        for c, reqs in zip(cfg.concurrency, work["plans"]):
            payloads = [ragkv_payload(r, mode, work["system"]) for r in reqs]
            h0 = httpx.get(base + "/health", timeout=10).json()
            cell = _measure(result["cells"], clients, model, payloads, mode, "ragkv", c, cfg, server_cpu)
            if len(servers) == 1:  # one server's batching counters; with several, its share would mislead
                cell.update(batching_stats(h0, httpx.get(base + "/health", timeout=10).json()))
            progress(f"[serve bench] {mode} c={c}: {_describe(cell)}; reused {cell['reused_tokens']} / "
                     f"{cell['prompt_tokens']} prompt tokens")


def _run_peer(cfg: ServeBenchConfig, work: dict, url: str, progress, result: dict, count,
              server_cpu=lambda: None) -> None:
    base, client, model = _client(url, cfg)
    peer = cfg.peer
    # Warm-up: one request, not streamed (its usage is reported): loads the weights into the page cache and
    # checks that the peer tokenizes the prompt to as many tokens as the client-side count says.
    messages, extra = peer_payload(work["peer_warmup"], work["system"])
    t0 = time.perf_counter()
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=1, temperature=0,
                                           extra_body=extra)
    result["peer"] = {"name": peer, "url": base, "model": model, "sampling": dict(PEER_SAMPLING),
                      "warmup_s": round(time.perf_counter() - t0, 2),
                      "prompt_tokens_reported": reply.usage.prompt_tokens if reply.usage else None,
                      "prompt_tokens_counted": count(messages, "")[0]}
    progress(f"[serve bench] {peer}: warm-up request in {result['peer']['warmup_s']} s; prompt tokens "
             f"{result['peer']['prompt_tokens_reported']} (server) vs {result['peer']['prompt_tokens_counted']} "
             f"(tokenizer)")
    for c, reqs in zip(cfg.concurrency, work["plans"]):
        payloads = [peer_payload(r, work["system"]) for r in reqs]
        cell = _measure(result["cells"], client, model, payloads, peer, peer, c, cfg, server_cpu, count)
        progress(f"[serve bench] {peer} c={c}: {_describe(cell)}")


def plot_serve_bench(cells: list[dict], path: Path) -> Path:
    """Left: throughput vs p95 TTFT per mode (and the peer). Right: mean end-to-end latency per concurrency."""
    from matplotlib.ticker import FuncFormatter

    from ragkv.figures import pyplot, save_figure

    fig, (ax, ax2) = pyplot().subplots(1, 2, figsize=(12, 4.5))
    for mode in dict.fromkeys(c["mode"] for c in cells):
        pts = [c for c in cells if c["mode"] == mode and c["ttft_p95_ms"] is not None]
        if not pts:
            continue
        style = {"linestyle": "--", "color": "black"} if pts[0].get("system", "ragkv") != "ragkv" else {}
        ax.plot([c["requests_per_s"] for c in pts], [c["ttft_p95_ms"] / 1000 for c in pts], marker="o",
                label=mode, **style)
        for c in pts:
            ax.annotate(f"c={c['concurrency']}", (c["requests_per_s"], c["ttft_p95_ms"] / 1000), fontsize=7,
                        textcoords="offset points", xytext=(4, 4))
        lat = [c for c in pts if c.get("latency_mean_ms") is not None]
        if lat:
            ax2.plot([c["concurrency"] for c in lat], [c["latency_mean_ms"] / 1000 for c in lat], marker="o",
                     label=mode, **style)
    ax.set_yscale("log")
    ax.set_xlim(left=0)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: f"{y:g}" if f"{y:.1g}"[0] in "25" else ""))
    ax.set_xlabel("throughput (requests/s)"), ax.set_ylabel("p95 TTFT (s, client side)")
    ax.set_title("throughput vs p95 TTFT (MuSiQue passage pool)")
    ax2.set_xscale("log", base=2)
    ax2.set_xticks(sorted({c["concurrency"] for c in cells}))
    ax2.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    ax2.set_ylim(bottom=0)
    ax2.set_xlabel("concurrent clients"), ax2.set_ylabel("mean end-to-end latency (s)")
    ax2.set_title("end-to-end latency (streamed answer)")
    for a in (ax, ax2):
        a.grid(True, alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend()
    return save_figure(fig, path)


plot_throughput_ttft = plot_serve_bench  # the earlier name


def render_markdown(result: dict) -> str:
    from ragkv.bench.common import markdown_table

    cells = result["cells"]
    full = {c["concurrency"]: c["requests_per_s"] for c in cells if c["mode"] == "full"}
    rows = [[c.get("system", "ragkv"), c["mode"], c["concurrency"], f"{c['ok']}/{c['requests']}",
             c["requests_per_s"],
             f"{c['requests_per_s'] / full[c['concurrency']]:.2f}x" if full.get(c["concurrency"]) else "-",
             c["ttft_p50_ms"], c["ttft_p95_ms"], c.get("latency_p50_ms"), c.get("latency_p95_ms"),
             c.get("latency_mean_ms"), c.get("decode_tokens_per_s"), c.get("output_tokens_per_s"),
             c["server_ttft_p50_ms"], c.get("server_cpu_s_per_request"), c["prompt_tokens"], c["reused_tokens"],
             c.get("completion_tokens"), c.get("loadavg_1m")] for c in cells]
    lines = [markdown_table(["system", "mode", "clients", "ok", "req/s", "vs full", "TTFT p50 ms", "TTFT p95 ms",
                             "e2e p50 ms", "e2e p95 ms", "e2e mean ms", "decode tok/s", "output tok/s",
                             "server prefill p50 ms", "server CPU s/req", "prompt tok", "reused tok", "out tok",
                             "load 1m"], rows)]
    for mode, r in result.get("ratios_vs_full", {}).items():
        at = ", ".join(f"{'no cell fits' if x['ratio'] is None else str(x['ratio']) + 'x'} (full c="
                       f"{x['baseline_concurrency']}, p95 <= {x['p95_ttft_budget_ms']} ms)"
                       for x in r["at_baseline_p95_ttft"])
        lines.append(f"- {mode}: requests/s vs full at full's p95 TTFT: {at}")
    shared = [(c, s) for c in cells for s in c.get("per_server", [])]
    if shared:
        urls = result["url"]
        lines += ["", f"Per server ({len(urls)} servers sharing one store, requests round-robin; only server 0 "
                      "ran the warm-up, so the others' reused tokens came from the shared tiers):", "",
                  markdown_table(["mode", "clients", "server", "ok", "TTFT p50 ms", "TTFT p95 ms", "e2e mean ms",
                                  "server prefill p50 ms", "reused tok", "recomputed tok", "misses"],
                                 [[c["mode"], c["concurrency"], f"{s['server']}: {urls[s['server']]}",
                                   f"{s['ok']}/{s['requests']}", s["ttft_p50_ms"], s["ttft_p95_ms"],
                                   s["latency_mean_ms"], s["server_ttft_p50_ms"], s["reused_tokens"],
                                   s["recomputed_tokens"], s["cache_misses"]] for c, s in shared])]
    batching = [c for c in cells if "mean_batch" in c]
    if batching:
        lines += ["", "Continuous batching inside ragkv's server per cell (prefill runs in units between decode "
                      "steps; a stall is the pause those units impose on running answers):", "",
                  markdown_table(["mode", "clients", "decode steps", "mean batch", "prefill stall ms per step",
                                  "longest stall so far ms"],
                                 [[c["mode"], c["concurrency"], c["decode_steps"], c["mean_batch"],
                                   c["prefill_stall_ms_per_step"], c["prefill_stall_ms_max_so_far"]]
                                  for c in batching])]
    ratios = result.get("ratios_vs_peer") or {}
    if ratios:
        peer = result["peer"]["name"]
        lines += ["", f"Each ragkv mode over {peer} at the same number of clients (times: below 1x is faster; "
                      "rates: above 1x is more):", ""]
        fmt = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
        lines.append(markdown_table(
            ["mode", "clients", "TTFT p50", "e2e p50", "e2e mean", "req/s", "decode tok/s", "output tok/s"],
            [[mode, c, *(fmt(r[k]) for k in PEER_RATIO_KEYS)] for mode, per in ratios.items()
             for c, r in per.items()]))
        lines.append("")
        for mode, per in ratios.items():
            parts = []
            first = min(per, key=int)
            if per[first]["latency_mean"] is not None:
                parts.append(f"end-to-end mean {fmt(per[first]['latency_mean'])} {peer}'s at {first} client(s)")
            for c, r in per.items():
                if int(c) > 1 and r["requests_per_s"] is not None:
                    parts.append(f"{fmt(r['requests_per_s'])} its req/s at {c} clients")
            if parts:
                lines.append(f"- {mode}: " + ", ".join(parts))
        p = result["peer"]
        lines.append(f"- {peer}: {p.get('version') or '?'}, {p.get('threads') or '?'} threads, greedy with "
                     f"{p['sampling']}; prompt tokens of the first request {p['prompt_tokens_reported']} (server) "
                     f"vs {p['prompt_tokens_counted']} (tokenizer); its answer tokens are counted with the "
                     "model's tokenizer (its streams report no usage)")
    return "\n".join(lines)
