"""`run_serve_bench`: every (mode, concurrency) cell against one or several ragkv servers, interleaved with a peer's."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import asdict
from pathlib import Path

from ragkv.bench.serve.clients import KVPeak, batching_stats, connect, describe_cell, measure_cell, slo_ratios
from ragkv.bench.serve.config import ServeBenchConfig
from ragkv.bench.serve.peer import make_peer, peer_ratios, run_peer, token_counter
from ragkv.bench.serve.report import plot_serve_bench, render_markdown
from ragkv.bench.serve.servers import ServerProcess, cpu_seconds_of, started_together, wait_idle, wait_written
from ragkv.bench.serve.workload import build_workload, ragkv_payload, warmup_requests
from ragkv.config import machine
from ragkv.engine.modes import is_reference
from ragkv.errors import InvalidRequestError


def run_serve_bench(cfg: ServeBenchConfig, url: str | list[str] | None = None, out_dir: Path = Path("bench_out"),
                    progress=print, server: ServerProcess | None = None, peer=None,
                    peer_url: str | None = None, model: str = "smollm2", count=None) -> dict:
    """Run every (mode, concurrency) cell against `url`, or against a server started here (and stopped after);
    several URLs (servers sharing a store) take the requests round-robin, and only the first is warmed up, so
    the others' hits come from the shared tiers. With `cfg.peer`, the same requests go to `peer_url` or a peer
    started here, both servers up at once and the cells interleaved: at each concurrency the peer's cell comes
    first, then ragkv's, and the order flips at the next level, because these machines' speed drifts by up to 3x
    within an hour (a peer measured after ragkv's whole run would be measured on another machine). Writes
    serve_bench.json, .png and .md under `out_dir`; returns the JSON object. `count` counts the peer's tokens
    (default: `token_counter` of the model)."""
    from ragkv.bench.common import machine_probe, save_json

    work = build_workload(cfg)
    servers = server if isinstance(server, list) else [server]
    probe_dtype = "bfloat16" if any(getattr(s, "dtype", None) == "bfloat16" for s in servers) else "float32"
    result = {"benchmark": "serve", "config": asdict(cfg), "url": None, "server": {},
              "machine": {**machine(), "probe_before": machine_probe(probe_dtype)}, "warmup": {}, "cells": [],
              "rate_cells": [], "order": []}
    with contextlib.ExitStack() as stack:
        ragkv_cells = None
        if cfg.modes:
            if url is None:
                group = server if isinstance(server, list) else [server or ServerProcess(model)]
                started = stack.enter_context(started_together(group))
                url = started[0].url if len(started) == 1 else [s.url for s in started]
                result["server"]["started_here"] = [" ".join(s.cmd) for s in started]
                result["server"]["threads"] = [s.threads for s in started]  # None: torch's default (every core)
                ragkv_cells = run_ragkv(cfg, work, url, progress, result, lambda: cpu_seconds_of(started))
            else:
                ragkv_cells = run_ragkv(cfg, work, url, progress, result)
        peer_cells = None
        if cfg.peer:
            count = count or token_counter(getattr(peer, "model", None) or getattr(server, "model", None) or model)
            if peer_url is None:
                p = stack.enter_context(peer or make_peer(cfg.peer, model))
                peer_cells = run_peer(cfg, work, p.url, progress, result, count, p.cpu_seconds)
                result["peer"].update(started_here=" ".join(p.cmd), version=p.version(), threads=p.threads,
                                      **p.describe())
            else:  # a peer that outlives runs keeps their prompts in its prefix cache: the same seed repeats them
                progress(f"[serve bench] {cfg.peer} at {peer_url} is not started here: its prefix cache may hold an "
                         f"earlier run's prompts (seed {cfg.seed}, level by level); give each run its own --seed")
                peer_cells = run_peer(cfg, work, peer_url, progress, result, count)
        result["order"].extend(interleaved(cfg, [t for t in (peer_cells, ragkv_cells) if t is not None]))
    if cfg.peer:
        result["ratios_vs_peer"] = peer_ratios(result["cells"], cfg.peer)
        result["goodput_vs_peer"] = goodput_ratios(result["rate_cells"], cfg.peer)
    ragkv_only = [c for c in result["cells"] if c["system"] == "ragkv"]
    result["ratios_vs_full"] = slo_ratios(ragkv_only) if any(map(is_reference, cfg.modes)) else {}
    result["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    result["machine"]["probe_after"] = machine_probe(probe_dtype)  # the servers are stopped: the machine's own rate
    save_json(out_dir / "serve_bench.json", result)
    plot_serve_bench(result["cells"], out_dir / "serve_bench.png")
    (out_dir / "serve_bench.md").write_text(render_markdown(result) + "\n")
    return result


def interleaved(cfg: ServeBenchConfig, turns: list) -> list[str]:
    """Run every level's cells, the systems' turns alternating: at the first level the first turn (the peer's) goes
    first, at the next the last, and so on, so that neither side always meets the machine's drift at one end.
    Returns the cells' names in the order run."""
    order = []
    for level, (kind, value) in enumerate(cfg.levels()):
        for turn in (turns if level % 2 == 0 else turns[::-1]):
            order.extend(turn(level, int(value), None) if kind == "concurrency" else turn(level, None, value))
    return order


def goodput_ratios(cells: list[dict], peer: str) -> dict:
    """Each ragkv mode's goodput over the peer's at the same request rate: {mode: {rate: ratio}} (None where the
    peer's goodput is 0: no ratio to state; both goodputs are in the cells)."""
    theirs = {c["rate"]: c for c in cells if c.get("system") == peer}
    out = {}
    for c in cells:
        p = theirs.get(c["rate"])
        if c.get("system") == "ragkv" and p is not None:
            out.setdefault(c["mode"], {})[str(c["rate"])] = (round(c["goodput_per_s"] / p["goodput_per_s"], 3)
                                                             if p["goodput_per_s"] else None)
    return out


def run_ragkv(cfg: ServeBenchConfig, work: dict, url: str | list[str], progress, result: dict,
              server_cpu=lambda: None):
    """Connect to the ragkv server(s) and warm every mode up; returns `cells(level, concurrency)`, which runs every
    mode's cell at one concurrency level."""
    import httpx

    servers = [connect(u, cfg) for u in ([url] if isinstance(url, str) else url)]
    models = {m for _, _, m in servers}
    if len(models) > 1:
        raise InvalidRequestError(f"the servers serve different models ({', '.join(sorted(models))}); a shared "
                                  "store's benchmark wants one model behind every URL")
    base, client, model = servers[0]
    health = httpx.get(base + "/health", timeout=10).json()
    result["url"] = base if len(servers) == 1 else [b for b, _, _ in servers]
    result["server"].update(model=model, dtype=health.get("dtype"), decode_weights=health.get("decode_weights"))
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
                wait_written(base)
            progress(f"[serve bench] {mode}: warm-up, {len(work['pool'])} single-passage requests in "
                     f"{result['warmup'][mode]['seconds']} s")
    for b, _, _ in servers:
        wait_idle(b)  # a server's start-up profile runs its forwards while idle: before the cells, not inside

    def cells(level: int, c: int, rate: float | None = None) -> list[str]:
        """Every mode's cell at concurrency `c` or Poisson `rate` (the `level`-th); returns the cells' names in the
        order run."""
        name = f"c={c}" if rate is None else f"rate={rate}"
        for mode in cfg.modes:
            payloads = [ragkv_payload(r, mode, work["system"]) for r in work["plans"][level]]
            h0 = httpx.get(base + "/health", timeout=10).json()
            with KVPeak(base, enabled=not cfg.peer) as kv:  # beside a peer, no poller ragkv's cells alone pay for
                cell = measure_cell(result["cells" if rate is None else "rate_cells"], clients, model, payloads, mode,
                                    "ragkv", c, cfg, server_cpu, rate=rate)
            if len(servers) == 1:  # one server's batching counters; with several, its share would mislead
                cell.update(batching_stats(h0, httpx.get(base + "/health", timeout=10).json()), kv_bytes_peak=kv.peak)
            progress(f"[serve bench] {mode} {name}: {describe_cell(cell)}; reused {cell['reused_tokens']} / "
                     f"{cell['prompt_tokens']} prompt tokens")
        return [f"ragkv {m} {name}" for m in cfg.modes]
    return cells
