"""Shared benchmark plumbing: timing, context building from real passages, JSON/markdown/PNG output."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path


def median_ms(fn, repeats: int, warmup: int = 1) -> tuple[float, list[float]]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times), times


def real_passages(limit: int = 400):
    """Passages from the shared MuSiQue file (real text, ~415 words each)."""
    from ragkv.eval.datasets import load_dataset

    out = []
    for ex in load_dataset("musique", limit=60):
        out.extend(ex.passages)
        if len(out) >= limit:
            break
    return out, [ex.question for ex in load_dataset("musique", limit=20)]


def save_json(path: Path, obj) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2))
    return path


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)
