"""PNG plots of the benchmarks: sweeps, the quality table, TTFT curves (matplotlib Agg, imported only to plot)."""

from __future__ import annotations

from pathlib import Path

from ragkv.figures import pyplot as _plt
from ragkv.figures import save_figure as _save


def plot_panels(path: Path, x: list[float], panels: list[tuple[str, dict[str, list]]], xlabel: str, title: str,
                hlines: dict[int, dict[str, float]] | None = None) -> Path:
    """One row of panels, each (ylabel, {series: ys}); `hlines[i]` adds dashed reference lines to panel i."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.0))
    axes = [axes] if len(panels) == 1 else list(axes)
    for i, (ax, (ylabel, series)) in enumerate(zip(axes, panels)):
        for name, ys in series.items():
            pts = [(a, b) for a, b in zip(x, ys) if b is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        for name, y in (hlines or {}).get(i, {}).items():
            ax.axhline(y, linestyle="--", color="gray", label=name)
        ax.set_xlabel(xlabel), ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, path)


def plot_heatmap(path: Path, rows: list[float], cols: list[float], values: list[list[float]], row_label: str,
                 col_label: str, title: str, mark: tuple[int, int] | None = None, fmt: str = "{:.3f}") -> Path:
    """A grid of values (rows x cols) with each cell printed; `mark` outlines one cell (the chosen one)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(1.0 * len(cols) + 2.5, 0.8 * len(rows) + 1.8))
    im = ax.imshow(values, cmap="viridis_r", aspect="auto")
    ax.set_xticks(range(len(cols)), [f"{c:g}" for c in cols])
    ax.set_yticks(range(len(rows)), [f"{r:g}" for r in rows])
    ax.set_xlabel(col_label), ax.set_ylabel(row_label), ax.set_title(title)
    hi = max(max(r) for r in values)
    for i, row in enumerate(values):
        for j, v in enumerate(row):
            ax.text(j, i, fmt.format(v), ha="center", va="center", fontsize=7,
                    color="white" if v > hi * 0.55 else "black")
    if mark is not None:
        ax.add_patch(plt.Rectangle((mark[1] - 0.5, mark[0] - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2))
    fig.colorbar(im, ax=ax)
    return _save(fig, path)


def plot_grouped_bars(path: Path, groups: list[str], series: dict[str, list[float | None]], ylabel: str,
                      title: str, logy: bool = False) -> Path:
    """Bars per group (e.g. data set) and series (e.g. mode)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(groups) * max(1, len(series)) / 3), 4.2))
    width = 0.8 / max(1, len(series))
    for k, (name, ys) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(groups))]
        ax.bar(xs, [y if y is not None else 0 for y in ys], width, label=name)
    ax.set_xticks(range(len(groups)), groups)
    if logy:
        ax.set_yscale("symlog", linthresh=1e-3)
    ax.set_ylabel(ylabel), ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    return _save(fig, path)


def plot_lines(path: Path, series: dict[str, list[tuple[float, float]]], xlabel: str, ylabel: str, title: str,
               logy: bool = True) -> Path:
    fig, ax = _plt().subplots(figsize=(7, 4.5))
    for name, pts in series.items():
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel), ax.set_ylabel(ylabel), ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_position_curves(path: Path, panels: dict[str, dict[str, list[tuple]]], xlabel: str, ylabel: str,
                         title: str) -> Path:
    """One panel per title, one line per series through points (x, y, lo, hi) with (lo, hi) drawn as error bars;
    series are shifted sideways a little so their bars do not overlap. Same y range in every panel."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), sharey=True, squeeze=False)
    for ax, (name, series) in zip(axes[0], panels.items()):
        xs_all = sorted({p[0] for pts in series.values() for p in pts})
        span = (max(xs_all) - min(xs_all)) if len(xs_all) > 1 else 1.0
        for k, (label, pts) in enumerate(series.items()):
            pts = [p for p in pts if p[1] is not None]
            if not pts:
                continue
            dx = (k - (len(series) - 1) / 2) * 0.025 * span
            xs = [p[0] + dx for p in pts]
            ys = [p[1] for p in pts]
            err = [[y - (p[2] if p[2] is not None else y) for y, p in zip(ys, pts)],
                   [(p[3] if p[3] is not None else y) - y for y, p in zip(ys, pts)]]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=label)
        ax.set_xticks(xs_all)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel(ylabel)
    fig.suptitle(title)
    return _save(fig, path)


def plot_work_tradeoff(path: Path, models: dict[str, dict], metric: str) -> Path:
    """Two panels, one point per mode and model: x = work (recompute_vs_full), y = the paired difference of
    `metric` to full with its 95% interval (left) and the mean first-token KL to full (right)."""
    plt = _plt()
    fig, (acc, kl) = plt.subplots(1, 2, figsize=(11, 4.4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    modes = list(dict.fromkeys(m for v in models.values() for m in v["modes"]))
    for k, (model, v) in enumerate(models.items()):
        marker = "osD^v"[k % 5]  # one marker per model, one colour per mode in both panels
        for mode, s in v["modes"].items():
            d, ci = s.get(f"{metric}_vs_full"), s.get(f"{metric}_vs_full_ci")
            if s.get("work") is None or d is None:  # the reference itself has no difference to draw
                continue
            style = dict(marker=marker, color=colors[modes.index(mode) % len(colors)],
                         label=f"{mode} ({model})" if len(models) > 1 else mode)
            acc.errorbar([s["work"]], [d], yerr=[[d - ci[0]], [ci[1] - d]], capsize=3, **style)
            if s.get("kl") is not None:
                kl.plot([s["work"]], [s["kl"]], linestyle="", **style)
    acc.axhline(0, linestyle="--", color="gray")
    acc.set_ylabel(f"{metric} minus full (95% interval)")
    kl.set_ylabel("mean first-token KL to full")
    for ax in (acc, kl):
        ax.set_xlabel("work: recompute_vs_full (1 = a full prefill)")
        ax.grid(True, alpha=0.3)
    acc.legend(fontsize=7)
    n = ", ".join(f"{m}: n={v['n']}" for m, v in models.items())
    fig.suptitle(f"What each mode keeps for the work it does ({n})")
    return _save(fig, path)
