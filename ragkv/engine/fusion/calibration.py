"""APE's T and S per model: calibrated values (written by `ragkv calibrate`) or the paper's defaults."""

from __future__ import annotations

import json
from pathlib import Path

from ragkv.config import cache_dir
from ragkv.engine.fusion.ape import DEFAULT_S, DEFAULT_T
from ragkv.engine.measure.risk import DEFAULT_SIGNAL, check_signal


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


DEFAULT_MAX_RISK = 0.05  # auto's threshold before any calibration: KL 0.05 escalates most answers (conservative)


def auto_calibration_path(fingerprint: str) -> Path:
    return cache_dir() / "calibration" / f"auto-{fingerprint}.json"


def load_auto_params(fingerprint: str) -> tuple[str, float, str]:
    """(signal, max_risk, source) for `auto`: what `ragkv calibrate --target auto` chose for this model, else the
    `shift` signal at DEFAULT_MAX_RISK (source "default")."""
    path = auto_calibration_path(fingerprint)
    try:
        data = json.loads(path.read_text())
        return check_signal(data["signal"]), float(data["threshold"]), str(path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return DEFAULT_SIGNAL, DEFAULT_MAX_RISK, "default"


def save_auto_params(fingerprint: str, signal: str, threshold: float, **extra) -> Path:
    path = auto_calibration_path(fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"signal": signal, "threshold": threshold, **extra}, indent=2))
    tmp.replace(path)
    return path
