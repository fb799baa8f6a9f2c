"""APE's T and S per model: calibrated values (written by `ragkv calibrate`) or the paper's defaults."""

from __future__ import annotations

import json
from pathlib import Path

from ragkv.config import cache_dir
from ragkv.engine.ape import DEFAULT_S, DEFAULT_T


def calibration_path(fingerprint: str) -> Path:
    return cache_dir() / "calibration" / f"ape-{fingerprint}.json"


def load_ape_params(fingerprint: str) -> tuple[float, float, str]:
    """(T, S, source) where source is the calibration file or "default"."""
    path = calibration_path(fingerprint)
    try:
        data = json.loads(path.read_text())
        return float(data["temperature"]), float(data["scale"]), str(path)
    except (OSError, ValueError, KeyError, TypeError):
        return DEFAULT_T, DEFAULT_S, "default"


def save_ape_params(fingerprint: str, temperature: float, scale: float, **extra) -> Path:
    path = calibration_path(fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"temperature": temperature, "scale": scale, **extra}, indent=2))
    tmp.replace(path)
    return path
