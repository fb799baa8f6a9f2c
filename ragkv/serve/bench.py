"""`ragkv bench serve`: load benchmark of the OpenAI-compatible server over a shared passage pool.

The workload follows CacheBlend's "Musique extended" (EuroSys'25, section 7.1): many questions over one pool of
real MuSiQue passages; each request is a question plus k passages drawn from the pool (seeded), sent inline
through the official `openai` client. Per mode: a warm-up pass sends every pool passage once (a steady-state
server has seen them), then each concurrency level runs N streamed requests from C client threads. TTFT is
measured client-side (request sent -> first streamed content chunk), queueing included.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from ragkv.errors import InvalidRequestError
from ragkv.net import free_port

POOL_PER_QUESTION = 2  # passages each MuSiQue example adds to the pool: 40 passages -> 20 questions
QUESTION_DOCS = 1  # passages of the question's own example among its k (the rest: anywhere in the pool)


@dataclass(frozen=True)
class ServeBenchConfig:
    modes: tuple[str, ...] = ("full", "prefix", "reuse", "blend")
    concurrency: tuple[int, ...] = (1, 4, 16)
    requests: int = 32                # per (mode, concurrency) cell
    passages_per_request: int = 4
    pool_size: int = 40
    passage_words: int = 210          # ~300 SmolLM2 tokens (MuSiQue: 1.44 tokens per word)
    max_tokens: int = 8
    seed: int = 0
    warmup: bool = True
    timeout_s: float = 900.0          # per request, client side

    def __post_init__(self):
        from ragkv.engine.options import MODES

        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise InvalidRequestError(f"unknown or no mode(s) {bad}; choose from {', '.join(MODES)}")
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


def timed_request(client, model: str, req: BenchRequest, mode: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    ttft, stats = None, {}
    try:
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": req.question}], max_tokens=max_tokens,
            temperature=0, stream=True, extra_body={"ragkv": {"mode": mode, "documents": list(req.documents)}})
        for chunk in stream:
            if ttft is None and chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].finish_reason):
                ttft = time.perf_counter() - t0  # the role chunk carries "" and does not count
            extra = (chunk.model_extra or {}).get("ragkv")
            if extra:
                stats = extra.get("stats", {})
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        return {"error": f"{type(e).__name__}: {e}"}
    return {"ttft_s": ttft, "latency_s": time.perf_counter() - t0, "stats": stats}


def run_cell(client, model: str, reqs: list[BenchRequest], mode: str, concurrency: int, max_tokens: int) -> dict:
    """N requests from `concurrency` closed-loop clients; requests/s over the wall time of all of them."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda r: timed_request(client, model, r, mode, max_tokens), reqs))
    return summarize(results, time.perf_counter() - t0, mode, concurrency)


def summarize(results: list[dict], wall: float, mode: str, concurrency: int) -> dict:
    ok = [r for r in results if "error" not in r and r["ttft_s"] is not None]
    errors = sorted({r["error"] for r in results if "error" in r})[:5]
    ttft = [r["ttft_s"] for r in ok]
    lat = [r["latency_s"] for r in ok]

    def mean_stat(key):
        vals = [r["stats"][key] for r in ok if key in r["stats"]]
        return round(sum(vals) / len(vals), 1) if vals else None

    def ms(x):
        return None if x is None else round(1000 * x, 1)

    server_ttft = [r["stats"]["ttft_ms"] for r in ok if "ttft_ms" in r["stats"]]
    return {"mode": mode, "concurrency": concurrency, "requests": len(results), "ok": len(ok),
            "failed": len(results) - len(ok), "errors": errors, "wall_s": round(wall, 2),
            "requests_per_s": round(len(ok) / wall, 4),
            "ttft_p50_ms": ms(percentile(ttft, 50)), "ttft_p95_ms": ms(percentile(ttft, 95)),
            "latency_p50_ms": ms(percentile(lat, 50)), "latency_p95_ms": ms(percentile(lat, 95)),
            "server_ttft_p50_ms": None if not server_ttft else round(percentile(server_ttft, 50), 1),
            "prompt_tokens": mean_stat("prompt_tokens"), "reused_tokens": mean_stat("reused_tokens"),
            "recomputed_tokens": mean_stat("recomputed_tokens"), "completion_tokens": mean_stat("completion_tokens"),
            "cache_misses": mean_stat("cache_misses"), "decode_ms": mean_stat("decode_ms")}


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


