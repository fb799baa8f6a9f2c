"""Headless matplotlib for every PNG ragkv writes (imported only when plotting)."""

from __future__ import annotations

from pathlib import Path

from ragkv.errors import RagkvError


def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RagkvError("plots need matplotlib: pip install 'ragkv[plots]'") from None

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path
