"""`ragkv bench store`: load throughput per tier, and TTFT with a request's blocks in memory, on disk or in Redis.

The request is the TTFT benchmark's (real MuSiQue passages up to `--context` tokens). Its blocks are encoded
once and copied into each tier; every configuration then has its own single-tier store, so the tier being timed
is the one read (disk-only and Redis-only stores have no memory tier in front). TTFT runs go round-robin over
the configurations, so drift in a shared machine's load hits them alike, against `full` in the same run.
Target (README "Performance"): disk-tier TTFT <= 1.3x memory-tier TTFT with pipelined per-layer loading (CacheBlend sec. 5).
With `compare_kv` (`--compare-kv int8,int4,fp8`) it compares compressed stores with the uncompressed one instead
(ragkv.bench.store_compressed: bytes per token, first-token KL and top-1 on HotpotQA).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from zlib_ng.zlib_ng import crc32

from ragkv.engine.modes import MODES, get_mode
from ragkv.engine.options import FusionOptions
from ragkv.errors import InvalidRequestError
from ragkv.store.spec import KV_CHOICES

NAMESPACE = "bench-store"  # the benchmark's entries, cleared afterwards (a given --redis keeps everything else)
DISK_TARGET = 1.3


@dataclass(frozen=True)
class StoreBenchConfig:
    model: str = "smollm2"
    dtype: str = "float32"
    device: str = "auto"
    context: int = 4096                        # context tokens of the request
    modes: tuple[str, ...] = ("reuse", "blend")  # modes reading the blocks; full is always measured
    query_tokens: int = 50
    repeats: int = 3
    fusion: FusionOptions = FusionOptions()    # blend's parameters (ratio, check layers, ...)
    redis: str | None = None                   # a Redis URL; None: a private redis-server for the run
    disk_dir: str | None = None                # None: a temporary directory under $RAGKV_CACHE_DIR/bench
    compare_kv: tuple[str, ...] = ()           # KV codecs to compare with the uncompressed store (not TTFT)
    examples: int = 5                          # HotpotQA dev examples of the compare_kv run

    def __post_init__(self):
        readers = [m for m in MODES if get_mode(m).reads_blocks]
        if not self.modes or any(m not in readers for m in self.modes):
            raise InvalidRequestError(f"modes {self.modes!r}: choose among {', '.join(readers)} (full is always "
                                      "measured)")
        if self.repeats < 1 or self.context < 64:
            raise InvalidRequestError("repeats must be >= 1 and context >= 64")
        codecs = [c for c in KV_CHOICES if c != "none"]
        if any(c not in codecs for c in self.compare_kv) or len(set(self.compare_kv)) < len(self.compare_kv):
            raise InvalidRequestError(f"compare_kv {self.compare_kv!r}: choose among {', '.join(codecs)}, each once")
        if not 1 <= self.examples <= 100:
            raise InvalidRequestError(f"examples must be 1..100 (HotpotQA dev examples), got {self.examples}")


@dataclass
class Config:
    mode: str
    tier: str                                # memory | disk | disk (cold) | redis
    pipelined: bool | None                   # None: in-memory views, nothing to pipeline
    engine: object
    store: object = None                     # the engine's store (its hit counters tell which tier was read)
    before: Callable[[], None] = lambda: None  # untimed, before each request (drop the page cache)
    runs: list = field(default_factory=list)
    waits: list = field(default_factory=list)
    plan: dict | None = None                 # blend: the loading controller's decision
    read_from: set = field(default_factory=set)  # tiers whose hit counters moved: proof of what was read


def run_store_bench(cfg: StoreBenchConfig, out_dir: Path = Path("bench_out"), progress=print) -> dict:
    if cfg.compare_kv:
        from ragkv.bench.store_compressed import run_compressed_bench

        return run_compressed_bench(cfg, out_dir, progress)
    from ragkv.bench.common import bench_dir, bench_redis, real_passages, save_json
    from ragkv.bench.ttft import build_request
    from ragkv.engine.engine import Engine
    from ragkv.store.spec import open_store

    mem = open_store("memory:64GiB")
    engine = Engine.load(cfg.model, dtype=cfg.dtype, device=cfg.device, store=mem, namespace=NAMESPACE)
    passages, questions = real_passages()
    segs = build_request(engine, passages, questions[0], cfg.context, cfg.query_tokens)
    keys = []  # the blocks every mode under test reads (reuse and blend share theirs)
    for mode in cfg.modes:
        keys = list(dict.fromkeys(keys + engine.warm(segs, FusionOptions(mode=mode)).keys))
    kvs = [mem.get(k) for k in keys]
    nbytes = sum(kv.nbytes for kv in kvs)
    L = engine.num_layers
    progress(f"request: {segs.num_tokens} tokens, {len(segs.blocks)} blocks, {nbytes / 1e6:.1f} MB of KV "
             f"({engine.dtype_name})")

    def engine_on(spec, pipelined=True):
        store = open_store(spec, pipelined=pipelined)
        for k, kv in zip(keys, kvs):
            store.put(k, kv)
        return engine.with_store(store, NAMESPACE), store

    with contextlib.ExitStack() as stack:
        disk_dir = Path(cfg.disk_dir).expanduser() if cfg.disk_dir else stack.enter_context(bench_dir("store"))
        disk_spec = f"disk:{disk_dir}:{max(4 << 30, 4 * nbytes)}B"
        redis_url = cfg.redis or stack.enter_context(bench_redis(progress))
        engines = {("memory", None): (engine, mem)}
        stack.callback(lambda: [s.clear(NAMESPACE) for (t, _), (e, s) in engines.items() if t != "memory"])
        for tier, spec in (("disk", disk_spec), ("redis", redis_url)):
            for pipelined in (True, False) if spec else ():
                engines[tier, pipelined] = engine_on(spec, pipelined)
        disk = engines["disk", True][1].tiers[0]
        throwaway = [t for given, t in ((cfg.disk_dir, "disk"), (cfg.redis, "redis")) if not given]
        stack.callback(_forget_profiles, [s.tiers[0] for (t, p), (e, s) in engines.items() if t in throwaway and p])
        drop = lambda: [disk.drop_page_cache(k) for k in keys]  # noqa: E731

        loads = measure_loads(engines, keys, L, nbytes, drop, cfg.repeats)
        for row in loads:
            progress(f"  load {row['tier']:<28s} {row['GBps']:9.2f} GB/s  {row['ms']:8.1f} ms")
        for (tier, pipelined), (e, _) in engines.items():
            if pipelined is not False:
                e.profile_store()  # the loading controller's profile, before (never inside) the timed requests
        configs = [Config("full", "memory", None, engine, mem)]
        for mode in cfg.modes:
            for (tier, pipelined), (e, s) in engines.items():
                configs.append(Config(mode, tier, pipelined, e, s))
                if tier == "disk":
                    configs.append(Config(mode, "disk (cold)", pipelined, e, s, drop))
        time_configs(configs, segs, cfg.fusion, cfg.repeats, progress)
    result = {**engine.info(), "context_tokens": cfg.context, "prompt_tokens": segs.num_tokens,
              "blocks": len(keys), "kv_bytes": nbytes, "repeats": cfg.repeats, "ratio": cfg.fusion.ratio,
              "redis": "given" if cfg.redis else ("private redis-server" if redis_url else "skipped"),
              "argv": sys.argv[1:],
              "loads": loads, "ttft": summarize(configs)}
    out = Path(out_dir)
    save_json(out / "store_bench.json", result)
    (out / "store_bench.md").write_text(render_markdown(result))
    _plot(out / "store_bench.png", result)
    return result


def measure_loads(engines, keys, num_layers, nbytes, drop, repeats) -> list[dict]:
    """GB/s of reading every layer of every block (no pipelining, nothing to hide behind), per tier."""
    rows = []
    cases = [("memory (in-process views)", engines["memory", None][1], lambda: None),
             ("disk, page cache dropped", engines["disk", False][1], drop),
             ("disk, page cache warm", engines["disk", False][1], lambda: None)]
    if ("redis", False) in engines:
        cases.append(("redis (localhost)", engines["redis", False][1], lambda: None))
    for name, store, before in cases:
        times = []
        for _ in range(repeats):
            before()
            t0 = time.perf_counter()
            for _layer in store.iter_layers(keys, num_layers):
                pass
            times.append(time.perf_counter() - t0)
        ms = statistics.median(times) * 1000
        rows.append({"tier": name, "ms": round(ms, 2), "GBps": round(nbytes / ms / 1e6, 3)})
    chunk = bytearray(8 << 20)  # the checksum every disk/Redis layer read verifies, alone on one core
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        crc32(chunk)
        times.append(time.perf_counter() - t0)
    crc = len(chunk) / min(times) / 1e9
    rows.append({"tier": "crc32 alone (zlib-ng, 1 core)", "ms": round(nbytes / crc / 1e6, 2), "GBps": round(crc, 3)})
    return rows


def time_configs(configs: list[Config], segs, fusion: FusionOptions, repeats: int, progress) -> None:
    """One untimed request per configuration (allocations, page cache), then `repeats` rounds over all."""
    from dataclasses import replace

    def request(c: Config):
        c.before()
        counters = getattr(c.store, "counters", {"hits": {}})
        hits = dict(counters["hits"])
        t0 = time.perf_counter()
        _, stats = c.engine.prefill(segs, replace(fusion, mode=c.mode))
        ms = (time.perf_counter() - t0) * 1000
        c.read_from |= {t for t, n in counters["hits"].items() if n > hits[t]}
        return ms, stats

    for c in configs:
        _, stats = request(c)
        if stats.cache_misses:
            raise RuntimeError(f"{c.mode} on {c.tier}: {stats.cache_misses} blocks missed; the bench is broken")
        c.plan = stats.extra.get("loading_plan")
    for r in range(repeats):
        for c in configs:
            ms, stats = request(c)
            c.runs.append(ms)
            c.waits.append(stats.extra.get("load_wait_ms", 0.0))
        progress(f"  round {r + 1}/{repeats} (ms): " + ", ".join(
            f"{c.mode}/{c.tier}/{_pipe(c.pipelined)} {c.runs[-1]:.0f}" for c in configs))


def _pipe(pipelined: bool | None) -> str:
    return "n/a" if pipelined is None else "on" if pipelined else "off"


def summarize(configs: list[Config]) -> list[dict]:
    rows = [{"mode": c.mode, "tier": c.tier, "pipelined": c.pipelined, "ttft_ms": round(statistics.median(c.runs), 2),
             "best_ms": round(min(c.runs), 2),
             "runs_ms": [round(t, 2) for t in c.runs], "load_wait_ms": round(statistics.median(c.waits), 2),
             "loading_plan": c.plan, "read_from": sorted(c.read_from)} for c in configs]
    full = rows[0]["ttft_ms"]
    memory = {r["mode"]: r for r in rows if r["tier"] == "memory"}
    for r in rows:
        r["vs_full"] = round(r["ttft_ms"] / full, 4)
        r["vs_memory"] = round(r["ttft_ms"] / memory[r["mode"]]["ttft_ms"], 3)
        r["best_vs_memory"] = round(r["best_ms"] / memory[r["mode"]]["best_ms"], 3)  # fastest runs, less noise
        if r["tier"].startswith("disk") and r["pipelined"]:
            r["meets_disk_target"] = r["vs_memory"] <= DISK_TARGET
    return rows


def render_markdown(res: dict) -> str:
    from ragkv.bench.common import markdown_table

    head = (f"Store benchmark on {res['model']} ({res['dtype']}, {res['device']}, {res['threads']} threads): "
            f"{res['prompt_tokens']}-token request ({res['context_tokens']} context tokens, {res['blocks']} cached "
            f"blocks, {res['kv_bytes'] / 1e6:.1f} MB of KV), median of {res['repeats']} round-robin runs, blend "
            f"r={res['ratio']}, Redis: {res['redis']}.\n\n")
    loads = markdown_table(["load path (all layers, no compute)", "GB/s", "ms for the request's KV"],
                           [[r["tier"], f"{r['GBps']:.2f}", f"{r['ms']:.1f}"] for r in res["loads"]])
    rows = [[r["mode"], r["tier"], _pipe(r["pipelined"]), f"{r['ttft_ms']:.1f}", f"{r['vs_memory']:.2f}x",
             f"{r['best_ms']:.1f}", f"{r['best_vs_memory']:.2f}x", f"{100 * r['vs_full']:.1f}%",
             f"{r['load_wait_ms']:.1f}"] for r in res["ttft"]]
    ttft = markdown_table(["mode", "blocks in", "pipelined", "TTFT ms (median)", "vs memory", "best ms",
                           "best vs memory", "vs full", "load wait ms"], rows)
    verdicts = [f"- {r['mode']} from {r['tier']}: {r['vs_memory']:.2f}x memory with pipelining "
                f"({'meets' if r['meets_disk_target'] else 'misses'} the <= {DISK_TARGET}x target; fastest runs: "
                f"{r['best_vs_memory']:.2f}x)"
                for r in res["ttft"] if "meets_disk_target" in r]
    plans = {(r["tier"], r["pipelined"]): r["loading_plan"] for r in res["ttft"] if (r["loading_plan"] or {}).get("ratio") is not None}
    plans = [f"- blend, blocks in {t}{' (no pipelining)' if p is False else ''}: the loading controller planned "
             f"r={lp['ratio']:.2f}, {lp['load_ms_per_layer']:.2f} ms/layer loading vs "
             f"{lp['recompute_ms_per_layer']:.2f} ms/layer recompute" for (t, p), lp in plans.items() if p is not False]
    return head + loads + "\n\n" + ttft + "\n\n" + "\n".join(verdicts + plans) + "\n"


def _plot(path: Path, res: dict) -> None:
    from ragkv.figures import pyplot, save_figure

    rows = [r for r in res["ttft"] if not get_mode(r["mode"]).is_reference]
    fig, ax = pyplot().subplots(figsize=(9, 4.5))
    labels = [f"{r['mode']}\n{r['tier']}\n{_pipe(r['pipelined'])}" for r in rows]
    ax.bar(range(len(rows)), [r["ttft_ms"] for r in rows], color=["C0" if r["tier"] == "memory" else "C1"
                                                                  if r["pipelined"] else "C7" for r in rows])
    ax.set_xticks(range(len(rows)), labels, fontsize=6)
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(f"TTFT by tier, {res['model']} {res['dtype']}, {res['context_tokens']} tokens "
                 f"(full: {res['ttft'][0]['ttft_ms']:.0f} ms)")
    save_figure(fig, path)


def _forget_profiles(tiers) -> None:
    """Drop the bandwidth profiles the loading controller saved for this run's throwaway tiers (a temporary
    directory, a private Redis port), so they do not pile up in the profile file."""
    from ragkv.engine.blocks.loading import StoreProfiles
    from ragkv.store.probe import profile_id

    StoreProfiles.load().forget({profile_id(t) for t in tiers})
