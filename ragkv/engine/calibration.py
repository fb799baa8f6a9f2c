"""APE's T and S per model: calibrated values (written by `ragkv calibrate`) or the paper's defaults."""

from __future__ import annotations

import json
from pathlib import Path

from ragkv.config import cache_dir
from ragkv.engine.ape import DEFAULT_S, DEFAULT_T


def calibration_path(fingerprint: str) -> Path:
    return cache_dir() / "calibration" / f"ape-{fingerprint}.json"


def load_ape_params(fingerprint: str, task: str | None = None) -> tuple[float, float, str]:
    """(T, S, source): the calibration for `task` (qa, summarization, ...) when one was made for it, else the
    model's latest calibration, else the paper's defaults (source "default")."""
    path = calibration_path(fingerprint)
    try:
        data = json.loads(path.read_text())
        entry = (data.get("tasks") or {}).get(task) if task else None
        if entry:
            return float(entry["temperature"]), float(entry["scale"]), f"{path} [{task}]"
        return float(data["temperature"]), float(data["scale"]), str(path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return DEFAULT_T, DEFAULT_S, "default"


def save_ape_params(fingerprint: str, temperature: float, scale: float, task: str | None = None, **extra) -> Path:
    """Save a calibration: the model's default from now on, and `task`'s own entry (kept beside other tasks')."""
    path = calibration_path(fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        tasks = json.loads(path.read_text()).get("tasks") or {}
    except (OSError, ValueError, AttributeError):
        tasks = {}
    entry = {"temperature": temperature, "scale": scale, **extra}
    if task:
        tasks[task] = {**entry, "task": task}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**entry, "task": task, "tasks": tasks}, indent=2))
    tmp.replace(path)
    return path