# -- own server -----------------------------------------------------------------------------------------------
class ServerProcess:
    """`ragkv serve` as a subprocess on a free port; a context manager.

    Its cache folder (KV disk tier, index, log) is `cache_dir`, or a throw-away one when None.
    """

    def __init__(self, model: str = "smollm2", dtype: str = "float32", device: str = "auto",
                 store: str = "memory:2GiB", startup_s: float = 300.0, cache_dir: Path | None = None,
                 extra: tuple[str, ...] = ()):
        self.cmd = [sys.executable, "-m", "ragkv.cli", "serve", "--model", model, "--dtype", dtype,
                    "--device", device, "--store", store, *extra]
        self.startup_s = startup_s
        self.cache_dir = cache_dir

    def __enter__(self) -> "ServerProcess":
        import httpx

        from ragkv.config import models_dir

        self.tmp = None if self.cache_dir else tempfile.TemporaryDirectory(prefix="ragkv-bench-serve-",
                                                                           ignore_cleanup_errors=True)
        root = Path(self.cache_dir) if self.cache_dir else Path(self.tmp.name)
        self.port = free_port()
        env = dict(os.environ, RAGKV_CACHE_DIR=str(root), RAGKV_MODELS_DIR=str(models_dir()))
        self.log_path = root / f"server-{self.port}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd + ["--port", str(self.port), "--index", str(root / "index")],
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._stop()
                raise RuntimeError(f"ragkv serve exited with {self.proc.returncode}:\n{self._log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.3)
        self._stop()
        raise RuntimeError(f"ragkv serve did not answer /health in {self.startup_s:.0f} s:\n{self._log_tail()}")

    def cpu_seconds(self) -> float | None:
        """User + system CPU time of the server so far (Linux /proc), or None where unavailable."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None

    def _log_tail(self) -> str:
        return self.log_path.read_text()[-3000:] if self.log_path.exists() else ""

    def _stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __exit__(self, *exc) -> None:
        self._stop()
        if self.tmp is not None:
            self.tmp.cleanup()


# -- the benchmark --------------------------------------------------------------------------------------------
def run_serve_bench(cfg: ServeBenchConfig, url: str | None = None, out_dir: Path = Path("bench_out"),
                    progress=print, server: ServerProcess | None = None) -> dict:
    """Run every (mode, concurrency) cell against `url`, or against a server started here (and stopped after).
    Writes serve_bench.json, .png and .md under `out_dir`; returns the JSON object."""
    from ragkv.bench.common import save_json

    if url is None:
        with server or ServerProcess() as s:
            result = _run(cfg, s.url, progress, s.cpu_seconds)
            result["server"]["started_here"] = " ".join(s.cmd)
    else:
        result = _run(cfg, url, progress)
    save_json(out_dir / "serve_bench.json", result)
    plot_throughput_ttft(result["cells"], out_dir / "serve_bench.png")
    (out_dir / "serve_bench.md").write_text(render_markdown(result) + "\n")
    return result


def _run(cfg: ServeBenchConfig, url: str, progress, server_cpu=lambda: None) -> dict:
    import httpx
    import openai

    base = url.rstrip("/").removesuffix("/v1")
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=cfg.timeout_s)
    model = client.models.list().data[0].id
    health = httpx.get(base + "/health", timeout=10).json()
    pool, questions, owned = build_pool(cfg.pool_size, cfg.passage_words)
    plans = [draw_requests(pool, questions, owned, cfg.requests, cfg.passages_per_request, cfg.seed * 1000 + i)
             for i in range(len(cfg.concurrency))]  # fresh requests per level, the same for every mode
    cells, warmups = [], {}
    for mode in cfg.modes:
        if cfg.warmup:
            t0 = time.perf_counter()
            for req in warmup_requests(pool, questions, owned):
                client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": req.question}], max_tokens=1,
                    temperature=0, extra_body={"ragkv": {"mode": mode, "documents": list(req.documents)}})
            warmups[mode] = {"requests": len(pool), "seconds": round(time.perf_counter() - t0, 2)}
            progress(f"[serve bench] {mode}: warm-up, {len(pool)} single-passage requests in "
                     f"{warmups[mode]['seconds']} s")
        for c, reqs in zip(cfg.concurrency, plans):
            cpu0 = server_cpu()
            cell = run_cell(client, model, reqs, mode, c, cfg.max_tokens)
            cpu1 = server_cpu()  # CPU time per request: the service demand, whatever share of the cores it got
            cell["server_cpu_s_per_request"] = None if cpu0 is None or cpu1 is None else round(
                (cpu1 - cpu0) / max(cell["ok"], 1), 3)
            cell["loadavg_1m"] = round(os.getloadavg()[0], 2)
            cells.append(cell)
            progress(f"[serve bench] {mode} c={c}: {cell['requests_per_s']} req/s, TTFT p50 {cell['ttft_p50_ms']} "
                     f"p95 {cell['ttft_p95_ms']} ms, reused {cell['reused_tokens']} / {cell['prompt_tokens']} "
                     f"tokens, {cell['failed']} failed")
    return {"benchmark": "serve", "config": asdict(cfg), "url": base,
            "server": {"model": model, "dtype": health.get("dtype")},
            "machine": {"cpus": os.cpu_count(), "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]},
            "warmup": warmups, "cells": cells, "ratios_vs_full": slo_ratios(cells) if "full" in cfg.modes else {}}


def plot_throughput_ttft(cells: list[dict], path: Path) -> Path:
    from matplotlib.ticker import FuncFormatter

    from ragkv.figures import pyplot, save_figure

    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    for mode in dict.fromkeys(c["mode"] for c in cells):
        pts = [c for c in cells if c["mode"] == mode and c["ttft_p95_ms"] is not None]
        if not pts:
            continue
        ax.plot([c["requests_per_s"] for c in pts], [c["ttft_p95_ms"] / 1000 for c in pts], marker="o", label=mode)
        for c in pts:
            ax.annotate(f"c={c['concurrency']}", (c["requests_per_s"], c["ttft_p95_ms"] / 1000), fontsize=7,
                        textcoords="offset points", xytext=(4, 4))
    ax.set_yscale("log")
    ax.set_xlim(left=0)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: f"{y:g}" if f"{y:.1g}"[0] in "25" else ""))
    ax.set_xlabel("throughput (requests/s)"), ax.set_ylabel("p95 TTFT (s, client side)")
    ax.set_title("ragkv serve: throughput vs p95 TTFT (MuSiQue passage pool)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return save_figure(fig, path)


def render_markdown(result: dict) -> str:
    from ragkv.bench.common import markdown_table

    full = {c["concurrency"]: c["requests_per_s"] for c in result["cells"] if c["mode"] == "full"}
    rows = [[c["mode"], c["concurrency"], f"{c['ok']}/{c['requests']}", c["requests_per_s"],
             f"{c['requests_per_s'] / full[c['concurrency']]:.2f}x" if full.get(c["concurrency"]) else "-",
             c["ttft_p50_ms"], c["ttft_p95_ms"], c["latency_p50_ms"], c["server_ttft_p50_ms"],
             c.get("server_cpu_s_per_request"), c["prompt_tokens"], c["reused_tokens"], c["recomputed_tokens"],
             c.get("loadavg_1m")] for c in result["cells"]]
    lines = [markdown_table(["mode", "clients", "ok", "req/s", "vs full", "TTFT p50 ms", "TTFT p95 ms",
                             "latency p50 ms", "server prefill p50 ms", "server CPU s/req", "prompt tok",
                             "reused tok", "recomputed tok", "load 1m"], rows)]
    for mode, r in result.get("ratios_vs_full", {}).items():
        at = ", ".join(f"{'no cell fits' if x['ratio'] is None else str(x['ratio']) + 'x'} (full c="
                       f"{x['baseline_concurrency']}, p95 <= {x['p95_ttft_budget_ms']} ms)"
                       for x in r["at_baseline_p95_ttft"])
        lines.append(f"- {mode}: requests/s vs full at full's p95 TTFT: {at}")
    return "\n".join(lines)


# -- CLI ------------------------------------------------------------------------------------------------------
def register(bsub) -> None:
    from ragkv.commands.common import add_model_args

    p = bsub.add_parser("serve", help="load benchmark of `ragkv serve`: requests/s and TTFT per mode and concurrency")
    p.add_argument("--url", default=None, help="a running server (default: start one here and stop it after)")
    p.add_argument("--modes", default="full,prefix,reuse,blend")
    p.add_argument("--concurrency", default="1,4,16", help="client threads per level, comma-separated")
    p.add_argument("--requests", type=int, default=32, help="requests per (mode, concurrency) cell")
    p.add_argument("--passages-per-request", type=int, default=4)
    p.add_argument("--pool-size", type=int, default=40, help="MuSiQue passages shared by all requests")
    p.add_argument("--passage-words", type=int, default=210, help="passages cut to this many words (~300 tokens)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up pass over the pool")
    p.add_argument("--store", default="memory:2GiB", help="KV store of the server started here")
    p.add_argument("--output-dir", default="bench_out")
    p.add_argument("--json", action="store_true")
    add_model_args(p)
    p.set_defaults(func=run, dtype="float32")


def run(args) -> int:
    try:
        conc = tuple(int(x) for x in args.concurrency.split(",") if x.strip())
    except ValueError:
        raise InvalidRequestError(f"--concurrency wants comma-separated integers, got {args.concurrency!r}")
    cfg = ServeBenchConfig(modes=tuple(m for m in args.modes.split(",") if m), concurrency=conc,
                           requests=args.requests, passages_per_request=args.passages_per_request,
                           pool_size=args.pool_size, passage_words=args.passage_words, max_tokens=args.max_tokens,
                           seed=args.seed, warmup=not args.no_warmup)
    server = None if args.url else ServerProcess(args.model, args.dtype, args.device, args.store)
    result = run_serve_bench(cfg, args.url, Path(args.output_dir),
                             lambda m: print(m, file=sys.stderr, flush=True), server)
    if args.json:
        from ragkv.commands.common import print_json
        print_json(result)
    else:
        print((Path(args.output_dir) / "serve_bench.md").read_text())
    return 0
