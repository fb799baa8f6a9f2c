"""Kernels chosen by measuring the machine: for each product of a model (weight shape and the op it feeds: plain,
SwiGLU, residual add) and each class of row counts, every candidate kernel is timed once on this CPU and the
fastest is used from then on. What is fast on one CPU is slow on another (the packed oneDNN path that won on an AVX-512
BF16 Zen 4 lost to torch's stock `F.linear` on an AMX Xeon, where oneDNN picks the matrix unit by itself), so no
choice is written down by hand. Results are cached in the cache folder, keyed by CPU model, ISA flags, torch
version, dtype and shape: a server measures at its first start on a machine only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from ragkv.config import cache_dir, cpu_has, cpu_name

log = logging.getLogger(__name__)

# (lowest, highest) rows of each product class and the row count that stands for it when timed. Above 512 rows a
# class of its own: on an AMX Xeon oneDNN's one product of 1,024-2,048 rows ran at 1.15-2.7 TFLOP/s depending on the
# count, where 512-row tiles held 1.9-2.6 (a 1,329-row down projection: 1.18 against 1.96). That class is timed at
# 1,024 rows, a RAG prompt's size: timed at 1,536, the MLP chose a kernel 1.2x slower at 1,024 (same AMX Xeon).
# 129-512 is timed at 256, the rows it mostly serves (blend's and query-aware's selected rows, ~200-450): timed at
# 512, its edge, the AMX product and oneDNN tied on the 0.5B's QKV, output and down projections, where at 256 the
# AMX product was 7-12% faster (and query-aware's prefill 2.6%, blend's 5%, with it; AMX Xeon).
ROW_CLASSES = ((1, 1), (2, 4), (5, 16), (17, 128), (129, 512), (513, None))
PROBE_ROWS = (1, 4, 16, 128, 256, 1024)
MAX_PROBE_MACS = 1.4e10  # a class whose probe would cost more (an LM head at 128 rows) keeps the default kernel
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
REPEATS = 7
TIMING = "interleaved"  # how a cached entry was measured: entries measured otherwise are measured again
COPY_MARGIN = 0.05  # how much faster than the rest a kernel needing its own copy of the weights must be


def row_class(rows: int) -> int:
    for i, (lo, hi) in enumerate(ROW_CLASSES):
        if hi is None or rows <= hi:
            return i
    return len(ROW_CLASSES) - 1


def machine_key(dtype: torch.dtype) -> str:
    """What a kernel's speed depends on besides its shape: the CPU, the ISA its code paths may use (torch's capped by
    ATEN_CPU_CAPABILITY, ragkv's by scripts/as_avx2.sh), torch's build, the dtype."""
    isa = ",".join(f for f in ISA_FLAGS if cpu_has(f))
    torch_isa = torch.backends.cpu.get_cpu_capability()
    return f"{cpu_name()}|{isa}|torch {torch.__version__} {torch_isa}|{str(dtype).removeprefix('torch.')}"


def interleaved_medians(calls: dict[str, Callable[[], object]], timer: Callable[[], float],
                        repeats: int = REPEATS) -> dict[str, float]:
    """Each call's median ms over `repeats` rounds, after one untimed call each (first-call allocation, kernel
    caches). A round times every call once, in an order that rotates: the machine's drift (a shared host, turbo)
    falls on all candidates alike instead of on whichever ran last."""
    names = list(calls)
    if not names:
        return {}
    for name in names:
        calls[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = timer()
            calls[name]()
            times[name].append((timer() - t0) * 1000)
    return {name: statistics.median(ts) for name, ts in times.items()}


def fastest(times: dict[str, float], with_copy: tuple[str, ...] = (), margin: float = COPY_MARGIN) -> str:
    """The fastest kernel, where one that needs a copy of the weights (`with_copy`) must beat the fastest of the
    others by `margin` (a tie is not worth the memory)."""
    best = min(times, key=times.get)
    others = {k: t for k, t in times.items() if k not in with_copy}
    if best in with_copy and others and times[best] > (1 - margin) * min(others.values()):
        return min(others, key=others.get)
    return best


def choose_per_class(times: list[dict[str, float]], default: str, with_copy: tuple[str, ...] = ()) -> list[str]:
    """Each row class's kernel (`fastest`; `default` where the class was not timed). A copy that some class runs on
    is made anyway, so the other classes then take it by time alone: the margin weighs memory not yet spent (an AMX
    Xeon's down projection at 256 rows: the AMX product 1.59 ms, oneDNN 1.60, the AMX copy held for 128 and 1,024)."""
    choice = [fastest(t, with_copy) if t else default for t in times]
    held = {k for k in choice if k in with_copy}
    if not held:
        return choice
    # a second pass cannot add a copy: the held kernels join the others the remaining copies must beat
    return [fastest(t, tuple(k for k in with_copy if k not in held)) if t else default for t in times]


class KernelChooser:
    """Times candidate kernels per (product, row class) once per machine and keeps the fastest; `table` holds every
    measurement (`ragkv bench kernels` prints it). `timer` is injectable so that a test can check the choice
    follows the measurements."""

    def __init__(self, path: Path | None = None, timer: Callable[[], float] = time.perf_counter,
                 repeats: int = REPEATS, refresh: bool = False):
        self.path = path if path is not None else cache_dir() / "kernels.json"
        self.timer, self.repeats, self.refresh = timer, repeats, refresh
        self.table: dict[str, dict] = {}
        if self.path.exists() and not refresh:
            try:
                self.table = json.loads(self.path.read_text())
            except (OSError, ValueError):
                log.warning("kernel choices at %s are unreadable; measuring again", self.path)
        self.measured = 0  # products measured by this chooser (0: every choice came from the cache)

    def choose(self, product: str, dtype: torch.dtype, macs_per_row: int,
               candidates: dict[str, Callable[[int], Callable[[], object]]], default: str,
               with_copy: tuple[str, ...] = ()) -> list[str]:
        """The kernel for each row class of `product` (a name of its shape and op). `candidates[name](rows)` returns
        a call running that kernel on `rows` rows, or None where the kernel cannot take them; a class whose probe
        would cost more than MAX_PROBE_MACS gets `default` unmeasured (0 MACs: every class is probed). Kernels in
        `with_copy` run on a copy of the weights of their own and must win by COPY_MARGIN (`fastest`)."""
        key = hashlib.sha1(f"{machine_key(dtype)}|{product}".encode()).hexdigest()[:16]
        entry = self.table.get(key)
        if entry is not None and set(entry["candidates"]) == set(candidates) \
                and entry.get("probe_rows") == list(PROBE_ROWS) and entry.get("timing") == TIMING:
            entry["choice"] = choose_per_class(entry["ms"], default, with_copy)  # measured once, chosen by today's rule
            return entry["choice"]
        times: list[dict[str, float]] = []
        for rows in PROBE_ROWS:
            calls = {}
            if rows * macs_per_row <= MAX_PROBE_MACS:
                calls = {name: call for name, make in candidates.items() if (call := make(rows)) is not None}
            times.append({name: round(ms, 4) for name, ms in interleaved_medians(calls, self.timer,
                                                                                  self.repeats).items()})
        choice = choose_per_class(times, default, with_copy)
        self.table[key] = {"machine": machine_key(dtype), "product": product, "candidates": sorted(candidates),
                           "probe_rows": list(PROBE_ROWS), "ms": times, "choice": choice, "timing": TIMING}
        self.measured += 1
        return choice

    def save(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.table, indent=1, sort_keys=True))
            tmp.replace(self.path)
        except OSError as e:  # a read-only cache only means measuring again next time
            log.warning("could not save kernel choices to %s (%s)", self.path, e)
