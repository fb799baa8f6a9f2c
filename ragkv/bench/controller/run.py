"""`run_controller_bench`: the request cached in every store, the profile, each configuration timed
round-robin, its first-token KL against full, and the results written."""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from ragkv.bench.common import bench_dir, bench_redis
from ragkv.bench.controller.config import NAMESPACE, TIERS, Config, ControllerBenchConfig, spread_placement
from ragkv.bench.controller.report import plot, render_markdown, verdict
from ragkv.bench.controller.throttled import ThrottledStore
from ragkv.engine.modes import get_mode
from ragkv.engine.options import FusionOptions
from ragkv.store.base import KVStore


def run_controller_bench(cfg: ControllerBenchConfig, out_dir: Path = Path("bench_out"), progress=print) -> dict:
    from ragkv.bench.common import real_passages, save_json
    from ragkv.bench.ttft import build_request
    from ragkv.engine.blocks.loading import StoreProfiles, recompute_cost
    from ragkv.engine.engine import Engine
    from ragkv.store.memory import MemoryStore
    from ragkv.store.probe import profile_id
    from ragkv.store.tiered import TieredStore

    saved_profiles = StoreProfiles.load().data  # restored at the end: this run's measurements are its own
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
        stack.callback(_restore_profiles, saved_profiles, tier_ids, engine.fingerprint)
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
    plot(out / "controller_bench.png", result)
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
            c.fusion.ratio if "ratio" in get_mode(c.fusion.mode).option_fields else None)
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


def first_token_kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(full || x) of the first-token distributions."""
    p = torch.log_softmax(ref_logits.float(), -1)
    q = torch.log_softmax(logits.float(), -1)
    return max(0.0, float((p.exp() * (p - q)).sum()))


def _restore_profiles(before: dict, tier_ids: set, fingerprint: str) -> None:
    """Put back what this run changed in the saved load profiles: its tiers' bandwidths (throwaway directories,
    a private Redis, the throttle) and its recompute measurement (taken under this run's threads and load) must
    not become another process's schedule. Entries other processes wrote meanwhile stay."""
    from ragkv.engine.blocks.loading import StoreProfiles

    profiles = StoreProfiles.load()
    profiles.restore(before, {k for k in profiles.data if k in tier_ids or k.startswith(f"recompute:{fingerprint}:")})
