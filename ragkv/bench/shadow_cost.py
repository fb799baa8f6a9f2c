"""`ragkv bench shadow`: what shadow verification costs live traffic (the target: at F = 0.05, <= 5% on
p50 TTFT under a 16-client load; its checks run only while the server is idle).

Rounds of two `ragkv serve` runs, one with `--shadow-fraction 0`, one with `--shadow-fraction F`, started one after
the other (never both up: the second's idle checks would run during the first's cell), their order flipped each
round because these machines' speed drifts within an hour. Each run: a fresh server, the serve bench's warm-up and
one cell (`requests` requests of `mode` from `concurrency` closed-loop clients, the same seeded requests in both
runs of a round); then, after the cell, how many checks were sampled and how many ran once the server was idle.
Reported: each round's TTFT p50 / p95 and req/s with and without, the ratios (with / without) per round and their
median."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ragkv.bench.common import save_json
from ragkv.bench.serve.config import ServeBenchConfig
from ragkv.bench.serve.servers import ServerProcess, wait_idle
from ragkv.config import machine
from ragkv.errors import InvalidRequestError


@dataclass(frozen=True)
class ShadowBenchConfig:
    model: str = "smollm2"
    dtype: str = "float32"
    mode: str = "blend:sel=query,r=0.15"  # an approximate mode: only those are checked
    fraction: float = 0.05
    concurrency: int = 16
    requests: int = 64
    rounds: int = 2
    max_tokens: int = 32
    seed: int = 0

    def __post_init__(self):
        if not 0 < self.fraction <= 1:
            raise InvalidRequestError(f"--fraction must be in (0, 1], got {self.fraction}")
        if min(self.concurrency, self.requests, self.rounds, self.max_tokens) < 1:
            raise InvalidRequestError("--concurrency, --requests, --rounds and --max-tokens must be >= 1")


def shadow_checks(base: str) -> dict:
    """The server's shadow counters from its /metrics."""
    import httpx

    return shadow_counters(httpx.get(base + "/metrics", timeout=10).text)


def shadow_counters(metrics: str) -> dict:
    """Checks done (all modes) and sampled but skipped, from a /metrics text."""
    done = skipped = 0.0
    for line in metrics.splitlines():
        if line.startswith("ragkv_fidelity_checks_total"):
            done += float(line.rsplit(" ", 1)[1])
        elif line.startswith("ragkv_fidelity_checks_skipped_total"):
            skipped += float(line.rsplit(" ", 1)[1])
    return {"checks_done": int(done), "checks_skipped": int(skipped)}


def one_run(cfg: ShadowBenchConfig, fraction: float, seed: int, out_dir: Path, say) -> dict:
    from ragkv.bench.serve.run import run_serve_bench

    serve_cfg = ServeBenchConfig(modes=(cfg.mode,), concurrency=(cfg.concurrency,), requests=cfg.requests,
                                 max_tokens=cfg.max_tokens, seed=seed)
    with ServerProcess(cfg.model, cfg.dtype, extra=("--shadow-fraction", str(fraction))) as server:
        result = run_serve_bench(serve_cfg, server.url, out_dir, say)
        after_cell = shadow_checks(server.url)
        t0 = time.perf_counter()
        wait_idle(server.url)  # the sampled checks run now, while nothing else does
        time.sleep(2.0)
        idle = shadow_checks(server.url)
    cell = result["cells"][0]
    return {"fraction": fraction, "ttft_p50_ms": cell["ttft_p50_ms"], "ttft_p95_ms": cell.get("ttft_p95_ms"),
            "requests_per_s": cell["requests_per_s"], "errors": cell.get("errors", 0),
            "checks_done_by_cell_end": after_cell["checks_done"], "checks_done_when_idle": idle["checks_done"],
            "checks_skipped": idle["checks_skipped"], "idle_wait_s": round(time.perf_counter() - t0, 1)}


def run_shadow_bench(cfg: ShadowBenchConfig, out_dir: Path, say=print) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    rounds = []
    for r in range(cfg.rounds):
        order = (0.0, cfg.fraction) if r % 2 == 0 else (cfg.fraction, 0.0)
        runs = {}
        for f in order:
            name = "with" if f else "without"
            say(f"[shadow bench] round {r + 1}/{cfg.rounds}: {name} shadow checks (--shadow-fraction {f})")
            runs[name] = one_run(cfg, f, cfg.seed + r, out_dir / f"round{r + 1}-{name}", say)
            say(f"[shadow bench]   TTFT p50 {runs[name]['ttft_p50_ms']:.0f} ms, {runs[name]['requests_per_s']} req/s, "
                f"checks {runs[name]['checks_done_by_cell_end']} by the cell's end (warm-up included), "
                f"{runs[name]['checks_done_when_idle']} after it")
        w, wo = runs["with"], runs["without"]
        rounds.append({"round": r + 1, "order": ["with" if f else "without" for f in order], **runs,
                       "ttft_p50_ratio": round(w["ttft_p50_ms"] / wo["ttft_p50_ms"], 4),
                       "requests_per_s_ratio": round(w["requests_per_s"] / wo["requests_per_s"], 4)})
    result = {"benchmark": "shadow", "config": asdict(cfg), "machine": machine(), "rounds": rounds,
              "ttft_p50_ratio_median": round(statistics.median(r["ttft_p50_ratio"] for r in rounds), 4),
              "requests_per_s_ratio_median": round(statistics.median(r["requests_per_s_ratio"] for r in rounds), 4)}
    save_json(out_dir / "shadow_bench.json", result)
    (out_dir / "shadow_bench.md").write_text(render(result) + "\n")
    return result


def render(result: dict) -> str:
    cfg = result["config"]
    lines = [f"# Shadow verification's cost ({cfg['model']} {cfg['dtype']}, `{cfg['mode']}`, {cfg['concurrency']} "
             f"clients, {cfg['requests']} requests per run, --shadow-fraction {cfg['fraction']} vs 0)", "",
             f"CPU: {result['machine'].get('cpu')}", "",
             "| round | order | TTFT p50 without / with (ms) | ratio | TTFT p95 without / with | req/s ratio | checks "
             "by the cell's end (warm-up included) / after it |", "|---|---|---|---|---|---|---|"]
    for r in result["rounds"]:
        w, wo = r["with"], r["without"]
        lines.append(f"| {r['round']} | {' then '.join(r['order'])} | {wo['ttft_p50_ms']:.0f} / {w['ttft_p50_ms']:.0f} "
                     f"| {r['ttft_p50_ratio']:.3f} | {wo['ttft_p95_ms']:.0f} / {w['ttft_p95_ms']:.0f} | "
                     f"{r['requests_per_s_ratio']:.3f} | {w['checks_done_by_cell_end']} / "
                     f"{w['checks_done_when_idle']} |")
    lines += ["", f"Median TTFT p50 ratio (with / without): **{result['ttft_p50_ratio_median']:.3f}**; "
                  f"req/s ratio: {result['requests_per_s_ratio_median']:.3f}."]
    return "\n".join(lines)
