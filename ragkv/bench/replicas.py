"""`ragkv bench serve --replicas N`: cache-aware routing against round-robin on a workload whose passage sets repeat.

The workload: S passage sets (a MuSiQue question, one of its own passages and k-1 others from a pool of real
passages), requests drawing a set by a Zipf law over S (a few sets are hot, most are cold) with its passages in a
fresh order each time (the same blocks in any order). The same seeded requests go, from C closed-loop clients, to:
one `ragkv serve` (the single server's hit rate, the baseline), then `ragkv serve --replicas N --router R` for each
router R, in turn, `--repeats` times. Each replica has 1 thread (`--replica-threads`); the single server too.

Per configuration: the block hit rate (the engine's own count of blocks found in the store against encoded,
prefix block included), TTFT p50/p95, requests/s, and how many requests each replica answered."""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from ragkv.bench.serve.clients import percentile
from ragkv.bench.serve.servers import ServerProcess
from ragkv.bench.serve.workload import build_pool, draw_requests, system_prompt
from ragkv.errors import InvalidRequestError
from ragkv.serve.replicas.policy import ROUTERS


@dataclass(frozen=True)
class ReplicaBenchConfig:
    replicas: int = 2
    routers: tuple[str, ...] = ("balance", "round-robin")
    sets: int = 24                   # distinct passage sets
    zipf: float = 1.0                # P(set of rank i) ~ 1 / i^zipf
    requests: int = 96               # per configuration
    concurrency: int = 2             # closed-loop clients
    passages_per_request: int = 3
    pool_size: int = 40
    passage_words: int = 100
    max_tokens: int = 8
    memory: str = "memory:1GiB"      # each replica's KV store; the single server gets N times its memory (the
                                     # same machine's worth: affinity partitions the blocks, round-robin copies them)
    repeats: int = 1                 # rounds over the routers (alternating: the machine's speed drifts)
    single: bool = True              # measure one plain server first (the hit-rate baseline)
    seed: int = 0

    def __post_init__(self):
        if self.replicas < 2:
            raise InvalidRequestError("--replicas must be >= 2 to compare routers")
        for r in self.routers:
            name, _, slack = r.partition(":")
            if name not in ROUTERS or (slack and not slack.isdigit()):
                raise InvalidRequestError(f"--router {r!r}: choose from {', '.join(ROUTERS)}, each with an optional "
                                          ":SLACK (e.g. home:1, its --affinity-slack)")
        if self.sets < 1 or self.requests < 1 or self.concurrency < 1 or self.repeats < 1 or self.zipf < 0:
            raise InvalidRequestError("--passage-sets, --requests, --concurrency and --repeats must be >= 1, "
                                      "--zipf >= 0")


def zipf_requests(cfg: ReplicaBenchConfig) -> list[dict]:
    """The seeded requests: each a set index and the chat body of that set, its passages freshly shuffled."""
    pool, questions, owned = build_pool(cfg.pool_size, cfg.passage_words)
    sets = draw_requests(pool, questions, owned, cfg.sets, cfg.passages_per_request, cfg.seed)
    rng = random.Random(cfg.seed + 1)
    weights = [1 / (i + 1) ** cfg.zipf for i in range(cfg.sets)]
    out = []
    for _ in range(cfg.requests):
        i = rng.choices(range(cfg.sets), weights)[0]
        docs = list(sets[i].documents)
        rng.shuffle(docs)
        out.append({"set": i, "body": {"messages": [{"role": "system", "content": system_prompt()},
                                                    {"role": "user", "content": sets[i].question}],
                                       "documents": docs}})
    return out


def single_store(cfg: ReplicaBenchConfig) -> str:
    """The single server's store: the replicas' memory tier times their number (other tiers as given)."""
    from ragkv.store.sizes import format_size, parse_size

    tiers = cfg.memory.split(",")
    kind, _, size = tiers[0].partition(":")
    if kind == "memory" and size:
        tiers[0] = f"memory:{format_size(parse_size(size) * cfg.replicas)}"
    return ",".join(tiers)


def run_config(url: str, model: str, requests: list[dict], cfg: ReplicaBenchConfig) -> dict:
    """The requests from C closed-loop clients: per request its TTFT, hits and replica; the figures."""
    import httpx

    def send(req: dict) -> dict:
        body = {**req["body"], "model": model, "max_tokens": cfg.max_tokens, "temperature": 0, "stream": True}
        t0 = time.perf_counter()
        ttft, stats = None, {}
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
                replica = r.headers.get("x-ragkv-replica", "single")
                if r.status_code != 200:
                    return {"error": f"HTTP {r.status_code}: {r.read()[:200]!r}", "replica": replica}
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if ttft is None and event.get("choices"):
                        delta = event["choices"][0].get("delta") or {}
                        if delta.get("content") or event["choices"][0].get("finish_reason"):
                            ttft = time.perf_counter() - t0
                    stats = (event.get("ragkv") or {}).get("stats", stats)
        except httpx.HTTPError as e:
            return {"error": type(e).__name__, "replica": None}
        return {"ttft_s": ttft, "hits": stats.get("cache_hits", 0), "misses": stats.get("cache_misses", 0),
                "replica": replica, "set": req["set"]}

    t0 = time.perf_counter()
    with ThreadPoolExecutor(cfg.concurrency) as pool:
        done = list(pool.map(send, requests))
    wall = time.perf_counter() - t0
    ok = [d for d in done if "error" not in d]
    ttfts = [d["ttft_s"] for d in ok if d["ttft_s"] is not None]
    hits, misses = sum(d["hits"] for d in ok), sum(d["misses"] for d in ok)
    per_replica: dict[str, int] = {}
    for d in ok:
        per_replica[d["replica"]] = per_replica.get(d["replica"], 0) + 1
    return {"requests": len(done), "errors": len(done) - len(ok), "wall_s": round(wall, 2),
            "req_per_s": round(len(ok) / wall, 3), "block_hit_rate": round(hits / max(1, hits + misses), 4),
            "hits": hits, "misses": misses,
            "ttft_p50_s": _r(percentile(ttfts, 50)), "ttft_p95_s": _r(percentile(ttfts, 95)),
            "per_replica": per_replica, "error_samples": [d["error"] for d in done if "error" in d][:3]}


