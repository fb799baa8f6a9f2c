"""Sweeps over one parameter, each saved as JSON + PNG: CacheBlend's recompute ratio (fig. 16), APE's T x S grid
(fig. 8, also the search behind `ragkv calibrate`) and accuracy vs number of passages (Lost in the Middle)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ragkv.engine.options import FusionOptions
from ragkv.errors import RagkvError
from ragkv.eval.harness import results_config, run_eval
from ragkv.eval.modes import ape_key, blend_key, engine_defaults, resolve_modes
from ragkv.eval.results import ResultsFile
from ragkv.eval.summary import summarize

BLEND_RATIOS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
APE_GRID = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
PASSAGE_COUNTS = (1, 3, 5, 10)


@dataclass
class SweepRun:
    """Where a sweep keeps its resumable records and puts its JSON + PNG."""
    engine: object
    out_dir: Path
    results_dir: Path | None         # None: records kept in memory only (tests)
    label: str                       # data set label, part of file names
    dataset: dict                    # data set description for the results config
    max_new_tokens: int = 32
    base: FusionOptions = field(default_factory=lambda: FusionOptions(mode="full"))
    overwrite: bool = False
    progress: bool = True

    def results(self, kind: str, dataset: dict | None = None) -> ResultsFile | None:
        if self.results_dir is None:
            return None
        name = f"sweep-{kind}-{self.label}-{self.engine.model_name}.jsonl"
        config = results_config(self.engine, {**(dataset or self.dataset), "sweep": kind}, self.max_new_tokens)
        return ResultsFile(Path(self.results_dir) / name, config, self.overwrite)

    def evaluate(self, examples, keys: list[str], kind: str, dataset: dict | None = None) -> tuple[dict, dict]:
        e = self.engine
        modes = resolve_modes(keys, self.base, engine_defaults(e))
        run = run_eval(e, examples, modes, self.results(kind, dataset), max_new_tokens=self.max_new_tokens,
                       progress=self.progress, desc=kind)
        if not run["records"]:
            raise RagkvError(f"{kind}: no example fits the model's {e.max_positions} positions; nothing to summarize")
        return summarize(run["records"], keys), run

    def header(self, kind: str, n: int) -> dict:
        e = self.engine
        return {"kind": kind, "dataset": self.label, "n_examples": n, "model": e.model_name,
                "dtype": e.dtype_name, "device": e.model.device.type, "max_new_tokens": self.max_new_tokens}

    def save(self, name: str, obj: dict) -> Path:
        path = Path(self.out_dir) / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(obj, indent=2) + "\n")
        return path


def _task_metric(examples) -> str:
    return {"f1": "f1", "accuracy": "accuracy", "rouge_l": "rouge_l"}.get(examples[0].metric, "accuracy")


def blend_ratio_sweep(sw: SweepRun, examples, ratios=BLEND_RATIOS) -> dict:
    """Quality and TTFT of `blend` against its recompute ratio r (CacheBlend fig. 16); r=0 is `reuse`, r=1 `full`."""
    from ragkv.bench.plots import plot_panels

    keys = ["full"] + [blend_key(r) for r in ratios]
    summary, run = sw.evaluate(examples, keys, "blend-ratio")
    metric = _task_metric(examples)
    rows = [{"ratio": r, **summary[blend_key(r)]} for r in ratios if blend_key(r) in summary]
    full = summary.get("full", {})
    out = {**sw.header("blend-ratio", len(examples) - len(run["skipped"])), "metric": metric,
           "blend_options": {k: v for k, v in sw.base.__dict__.items() if k in ("check_layers", "deviation",
                                                                                 "gradual", "sink_tokens")},
           "full": full, "rows": rows}
    sw.save(f"sweep-blend-ratio-{sw.label}", out)
    x = [r["ratio"] for r in rows]
    plot_panels(Path(sw.out_dir) / f"sweep-blend-ratio-{sw.label}.png", x, [
        ("first-token KL to full", {"mean": [r["first_token_kl"] for r in rows],
                                    "median": [r["first_token_kl_median"] for r in rows]}),
        ("agreement with full / task score", {"top-1": [r["top1_agreement"] for r in rows],
                                              "greedy 32 tok": [r.get("greedy_agreement") for r in rows],
                                              metric: [r.get(metric) for r in rows]}),
        ("TTFT ms (blocks cached)", {"blend": [r["ttft_ms"] for r in rows]}),
    ], "recompute ratio r", f"blend ratio sweep, {sw.label} (n={out['n_examples']}, {out['model']} {out['dtype']})",
        hlines={1: {f"full {metric}": full[metric]} if metric in full else {},
                2: {"full": full["ttft_ms"]} if full else {}})
    return out


def ape_grid_sweep(sw: SweepRun, examples, temperatures=APE_GRID, scales=APE_GRID, kind: str = "ape-grid",
                   name: str | None = None, objective: str = "kl") -> dict:
    """Mean first-token KL to `full` (and the task score when generating) over APE's T x S grid (APE fig. 8).
    "best" is the lowest KL, or with `objective="score"` the best task score (ties: the lower KL)."""
    from ragkv.bench.plots import plot_heatmap

    if objective not in ("kl", "score"):
        raise ValueError(f"objective must be kl or score, got {objective!r}")
    if objective == "score" and not sw.max_new_tokens:
        raise ValueError("choosing by task score needs generated answers (max_new_tokens > 0)")
    keys = [ape_key(t, s) for t in temperatures for s in scales]
    summary, run = sw.evaluate(examples, keys, kind)
    grid = lambda k: [[summary[ape_key(t, s)].get(k) for s in scales] for t in temperatures]  # noqa: E731
    kl = grid("first_token_kl")
    metric = _task_metric(examples)
    rank = (lambda ts: summary[ape_key(*ts)]["first_token_kl"]) if objective == "kl" else (
        lambda ts: (-(summary[ape_key(*ts)].get(metric) or 0.0), summary[ape_key(*ts)]["first_token_kl"]))
    best = min(((t, s) for t in temperatures for s in scales), key=rank)
    bi, bj = temperatures.index(best[0]), scales.index(best[1])
    out = {**sw.header(kind, len(examples) - len(run["skipped"])), "temperatures": list(temperatures),
           "scales": list(scales), "first_token_kl": kl, "first_token_kl_median": grid("first_token_kl_median"),
           "top1_agreement": grid("top1_agreement"),
           "objective": objective, "best": {"temperature": best[0], "scale": best[1], **summary[ape_key(*best)]}}
    if sw.max_new_tokens:
        out["metric"], out[metric] = metric, grid(metric)
        out["greedy_agreement"] = grid("greedy_agreement")
    for t, s, tag in ((0.9, 0.9, "default"), (1.0, 1.0, "plain")):
        if ape_key(t, s) in summary:
            out[tag] = {"temperature": t, "scale": s, **summary[ape_key(t, s)]}
    name = name or f"sweep-ape-grid-{sw.label}"
    sw.save(name, out)
    plot_heatmap(Path(sw.out_dir) / f"{name}.png", list(temperatures), list(scales), kl, "temperature T",
                 "scale S", f"APE mean first-token KL to full, {sw.label} (n={out['n_examples']})", mark=(bi, bj))
    return out


def passages_sweep(sw: SweepRun, load: Callable[[int], list], counts=PASSAGE_COUNTS,
                   keys: tuple[str, ...] = ("full", "reuse", "ape", "blend")) -> dict:
    """Task score per mode against the number of passages; `load(k)` gives the examples with k passages."""
    from ragkv.bench.plots import plot_panels

    rows, metric = [], None
    for k in counts:
        examples = load(k)
        metric = metric or _task_metric(examples)
        summary, run = sw.evaluate(examples, list(keys), f"passages-k{k}", {**sw.dataset, "num_passages": k})
        rows.append({"num_passages": k, "n_examples": len(examples) - len(run["skipped"]), "modes": summary})
    out = {**sw.header("passages", rows[0]["n_examples"] if rows else 0), "metric": metric, "rows": rows}
    sw.save(f"sweep-passages-{sw.label}", out)
    x = [r["num_passages"] for r in rows]
    series = lambda k: {m: [r["modes"].get(m, {}).get(k) for r in rows] for m in keys}  # noqa: E731
    plot_panels(Path(sw.out_dir) / f"sweep-passages-{sw.label}.png", x, [
        (metric, series(metric)), ("first-token KL to full", series("first_token_kl")),
        ("TTFT ms", series("ttft_ms"))], "passages", f"{metric} vs number of passages, {sw.label}")
    return out


def calibrate_ape(sw: SweepRun, examples, temperatures=APE_GRID, scales=APE_GRID, objective: str = "kl") -> dict:
    """APE auto-calibration on held-out data: the (T, S) with the best task score (`objective="score"`, as the
    APE paper tunes them; needs generated answers) or the lowest mean first-token KL to `full` (`"kl"`). Saved
    per model fingerprint and task, so that `ape` uses it by default (for that task in `ragkv eval`)."""
    from ragkv.engine.fusion.calibration import save_ape_params

    grid = ape_grid_sweep(sw, examples, temperatures, scales, kind="calibrate", name=f"calibration-{sw.label}",
                          objective=objective)
    best, metric = grid["best"], grid.get("metric")
    path = save_ape_params(sw.engine.fingerprint, best["temperature"], best["scale"],
                           task=examples[0].task if examples else None, objective=objective,
                           kl=best["first_token_kl"], kl_median=best["first_token_kl_median"],
                           top1_agreement=best["top1_agreement"], n=grid["n_examples"], data=sw.label,
                           metric=metric, score=best.get(metric) if metric else None,
                           default_score=grid.get("default", {}).get(metric) if metric else None,
                           temperatures=list(temperatures), scales=list(scales),
                           default_kl=grid.get("default", {}).get("first_token_kl"))
    grid["saved_to"] = str(path)
    sw.save(f"calibration-{sw.label}", grid)
    return grid
