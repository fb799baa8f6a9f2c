"""`ragkv bench controller`: blend's loading controller (CacheBlend sec. 5.1) against every fixed (r, tier) choice.

One request (real MuSiQue passages, the TTFT benchmark's `build_request`) is cached as blocks in four tiers:
memory, disk, Redis (a private redis-server unless given) and a *throttled* tier, an in-memory tier whose every
layer read waits (`ThrottledStore`: a fixed delay per block and layer, or a bandwidth limit), so that loading
matters on a machine where every real tier is fast next to the model.

- **controller**: the blocks *spread* over the four tiers (some held by two: the controller must pick the faster
  holder), blend with `auto_ratio` (r = max(r_min, the r whose recompute time the loading hides), each block read
  from the tier the plan names). The engine's profile (each tier's bandwidth, the model's recompute cost) is measured
  by `engine.profile_store()` before anything is timed.
- **fixed choices**: every r in `ratios` and the controller's own r x every tier forced for *all* blocks. A tier is forced honestly by giving
  each configuration its own single-tier store holding every block (as `ragkv bench store` does): the engine can
  only read from that tier, and the stores' hit counters (column "reads") prove which tier was read.
- **spread, fixed r**: the controller's placement with a fixed r (each block from its fastest holder): what the
  controller adds by choosing r.

TTFT is the median of `repeats` round-robin rounds, each starting at another configuration (shared machines
drift alike for every configuration; `full` is timed once, as the reference);
fidelity is the first-token KL(full || x) of `engine.prefill`'s logits. Target (issue 13): the controller within
10% of the best fixed choice's TTFT among those at equal or better KL. The fixed memory choices hold every block
in memory, so the target says that spreading blocks over slower tiers costs at most 10% once the controller has
chosen r (loading hidden behind the recompute, CacheBlend sec. 5).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from ragkv.bench.common import bench_dir, bench_redis
from ragkv.engine.options import FusionOptions
from ragkv.errors import InvalidRequestError
from ragkv.store.base import KVStore, LayerReader

NAMESPACE = "bench-controller"
TARGET = 1.10            # controller TTFT <= 1.10 x the best fixed choice's at equal or better KL
KL_REL_TOL = 0.01        # a fixed choice's KL within 1% of the controller's counts as equal
TIERS = ("memory", "disk", "redis", "throttled")
# the spread placement: block i lives in SPREAD[i % 6] (the throttled tier as the big slow tier holding half of
# them alone); blocks on disk are also in the throttled tier (two holders: the controller must read them from disk)
SPREAD = ("memory", "throttled", "disk", "throttled", "redis", "throttled")
ALSO = {"disk": "throttled"}


# -- the throttled tier --------------------------------------------------------------------------------------

class ThrottledStore(KVStore):
    """A KVStore wrapper whose every layer read of a block waits `delay_s + nbytes / bytes_per_s` first (a slow
    remote tier, simulated with sleeps that leave the CPU to the compute). The wrapped tier holds the data."""

    name = "throttled"

    def __init__(self, inner: KVStore, delay_s: float = 0.0, bytes_per_s: float | None = None, label: str = ""):
        if delay_s < 0 or (bytes_per_s is not None and bytes_per_s <= 0):
            raise ValueError("a throttle wants delay_s >= 0 and bytes_per_s > 0")
        self.inner, self.delay_s, self.bytes_per_s, self.label = inner, delay_s, bytes_per_s, label
        self.reads = 0           # layer reads served (each one waited)

    def describe(self) -> str:   # also its bandwidth-profile id: unique per throttle setting and run
        bw = f",{self.bytes_per_s / 1e6:.3g}MB/s" if self.bytes_per_s else ""
        return f"throttled({self.delay_s * 1e3:.3g}ms/layer{bw}{',' + self.label if self.label else ''})"

    def wait_s(self, nbytes: int) -> float:
        return self.delay_s + (nbytes / self.bytes_per_s if self.bytes_per_s else 0.0)

    def get(self, key):
        kv = self.inner.get(key)
        if kv is not None:
            time.sleep(kv.num_layers * self.wait_s(kv.nbytes // max(1, kv.num_layers)))
        return kv

    def put(self, key, kv):
        self.inner.put(key, kv)

    def contains(self, key):
        return self.inner.contains(key)

    def delete(self, key):
        return self.inner.delete(key)

    def clear(self, namespace=None):
        return self.inner.clear(namespace)

    def open_layers(self, key):
        reader = self.inner.open_layers(key)
        return None if reader is None else _ThrottledReader(self, reader)

    def stats(self):
        return {**self.inner.stats(), "tier": self.name, "describe": self.describe(), "throttled_reads": self.reads}


class _ThrottledReader(LayerReader):
    instant = False  # never an in-memory view: the tiered store pipelines it

    def __init__(self, store: ThrottledStore, inner: LayerReader):
        super().__init__(inner.key, inner.num_layers)
        self.store, self.inner = store, inner

    def read(self, layer):
        kv = self.inner.read(layer)
        if kv is not None:
            time.sleep(self.store.wait_s(2 * kv[0].numel() * kv[0].element_size()))
            self.store.reads += 1
        return kv

    def close(self):
        self.inner.close()


# -- configuration and results -------------------------------------------------------------------------------

@dataclass(frozen=True)
class ControllerBenchConfig:
    model: str = "smollm2"
    dtype: str = "auto"  # as the CLI's --dtype
    device: str = "auto"
    context: int = 3072                              # context tokens of the request (prefix + blocks)
    query_tokens: int = 50
    ratios: tuple[float, ...] = (0.05, 0.15, 0.3, 0.5)  # the fixed choices' r
    r_min: float = 0.15                               # the controller's r_quality (auto_ratio's floor)
    repeats: int = 3                                  # round-robin rounds timed (after one untimed)
    throttle: str = "latency"                         # latency: a fixed delay per block and layer read;
    #                                                   bandwidth: nbytes / bytes_per_s per block and layer read
    throttle_ms: float | None = None                  # latency: the delay; None: auto (throttle_factor)
    throttle_mbps: float | None = None                # bandwidth: MB/s; None: auto (throttle_factor)
    throttle_factor: float = 2.0                      # auto: in the spread placement, the throttled blocks take
    #                                                   this x the recompute at r_min per layer to load
    target: float = TARGET
    refresh_profile: bool = True                      # re-measure the recompute cost under this run's threads
    fusion: FusionOptions = FusionOptions(mode="blend")  # blend's other parameters (check layers, deviation, ...)
    redis: str | None = None                          # a Redis URL; None: a private redis-server for the run
    disk_dir: str | None = None                       # None: temporary directories under $RAGKV_CACHE_DIR/bench

    def __post_init__(self):
        if self.throttle not in ("latency", "bandwidth"):
            raise InvalidRequestError(f"throttle {self.throttle!r}: choose latency or bandwidth")
        if not self.ratios or any(not 0 <= r <= 1 for r in self.ratios) or not 0 <= self.r_min <= 1:
            raise InvalidRequestError("ratios and r_min must be in [0, 1]")
        if self.repeats < 1 or self.context < 64 or self.throttle_factor <= 0:
            raise InvalidRequestError("repeats must be >= 1, context >= 64 and throttle_factor > 0")
        if (self.throttle_ms is not None and self.throttle_ms < 0) or (
                self.throttle_mbps is not None and self.throttle_mbps <= 0):
            raise InvalidRequestError("throttle_ms must be >= 0 and throttle_mbps > 0")


@dataclass
class Config:
    name: str                    # row label
    kind: str                    # full | controller | fixed | spread
    tier: str                    # memory | disk | redis | throttled | spread
    fusion: FusionOptions
    engine: object
    store: object
    runs: list = field(default_factory=list)
    waits: list = field(default_factory=list)
    ratio: float | None = None   # r actually used (the controller's plan for the controller)
    plan: dict | None = None
    reads: dict = field(default_factory=dict)  # tier -> blocks opened there per request (hit counters)
    kl: float | None = None
    top1: bool | None = None
    logits: object = None


def verdict(rows: list[dict], target: float = TARGET, kl_rel_tol: float = KL_REL_TOL) -> dict:
    """The controller row (kind "controller") against the fixed rows (kind "fixed"): the fastest fixed choice
    whose KL is at most the controller's (within `kl_rel_tol`, relative), and whether the controller's TTFT is
    within `target` x its TTFT. `meets` is None when no fixed choice is as faithful as the controller."""
    ctrl = [r for r in rows if r["kind"] == "controller"]
    if len(ctrl) != 1:
        raise ValueError(f"verdict wants exactly one controller row, got {len(ctrl)}")
    c = ctrl[0]
    fixed = [r for r in rows if r["kind"] == "fixed"]
    if not fixed:
        raise ValueError("verdict wants at least one fixed row")
    bound = c["kl"] * (1 + kl_rel_tol)
    eligible = [r for r in fixed if r["kl"] <= bound]
    fastest = min(fixed, key=lambda r: r["ttft_ms"])
    # choices at least as fast with a KL better beyond the tolerance: quality the controller left on the table
    dominated_by = sorted((r["name"] for r in fixed if r["ttft_ms"] <= c["ttft_ms"] and r["kl"] * (1 + kl_rel_tol)
                           < c["kl"]), key=lambda n: next(r["kl"] for r in fixed if r["name"] == n))
    out = {"controller": c["name"], "controller_ttft_ms": c["ttft_ms"], "controller_kl": c["kl"],
           "target": target, "kl_rel_tol": kl_rel_tol, "fastest_fixed": fastest["name"],
           "fastest_fixed_ttft_ms": fastest["ttft_ms"], "fastest_fixed_kl": fastest["kl"],
           "dominated_by": dominated_by}
    if not eligible:
        return {**out, "best_fixed": None, "ttft_ratio": None, "meets": None,
                "text": f"no fixed choice reaches the controller's KL ({c['kl']:.4g}); the fastest fixed choice, "
                        f"{fastest['name']}, takes {fastest['ttft_ms']:.0f} ms at KL {fastest['kl']:.4g} against "
                        f"the controller's {c['ttft_ms']:.0f} ms"}
    best = min(eligible, key=lambda r: r["ttft_ms"])
    ratio = c["ttft_ms"] / best["ttft_ms"]
    meets = ratio <= target
    text = (f"controller {c['ttft_ms']:.0f} ms at KL {c['kl']:.4g} vs the best fixed choice at equal or better KL, "
            f"{best['name']}: {best['ttft_ms']:.0f} ms at KL {best['kl']:.4g} -> {ratio:.2f}x: "
            f"{'MEETS' if meets else 'MISSES'} the <= {target:.2f}x target")
    if dominated_by:
        verb = "is" if len(dominated_by) == 1 else "are"
        text += f"; but {', '.join(dominated_by)} {verb} at least as fast with a better KL"
    return {**out, "best_fixed": best["name"], "best_fixed_ttft_ms": best["ttft_ms"], "best_fixed_kl": best["kl"],
            "ttft_ratio": round(ratio, 4), "meets": meets, "text": text}


def spread_placement(n_blocks: int, tiers=TIERS) -> list[tuple[str, ...]]:
    """The tiers holding each block in the controller's placement (only among `tiers`, e.g. without Redis)."""
    order = [t for t in SPREAD if t in tiers]
    out = []
    for i in range(n_blocks):
        home = order[i % len(order)]
        out.append((home, ALSO[home]) if home in ALSO and ALSO[home] in tiers else (home,))
    return out