def _r(x):
    return None if x is None else round(x, 4)


def run_replica_bench(cfg: ReplicaBenchConfig, model: str, dtype: str, out_dir: Path, say,
                      server_args: tuple[str, ...] = ()) -> dict:
    requests = zipf_requests(cfg)
    hot = sorted({r["set"] for r in requests})
    say(f"[replicas bench] {len(requests)} requests over {len(hot)} of {cfg.sets} passage sets (Zipf {cfg.zipf}), "
        f"{cfg.concurrency} clients")
    plan = (["single"] if cfg.single else []) + [r for _ in range(cfg.repeats) for r in cfg.routers]
    runs = []
    for name in plan:
        extra = ("--no-startup-profile", "--shadow-fraction", "0", *server_args)  # routing alone is measured
        store = single_store(cfg) if name == "single" else cfg.memory
        if name != "single":
            router, _, slack = name.partition(":")
            extra += ("--replicas", str(cfg.replicas), "--router", router, "--replica-threads", "1")
            extra += ("--affinity-slack", slack) if slack else ()
        say(f"[replicas bench] {name}: starting")
        with ServerProcess(model, dtype, "cpu", store, startup_s=600, extra=extra, threads=1) as server:
            figures = run_config(server.url, model, requests, cfg)
        runs.append({"config": name, **figures})
        say(f"[replicas bench] {name}: hit rate {figures['block_hit_rate']:.3f}, TTFT p50 {figures['ttft_p50_s']} s, "
            f"{figures['req_per_s']} req/s, per replica {figures['per_replica']}, errors {figures['errors']}")
    result = {"config": asdict(cfg), "model": model, "dtype": dtype, "runs": runs, "summary": summarize(runs)}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "replicas_bench.json").write_text(json.dumps(result, indent=2))
    return result


def summarize(runs: list[dict]) -> dict:
    """Means over repeats per configuration, and the ratios the targets name."""
    by: dict[str, list[dict]] = {}
    for r in runs:
        by.setdefault(r["config"], []).append(r)

    def mean(name, field):
        xs = [r[field] for r in by.get(name, []) if r[field] is not None]
        return sum(xs) / len(xs) if xs else None
    out = {name: {f: _r(mean(name, f)) for f in ("block_hit_rate", "ttft_p50_s", "ttft_p95_s", "req_per_s")}
           for name in by}
    single, rr = out.get("single"), out.get("round-robin")
    routed = [name for name in by if name != "single"]
    if single and single["block_hit_rate"]:
        for name in routed:
            out[name]["hit_rate_vs_single"] = _r(out[name]["block_hit_rate"] / single["block_hit_rate"])
    if rr and rr["ttft_p50_s"]:
        for name in routed:
            if name != "round-robin" and out[name]["ttft_p50_s"] is not None:
                key = "affinity" if name == "affinity" else name.replace(":", "_slack_")
                out[f"{key}_ttft_p50_vs_round_robin"] = _r(out[name]["ttft_p50_s"] / rr["ttft_p50_s"])
    return out


def render(result: dict) -> str:
    cfg = result["config"]
    lines = [f"# Replicas: routers compared ({result['model']}, {result['dtype']})", "",
             f"{cfg['requests']} requests over {cfg['sets']} passage sets (Zipf {cfg['zipf']}, "
             f"{cfg['passages_per_request']} MuSiQue passages each, fresh order per request), {cfg['concurrency']} "
             f"clients, {cfg['replicas']} replicas of 1 thread, store {cfg['memory']} per replica (the single server: "
             f"{single_store(ReplicaBenchConfig(**result['config']))}).", "",
             "| config | block hit rate | vs single | TTFT p50 (s) | TTFT p95 (s) | req/s | per replica | errors |",
             "|---|---|---|---|---|---|---|---|"]
    summary = result["summary"]
    for r in result["runs"]:
        vs = (summary.get(r["config"]) or {}).get("hit_rate_vs_single")
        lines.append(f"| {r['config']} | {r['block_hit_rate']:.3f} | {vs if vs is not None else '-'} | "
                     f"{r['ttft_p50_s']} | {r['ttft_p95_s']} | {r['req_per_s']} | "
                     f"{', '.join(str(v) for v in sorted(r['per_replica'].values(), reverse=True))} | {r['errors']} |")
    ratios = {k.removesuffix("_ttft_p50_vs_round_robin"): v for k, v in summary.items()
              if k.endswith("_ttft_p50_vs_round_robin")}
    if ratios:
        lines += ["", "TTFT p50 / round-robin's: " + ", ".join(f"{k} {v}" for k, v in ratios.items())]
    return "\n".join(lines) + "\n"
