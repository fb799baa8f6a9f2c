"""Shared benchmark plumbing: timing, context building from real passages, JSON/markdown/PNG output."""

from __future__ import annotations

import contextlib
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from ragkv.config import machine


def sync_device() -> None:
    """Wait for queued GPU work, so a timing covers the kernels and not only their launch."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def greedy_steps(model, states, steps: int, rows: int | None = None) -> tuple[list[list[int]], list[float]]:
    """Greedy decode of `states` together for `steps` tokens (ragkv.engine.kv.state.decode_batch, `rows` as there):
    each state's tokens, and the time of each batched step in ms."""
    from ragkv.engine.kv.state import decode_batch

    tokens, times = [[] for _ in states], []
    for _ in range(steps):
        feed = [int(s.logits.argmax()) for s in states]
        for out, t in zip(tokens, feed):
            out.append(t)
        sync_device()
        t0 = time.perf_counter()
        decode_batch(model, states, feed, rows)
        sync_device()
        times.append((time.perf_counter() - t0) * 1000)
    return tokens, times


def median_ms(fn, repeats: int, warmup: int = 1) -> tuple[float, list[float]]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync_device()
        t0 = time.perf_counter()
        fn()
        sync_device()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times), times


def interleaved_ms(fns: dict, repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Each callable's times over `repeats` rounds, one run of each per round in turn: a drift of the machine
    (these cores are shared) then falls on every side of a ratio alike, not on whichever ran last."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync_device()
            t0 = time.perf_counter()
            fn()
            sync_device()
            times[name].append((time.perf_counter() - t0) * 1000)
    return times


def real_passages(limit: int = 400):
    """Passages from the shared MuSiQue file (real text, ~415 words each)."""
    from ragkv.eval.datasets import load_dataset

    out = []
    for ex in load_dataset("musique", limit=60):
        out.extend(ex.passages)
        if len(out) >= limit:
            break
    return out, [ex.question for ex in load_dataset("musique", limit=20)]


def machine_probe(dtype_name: str = "float32", n: int = 1024, copy_mib: int = 256, rounds: int = 3) -> dict:
    """What this machine gives right now: the best GFLOP/s of an n x n x n product in `dtype_name` and the GB/s of a
    `copy_mib` tensor copy (read + write), best of `rounds`. Recorded before and after a benchmark's cells: these
    machines' speed drifts within an hour, and a figure means little without the rate it was taken at."""
    import torch

    dtype = getattr(torch, dtype_name)
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    src = torch.empty(copy_mib << 18, dtype=torch.float32)  # copy_mib MiB of fp32
    dst = torch.empty_like(src)
    a @ b
    dst.copy_(src)

    def best(fn) -> float:
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)
    gemm = 2 * n ** 3 / best(lambda: a @ b) / 1e9
    copy = 2 * src.numel() * 4 / best(lambda: dst.copy_(src)) / 1e9
    return {"dtype": dtype_name, "gemm_n": n, "gemm_gflops": round(gemm, 1), "copy_mib": copy_mib,
            "copy_gb_per_s": round(copy, 2)}


def save_json(path: Path, obj) -> Path:
    """Write a benchmark's result with the machine it ran on (`ragkv.config.machine`), added under "machine" to the
    result itself, so what the benchmark returns and prints names it too."""
    if isinstance(obj, dict):
        obj["machine"] = {**machine(), **obj.get("machine", {})}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2))
    return path


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


@contextlib.contextmanager
def bench_dir(prefix: str):
    """A temporary directory under $RAGKV_CACHE_DIR/bench (a disk tier's home for one run), removed afterwards."""
    from ragkv.config import cache_dir

    root = cache_dir() / "bench"
    root.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f"{prefix}-", dir=root))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def bench_redis(progress):
    """URL of a redis-server started for the run (no persistence), or None if there is none to start."""
    from ragkv.store.redis_server import RedisStartError, private_redis

    with tempfile.TemporaryDirectory(prefix="ragkv-bench-redis-") as workdir, contextlib.ExitStack() as stack:
        try:
            url = stack.enter_context(private_redis(workdir))
        except RedisStartError as e:
            progress(f"{e}: skipping the Redis tier (or pass --redis URL)")
            url = None
        yield url