def first_token_kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(full || x) of the first-token distributions."""
    p = torch.log_softmax(ref_logits.float(), -1)
    q = torch.log_softmax(logits.float(), -1)
    return max(0.0, float((p.exp() * (p - q)).sum()))


# -- the run -------------------------------------------------------------------------------------------------

def run_controller_bench(cfg: ControllerBenchConfig, out_dir: Path = Path("bench_out"), progress=print) -> dict:
    from ragkv.bench.common import real_passages, save_json
    from ragkv.bench.ttft import build_request
    from ragkv.config import cache_dir
    from ragkv.engine.engine import Engine
    from ragkv.engine.loading import recompute_cost
    from ragkv.store.controller import PROFILE_FILE, _read_json, profile_id
    from ragkv.store.memory import MemoryStore
    from ragkv.store.tiered import TieredStore

    profile_path = cache_dir() / PROFILE_FILE
    saved_profiles = _read_json(profile_path)  # restored at the end: this run's measurements are its own
    base_store = TieredStore([MemoryStore()], pipelined=True, promote=False)
    engine = Engine.load(cfg.model, dtype=cfg.dtype, device=cfg.device, store=base_store, namespace=NAMESPACE)
    passages, questions = real_passages()
    segs = build_request(engine, passages, questions[0], cfg.context, cfg.query_tokens)
    keys = engine.warm(segs).keys
    kvs = [base_store.get(k) for k in keys]
    nbytes = sum(kv.nbytes for kv in kvs)
    L = engine.num_layers
    progress(f"request: {segs.num_tokens} tokens, {len(keys)} cached blocks ({[k.num_tokens for k in keys]} "
             f"tokens), {nbytes / 1e6:.1f} MB of KV ({engine.dtype_name}, {torch.get_num_threads()} threads)")

    with contextlib.ExitStack() as stack:
        tier_ids: set = set()  # profile ids of this run's tiers, filled as they are made
        stack.callback(_restore_profiles, profile_path, saved_profiles, tier_ids, engine.fingerprint)
        t0 = time.perf_counter()
        prof = engine.profile_store(refresh=cfg.refresh_profile)  # recompute cost, before anything is timed
        tokens = sum(k.num_tokens for k in keys)
        s_token_layer = recompute_cost(prof["recompute_points"], tokens)  # as the controller prices it
        rec_min_s = cfg.r_min * tokens * s_token_layer  # per layer, what the controller compares loading with
        progress(f"recompute profile ({time.perf_counter() - t0:.0f} s): {s_token_layer * 1e6:.2f} us per token and "
                 f"layer at {tokens} tokens -> {rec_min_s * 1e3:.1f} ms per layer at r_min={cfg.r_min}")

        tiers_avail = list(TIERS)
        redis_url = cfg.redis or stack.enter_context(bench_redis(progress))
        if not redis_url:
            tiers_avail.remove("redis")
        placement = spread_placement(len(keys), tiers_avail)
        throttled_only = [i for i, p in enumerate(placement) if p == ("throttled",)]
        thr_bytes = sum(kvs[i].nbytes // L for i in throttled_only)  # per layer
        delay_s, bps = _throttle(cfg, rec_min_s, len(throttled_only), thr_bytes)
        how = f"{delay_s * 1e3:.1f} ms per block and layer" if cfg.throttle == "latency" else f"{bps / 1e6:.2f} MB/s"
        progress(f"throttled tier: {how} ({cfg.throttle}); in the spread placement {len(throttled_only)} blocks "
                 f"only there: {_wait(delay_s, bps, [kvs[i].nbytes // L for i in throttled_only]) * 1e3:.1f} ms "
                 f"per layer to load vs {rec_min_s * 1e3:.1f} ms recompute at r_min")

        def make_tier(kind: str, role: str) -> KVStore:
            if kind == "memory":
                return MemoryStore()
            if kind == "throttled":
                return ThrottledStore(MemoryStore(), delay_s, bps, label=role)
            if kind == "disk":
                from ragkv.store.disk import DiskStore

                root = Path(cfg.disk_dir).expanduser() / role if cfg.disk_dir else stack.enter_context(
                    bench_dir(f"controller-{role}"))
                t = DiskStore(root, max(4 << 30, 4 * nbytes))
                stack.callback(t.clear, NAMESPACE)
                return t
            from ragkv.store.redis_store import RedisStore

            t = RedisStore(redis_url, prefix=f"ragkv-bench-controller-{role}:")
            stack.callback(t.clear, NAMESPACE)
            return t

        spread_tiers = {tier: make_tier(tier, "spread") for tier in tiers_avail}
        spread = TieredStore([spread_tiers[t] for t in tiers_avail], pipelined=True, promote=False)
        for k, kv, holders in zip(keys, kvs, placement):
            for t in holders:
                spread_tiers[t].put(k, kv)
        e = engine.with_store(spread, NAMESPACE)
        tier_ids.update(profile_id(t) for t in spread.tiers)
        t0 = time.perf_counter()
        sprof = e.profile_store()  # each spread tier's bandwidth (the recompute cost is fresh from above)
        progress(f"tier profile ({time.perf_counter() - t0:.0f} s): " + ", ".join(
            f"{d}: {bw / 1e6:.1f} MB/s" for d, bw in sprof["tiers"].items()))
        ctrl = Config("controller", "controller", "spread", replace(cfg.fusion, mode="blend", ratio=cfg.r_min,
                                                                   auto_ratio=True), e, spread)
        # the controller's own r joins the fixed grid: against a coarse grid, its in-between r would meet only
        # fixed choices of more recompute (better KL, slower) and look better than it is
        r_ctrl = round(e.prefill(segs, ctrl.fusion)[1].extra["loading_plan"]["ratio"], 3)
        ratios = sorted({*cfg.ratios, r_ctrl})
        progress(f"the controller's plan: r = {r_ctrl}; fixed choices at r in {ratios}")
        configs = [Config("full", "full", "memory", FusionOptions(mode="full"), engine, base_store), ctrl]
        for tier in tiers_avail:  # fixed: one single-tier store per tier, holding every block
            t = make_tier(tier, "fixed")
            store = TieredStore([t], pipelined=True, promote=False)
            for k, kv in zip(keys, kvs):
                t.put(k, kv)
            fe = engine.with_store(store, NAMESPACE)
            tier_ids.add(profile_id(t))
            for r in ratios:
                f = replace(cfg.fusion, mode="blend", ratio=r, auto_ratio=False)
                configs.append(Config(f"{tier} r={r:g}", "fixed", tier, f, fe, store))
        for r in cfg.ratios:
            f = replace(cfg.fusion, mode="blend", ratio=r, auto_ratio=False)
            configs.append(Config(f"spread r={r:g}", "spread", "spread", f, e, spread))
        time_configs(configs, segs, cfg.repeats, progress)

    rows = summarize(configs)
    throttled_desc = spread_tiers["throttled"].describe()
    result = {**engine.info(), "threads": torch.get_num_threads(), "context_tokens": cfg.context,
              "prompt_tokens": segs.num_tokens, "blocks": len(keys), "block_tokens": [k.num_tokens for k in keys],
              "kv_bytes": nbytes, "repeats": cfg.repeats, "r_min": cfg.r_min, "ratios": ratios,
              "check_layers": list(cfg.fusion.check_layers), "deviation": cfg.fusion.deviation,
              "gradual": cfg.fusion.gradual,
              "throttle": {"kind": cfg.throttle, "delay_ms": round(delay_s * 1e3, 3),
                           "mbps": None if bps is None else round(bps / 1e6, 4), "factor": cfg.throttle_factor,
                           "describe": throttled_desc},
              "placement": [{"block": i, "tokens": k.num_tokens, "held_by": list(p)}
                            for i, (k, p) in enumerate(zip(keys, placement))],
              "recompute_s_per_token_layer": s_token_layer, "recompute_points": prof["recompute_points"],
              "recompute_ms_per_layer_at_r_min": round(rec_min_s * 1e3, 3),
              "tier_bandwidth_bytes_per_s": sprof["tiers"], "tier_latency_s": sprof.get("tier_latency_s", {}),
              "throttled_load_ms_per_layer": {
                  "spread (blocks only there)": round(_wait(delay_s, bps, [kvs[i].nbytes // L for i in
                                                                              throttled_only]) * 1e3, 3),
                  "all blocks": round(_wait(delay_s, bps, [kv.nbytes // L for kv in kvs]) * 1e3, 3)},
              "redis": "given" if cfg.redis else ("private redis-server" if redis_url else "skipped"),
              "argv": sys.argv[1:], "round_order": "rotated", "rows": rows}
    plan = next(r["plan"] for r in rows if r["kind"] == "controller")
    if plan:  # what the throttle really costs for the blocks the plan reads from it (the plan's estimate is above)
        result["plan_throttled_load_ms_per_layer"] = {
            "predicted": round(sum((sprof.get("tier_latency_s", {}).get(t) or 0) + kvs[i].nbytes / L / sprof["tiers"][t]
                                   for i, t in enumerate(plan["tiers"]) if t.startswith("throttled")) * 1e3, 3),
            "actual": round(_wait(delay_s, bps, [kvs[i].nbytes // L for i, t in enumerate(plan["tiers"])
                                                 if t.startswith("throttled")]) * 1e3, 3)}
    result["verdict"] = verdict(rows, cfg.target)
    spread_rows = [r for r in rows if r["kind"] == "spread"]
    if spread_rows:
        result["verdict_vs_spread"] = verdict([r for r in rows if r["kind"] == "controller"]
                                              + [{**r, "kind": "fixed"} for r in spread_rows], cfg.target)
    progress(result["verdict"]["text"])
    out = Path(out_dir)
    save_json(out / "controller_bench.json", result)
    (out / "controller_bench.md").write_text(render_markdown(result))
    _plot(out / "controller_bench.png", result)
    return result


def _throttle(cfg: ControllerBenchConfig, rec_min_s: float, n_only: int, only_bytes: int) -> tuple[float, float | None]:
    """(delay per block-layer read, bytes/s or None): given, or auto: the blocks held only by the throttled tier
    in the spread placement load in throttle_factor x the recompute at r_min per layer."""
    want = cfg.throttle_factor * rec_min_s
    if cfg.throttle == "latency":
        return (cfg.throttle_ms / 1e3 if cfg.throttle_ms is not None else want / max(1, n_only)), None
    return 0.0, (cfg.throttle_mbps * 1e6 if cfg.throttle_mbps is not None else max(1, only_bytes) / want)


def _wait(delay_s: float, bps: float | None, layer_bytes: list[int]) -> float:
    return sum(delay_s + (b / bps if bps else 0.0) for b in layer_bytes)


def time_configs(configs: list[Config], segs, repeats: int, progress: Callable[[str], None]) -> None:
    """One untimed request per configuration (its logits give the KL; allocations, page cache), then `repeats`
    rounds over all of them, each round starting at another configuration (the order otherwise kept)."""

    def request(c: Config):
        counters = c.store.counters
        hits = dict(counters["hits"])
        t0 = time.perf_counter()
        state, stats = c.engine.prefill(segs, c.fusion)
        ms = (time.perf_counter() - t0) * 1000
        c.reads = {t: n - hits.get(t, 0) for t, n in counters["hits"].items() if n > hits.get(t, 0)}
        return ms, state, stats

    ref = None
    for c in configs:
        ms, state, stats = request(c)
        if stats.cache_misses or stats.extra.get("uncached_blocks"):
            raise RuntimeError(f"{c.name}: {stats.cache_misses} blocks missed; the bench is broken")
        c.plan = stats.extra.get("loading_plan")
        c.ratio = (c.plan or {}).get("ratio", c.fusion.ratio) if c.fusion.auto_ratio else (
            c.fusion.ratio if c.fusion.mode == "blend" else None)
        if c.kind == "full":  # the reference: timed once (its run is long and nothing is compared with it)
            ref = state.logits
            c.runs.append(ms)
            c.waits.append(0.0)
        c.kl = first_token_kl(ref, state.logits)
        c.top1 = bool(int(ref.argmax()) == int(state.logits.argmax()))
        progress(f"  {c.name}: r={c.ratio}, KL {c.kl:.4g}, reads {c.reads}")
    timed = [c for c in configs if c.kind != "full"]
    for i in range(repeats):
        shift = (i * 7) % len(timed)  # each round starts elsewhere: no configuration always follows the same one
        for c in timed[shift:] + timed[:shift]:
            ms, _, stats = request(c)
            c.runs.append(ms)
            c.waits.append(stats.extra.get("load_wait_ms", 0.0))
        progress(f"  round {i + 1}/{repeats} (ms): " + ", ".join(f"{c.name} {c.runs[-1]:.0f}" for c in timed))


def summarize(configs: list[Config]) -> list[dict]:
    full = statistics.median(configs[0].runs)
    rows = []
    for c in configs:
        ttft = statistics.median(c.runs)
        plan = c.plan if c.plan and "ratio" in c.plan else None
        rows.append({"name": c.name, "kind": c.kind, "tier": c.tier, "ratio": c.ratio,
                     "ttft_ms": round(ttft, 2), "best_ms": round(min(c.runs), 2),
                     "runs_ms": [round(t, 2) for t in c.runs], "vs_full": round(ttft / full, 4),
                     "kl": round(c.kl, 6), "top1_agrees": c.top1,
                     "load_wait_ms": round(statistics.median(c.waits), 2), "reads": c.reads,
                     "plan": plan if c.kind == "controller" else None})
    return rows


# -- rendering -----------------------------------------------------------------------------------------------

def render_markdown(res: dict) -> str:
    from ragkv.bench.common import markdown_table

    th = res["throttle"]
    how = (f"{th['delay_ms']:.1f} ms per block and layer read" if th["kind"] == "latency"
           else f"{th['mbps']:.2f} MB/s per block read")
    rotated = ", each starting at another configuration" if res.get("round_order") == "rotated" else ""
    head = (f"Loading-controller benchmark on {res['model']} ({res['dtype']}, {res['device']}, {res['threads']} "
            f"threads): {res['prompt_tokens']}-token request, {res['blocks']} cached blocks "
            f"({res['kv_bytes'] / 1e6:.1f} MB of KV), blend check layers {res['check_layers']} "
            f"(deviation {res['deviation']}{', gradual' if res['gradual'] else ''}); TTFT median of {res['repeats']} "
            f"round-robin rounds{rotated} (full: its one reference run); KL = first-token KL(full || x). "
            f"Redis: {res['redis']}. Throttled tier: {how} "
            f"({th['kind']}; loading the spread placement's throttled-only blocks takes "
            f"{res['throttled_load_ms_per_layer']['spread (blocks only there)']:.1f} ms per layer, all blocks "
            f"{res['throttled_load_ms_per_layer']['all blocks']:.1f} ms; recompute at r_min={res['r_min']} is "
            f"{res['recompute_ms_per_layer_at_r_min']:.1f} ms per layer by the profile).\n\n")
    place = "Spread placement (the controller's store): " + "; ".join(
        f"block {p['block']} ({p['tokens']} tok): {'+'.join(p['held_by'])}" for p in res["placement"]) + ".\n\n"
    rows = [[f"**{r['name']}**" if r["kind"] == "controller" else r["name"], r["kind"],
             "-" if r["ratio"] is None else f"{r['ratio']:.3f}", f"{r['ttft_ms']:.0f}", f"{r['best_ms']:.0f}",
             f"{100 * r['vs_full']:.1f}%", f"{r['kl']:.4f}", "yes" if r["top1_agrees"] else "no",
             f"{r['load_wait_ms']:.0f}", ", ".join(f"{_short(t)}: {n}" for t, n in r["reads"].items()) or "-"]
            for r in res["rows"]]
    table = markdown_table(["configuration", "kind", "r", "TTFT ms (median)", "best ms", "vs full", "KL",
                            "top-1 = full", "load wait ms", "blocks read from"], rows)
    lines = [f"- **Verdict** (vs every fixed (r, tier) choice): {res['verdict']['text']}."]
    if "verdict_vs_spread" in res:
        lines.append(f"- Against the spread placement at a fixed r: {res['verdict_vs_spread']['text']}.")
    ctrl = next(r for r in res["rows"] if r["kind"] == "controller")
    if ctrl["plan"]:
        p = ctrl["plan"]
        lines.append(f"- The controller's plan: r={p['ratio']:.3f}, predicted loading {p['load_ms_per_layer']:.1f} "
                     f"ms/layer vs recompute {p['recompute_ms_per_layer']:.1f} ms/layer; blocks read from "
                     f"{', '.join(_short(t) for t in p['tiers'])}. {p['reason']}.")
    if "plan_throttled_load_ms_per_layer" in res:
        t = res["plan_throttled_load_ms_per_layer"]
        lines.append(f"- Loading of the blocks the plan reads from the throttled tier: the controller predicted "
                     f"{t['predicted']:.1f} ms per layer, the throttle takes {t['actual']:.1f} ms (its waits).")
    lat = res.get("tier_latency_s", {})
    bws = "; ".join(f"{_short(d)}: {bw / 1e6:.1f} MB/s + {(lat.get(d) or 0) * 1e3:.3f} ms per read"
                    for d, bw in res["tier_bandwidth_bytes_per_s"].items() if bw is not None)
    lines.append(f"- Profiled tiers (what the controller plans with): {bws}.")
    return head + place + table + "\n\n" + "\n".join(lines) + "\n"


def _short(desc: str) -> str:
    for kind in ("memory", "disk", "redis", "throttled"):
        if desc.startswith(kind):
            return kind
    return desc


def _plot(path: Path, res: dict) -> None:
    from ragkv.figures import pyplot, save_figure

    fig, ax = pyplot().subplots(figsize=(10.5, 5))
    markers = {"memory": "o", "disk": "s", "redis": "D", "throttled": "v", "spread": "P"}
    ratios = sorted({r["ratio"] for r in res["rows"] if r["kind"] in ("fixed", "spread")})
    colors = {r: f"C{i}" for i, r in enumerate(ratios)}
    floor = min([r["kl"] for r in res["rows"] if r["kl"] > 0] or [1e-6]) / 3
    for tier, m in markers.items():
        rows = [r for r in res["rows"] if r["kind"] in ("fixed", "spread") and r["tier"] == tier]
        for r in rows:
            ax.scatter(r["ttft_ms"], max(r["kl"], floor), marker=m, color=colors[r["ratio"]], s=45, alpha=0.85,
                       label=None)
    for tier, m in markers.items():  # legend: shape = tier, color = r
        if any(r["tier"] == tier and r["kind"] in ("fixed", "spread") for r in res["rows"]):
            note = " (controller placement)" if tier == "spread" else ""
            ax.scatter([], [], marker=m, color="gray", label=f"{tier}{note}")
    for r, c in colors.items():
        ax.scatter([], [], marker="s", color=c, label=f"r={r:g}")
    ctrl = next(r for r in res["rows"] if r["kind"] == "controller")
    ax.scatter(ctrl["ttft_ms"], max(ctrl["kl"], floor), marker="*", s=400, color="red", edgecolor="black", zorder=5,
               label=f"controller (r={ctrl['ratio']:.3f})")
    full = next(r for r in res["rows"] if r["kind"] == "full")  # far to the right: named in the title instead
    v = res["verdict"]
    if v.get("best_fixed"):
        ax.axvline(v["best_fixed_ttft_ms"] * v["target"], color="red", ls="--", lw=0.8,
                   label=f"target: {v['target']:.2f}x best fixed at equal KL")
    ax.set_yscale("log")
    ax.set_xlabel("TTFT (ms, median)")
    ax.set_ylabel("first-token KL(full || x)")
    ax.set_title(f"Loading controller vs fixed (r, tier), {res['model']} {res['dtype']}, {res['prompt_tokens']} "
                 f"tokens, throttle {res['throttle']['kind']} (full: {full['ttft_ms'] / 1e3:.0f} s, KL 0)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    save_figure(fig, path)


# -- plumbing ------------------------------------------------------------------------------------------------

def _restore_profiles(path: Path, before: dict, tier_ids: set, fingerprint: str) -> None:
    """Put back what this run changed in the saved load profiles: its tiers' bandwidths (throwaway directories,
    a private Redis, the throttle) and its recompute measurement (taken under this run's threads and load) must
    not become another process's plan. Entries other processes wrote meanwhile stay."""
    from ragkv.store.controller import _read_json, _write_json

    now = _read_json(path)
    mine = {k for k in now if (k in tier_ids or k.startswith(f"recompute:{fingerprint}:")) and now[k] != before.get(k)}
    if not mine:
        return
    for k in mine:
        if k in before:
            now[k] = before[k]
        else:
            del now[k]
    if now or before:
        _write_json(path, now)
    else:  # the run created the file: leave none behind
        path.unlink(missing_ok=True)


__all__ = ["ControllerBenchConfig", "ThrottledStore", "run_controller_bench", "verdict", "spread_placement",
           "first_token_kl"]
