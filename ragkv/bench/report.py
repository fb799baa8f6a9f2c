"""`ragkv report`: one markdown page (plus PNGs and a small summary JSON) from the latest runs: the quality table
per mode and data set (eval JSONL files), the TTFT/FLOPs table of `ragkv bench ttft`, APE calibration and sweeps."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from ragkv.eval.results import read_runs
from ragkv.bench.common import markdown_table
from ragkv.engine.modes import is_reference
from ragkv.eval.summary import summarize, table_rows

NOTES = "notes.md"  # hand-written analysis beside the page, included verbatim (the page itself is generated)


def _label(config: dict) -> str:
    name = config.get("dataset") or Path(str(config.get("data_file") or "data")).stem
    if config.get("num_passages"):
        name += f"-k{config['num_passages']}"
    name += f"-g{config['gold_position']}" if config.get("gold_position") is not None else ""
    return name + (f" ({config['passage_order']})" if config.get("passage_order") else "")


def _params_line(summary: dict) -> str:
    parts = [f"`{m}`: " + ", ".join(f"{k}={v}" for k, v in s["params"].items())
             for m, s in summary.items() if s.get("params")]
    return ("Mode parameters: " + "; ".join(parts) + ".") if parts else ""


def _command(config: dict, summary: dict, n: int) -> str:
    src = (f"--dataset {config['dataset']}" if config.get("dataset")
           else f"--data-file {config.get('data_file')} --format {config.get('format')}")
    if config.get("num_passages"):
        src += f" --num-passages {config['num_passages']}"
    if config.get("gold_position") is not None:
        src += f" --gold-position {config['gold_position']}"
    if config.get("passage_order"):
        src += f" --passage-order {config['passage_order']}"
    env = f"OMP_NUM_THREADS={config['threads']} " if config.get("threads") else ""
    return (f"{env}ragkv eval {src} --modes {','.join(summary)} --limit {n} --max-new-tokens {config['max_new_tokens']} "
            f"--model {config['model']} --dtype {config['dtype']} --device {config['device']}")


def load_eval(paths: list[Path]) -> list[dict]:
    """One entry per run; the shards of a run (`ragkv eval --shard`) merge into one."""
    out = []
    for files, config, records in read_runs(paths):
        if not records:
            continue
        summary = summarize(records)
        n = len({r["example_id"] for r in records})
        cpus = sorted({r["cpu"] for r in records if r.get("cpu")})  # none in records written before they said
        out.append({"path": ", ".join(map(str, files)), "label": _label(config), "config": config,
                    "n_examples": n, "summary": summary, "cpus": cpus})
    labels = [e["label"] for e in out]
    for e in out:  # same data set from several models / dtypes: tell them apart
        if labels.count(e["label"]) > 1:
            e["label"] += f" ({e['config']['model']}, {e['config']['dtype']})"
    return out


def eval_tables(evals: list[dict], level: str = "###") -> list[str]:
    """Markdown per results file: caption, the table (accuracy with its 95% bootstrap interval and the paired
    difference to `full`), the mode parameters and the command that produced it."""
    lines = []
    for e in evals:
        c = e["config"]
        cpus = "".join(f"{cpu}, " for cpu in e.get("cpus", []))
        lines += [f"{level} {e['label']}", "",
                  f"{e['n_examples']} examples, {c['model']} {c['dtype']} on {c['device']} "
                  f"({cpus}{c.get('threads', '?')} threads), greedy, "
                  f"{c['max_new_tokens']} new tokens max. Results: `{e['path']}`.", "",
                  markdown_table(*table_rows(e["summary"])), ""]
        params = _params_line(e["summary"])
        lines += ([params, ""] if params else []) + ["```", _command(c, e["summary"], e["n_examples"]), "```", ""]
    return lines


def lost_in_the_middle(paths: list[Path], png: Path | None = None, metric: str = "accuracy") -> dict:
    """Accuracy against the gold passage's position, per mode and model, from results files of one data set run
    at several `--gold-position`s (Liu et al. 2023, figure 5, here with the fusion modes side by side).

    Per model, only the examples that every mode has finished at every position count, so each point of one
    model stands on the same questions. Returns {"models": {model: {"n", "positions", "modes": {mode: [summary
    per position]}}}, "markdown": table}; writes the figure (one panel per model, 95% intervals) to `png`.
    """
    from ragkv.eval.summary import summarize

    runs: dict[str, dict[int, tuple[dict, list[dict]]]] = {}
    for files, config, records in read_runs(paths):  # the shards of one run merge
        path = ", ".join(map(str, files))
        if config.get("gold_position") is None:
            raise ValueError(f"{path}: not a run with a fixed --gold-position")
        model = f"{config['model']} ({config['dtype']})"
        if config["gold_position"] in runs.setdefault(model, {}):
            raise ValueError(f"{path}: a second run for {model} at gold position {config['gold_position']}")
        runs[model][config["gold_position"]] = (config, records)
    out: dict = {"metric": metric, "models": {}}
    rows = []
    for model, by_pos in runs.items():
        positions = sorted(by_pos)
        modes = list(dict.fromkeys(r["mode_key"] for _, recs in by_pos.values() for r in recs))
        done = None
        for _, recs in by_pos.values():
            have: dict[str, set] = {}
            for r in recs:
                have.setdefault(r["example_id"], set()).add(r["mode_key"])
            ids = {ex for ex, ms in have.items() if set(modes) <= ms}
            done = ids if done is None else done & ids
        done = done or set()
        per_mode = {m: [] for m in modes}
        for pos in positions:
            summary = summarize([r for r in by_pos[pos][1] if r["example_id"] in done], modes)
            for m in modes:
                per_mode[m].append(summary.get(m, {}))
        pooled = _pooled_over_positions([r for _, recs in by_pos.values() for r in recs if r["example_id"] in done],
                                        modes, metric)
        out["models"][model] = {"n": len(done), "positions": positions, "modes": per_mode, "pooled": pooled}
        for m in modes:
            cells = [_cell(s, metric) for s in per_mode[m]] + [_cell(pooled.get(m, {}), metric)]
            rows.append([model, str(len(done)), m] + cells)
    all_pos = sorted({p for m in out["models"].values() for p in m["positions"]})
    if all(m["positions"] == all_pos for m in out["models"].values()):
        out["markdown"] = markdown_table(["model", "n", "mode"] + [f"gold at {p}" for p in all_pos]
                                         + ["all positions"], rows)
    else:
        out["markdown"] = markdown_table(["model", "n", "mode", "positions: accuracy", "all positions"],
                                         [r[:3] + ["; ".join(r[3:-1]), r[-1]] for r in rows])
    if png is not None and out["models"]:
        from ragkv.bench.plots import plot_position_curves

        panels = {f"{model}, n={v['n']}": {m: [(p, s.get(metric), *(s.get(f"{metric}_ci") or (None, None)))
                                                for p, s in zip(v["positions"], ss)] for m, ss in v["modes"].items()}
                  for model, v in out["models"].items()}
        plot_position_curves(png, panels, "position of the gold passage (0 = first of 10)",
                             f"{metric} (95% bootstrap interval)", "NQ-open, 10 passages: accuracy vs gold position")
        out["png"] = str(png)
    return out


def quality_vs_work(paths: list[Path], png: Path | None = None, metric: str = "accuracy",
                    modes: list[str] | None = None) -> dict:
    """Per mode and model: the work it did (mean `recompute_vs_full`) against what it kept (the paired difference of
    `metric` to `full`, pooled over every run given, e.g. the gold positions of NQ-10, with its 95% interval, and
    the mean first-token KL to full), on the questions every mode finished (only `modes` and `full`, when given: a
    mode that ran on some runs only would otherwise shrink the comparison to those). The comparison at
    equal work.
    Returns {"models": {model: {"n", "modes": {mode: {...}}}}, "markdown"}; writes a two-panel figure to `png`."""
    by_model: dict[str, list[dict]] = {}
    for files, config, records in read_runs(paths):
        by_model.setdefault(f"{config['model']} ({config['dtype']})", []).extend(
            # a (position, question) pair must be finished by every mode; the interval resamples questions, each
            # with all its positions together (they share the question and its distractors)
            {**r, "example_id": f"{config.get('gold_position')}:{r['example_id']}", "question": r["example_id"]}
            for r in records
            if modes is None or r["mode_key"] in modes or is_reference(r["mode_key"]))
    out: dict = {"metric": metric, "models": {}}
    rows = []
    for model, records in by_model.items():
        modes = list(dict.fromkeys(r["mode_key"] for r in records))
        have: dict[str, set] = {}
        for r in records:
            have.setdefault(r["example_id"], set()).add(r["mode_key"])
        done = {ex for ex, ms in have.items() if set(modes) <= ms}
        kept = [r for r in records if r["example_id"] in done]
        questions = len({r.get("question", r["example_id"]) for r in kept})  # distinct: the bootstrap's clusters
        pooled = _pooled_over_positions(kept, modes, metric)
        per_mode = {}
        for m in modes:
            rs = [r for r in kept if r["mode_key"] == m]
            kl = [r["fidelity"]["first_token_kl"] for r in rs if "first_token_kl" in r.get("fidelity", {})]
            per_mode[m] = {"work": sum(r["recompute_vs_full"] for r in rs) / len(rs) if rs else None,
                           "kl": sum(kl) / len(kl) if kl else None, **pooled.get(m, {})}
            v = per_mode[m]
            rows.append([model, f"{len(done)} ({questions} q)", m, "-" if v["work"] is None else f"{v['work']:.3f}",
                         _cell(v, metric), "-" if v["kl"] is None else f"{v['kl']:.3f}"])
        out["models"][model] = {"n": len(done), "questions": questions, "modes": per_mode}
    out["markdown"] = markdown_table(["model", "n (distinct questions)", "mode", "recompute_vs_full", f"{metric}; minus full",
                                      "first-token KL"], rows)
    if png is not None and out["models"]:
        from ragkv.bench.plots import plot_work_tradeoff

        plot_work_tradeoff(png, out["models"], metric)
        out["png"] = str(png)
    return out


def _cell(s: dict, metric: str) -> str:
    """'0.400 [0.300, 0.500]; -0.050 [-0.100, +0.000]': the metric and, for a mode other than full, its paired
    difference to full, each with its 95% interval."""
    v, ci, d, dci = s.get(metric), s.get(f"{metric}_ci"), s.get(f"{metric}_vs_full"), s.get(f"{metric}_vs_full_ci")
    cell = "-" if v is None else f"{v:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"
    return cell + (f"; {d:+.3f} [{dci[0]:+.3f}, {dci[1]:+.3f}]" if d is not None else "")


def _pooled_over_positions(records: list[dict], modes: list[str], metric: str) -> dict[str, dict]:
    """Per mode: the metric averaged over every position, its interval resampling questions (each question keeps
    all its positions together, since they share the question and the distractors), and the same for the paired
    difference to `full`."""
    from ragkv.eval.summary import bootstrap_ci

    per_q: dict[str, dict[str, list[float]]] = {}
    for r in records:
        if metric in r.get("scores", {}):
            question = r.get("question", r["example_id"])  # the cluster: one question, all its positions
            per_q.setdefault(r["mode_key"], {}).setdefault(question, []).append(r["scores"][metric])
    out = {}
    full = {q: sum(v) / len(v) for q, v in per_q.get("full", {}).items()}
    for m in modes:
        vals = {q: sum(v) / len(v) for q, v in per_q.get(m, {}).items()}
        if not vals:
            continue
        xs = list(vals.values())
        s = {metric: round(sum(xs) / len(xs), 6), f"{metric}_ci": list(bootstrap_ci(xs))}
        diffs = [v - full[q] for q, v in vals.items() if q in full]
        if not is_reference(m) and diffs:
            s[f"{metric}_vs_full"] = round(sum(diffs) / len(diffs), 6)
            s[f"{metric}_vs_full_ci"] = list(bootstrap_ci(diffs))
        out[m] = s
    return out


def _quality_section(evals: list[dict], out_dir: Path) -> list[str]:
    from ragkv.bench.plots import plot_grouped_bars

    lines = ["## Quality per mode and data set", ""]
    if not evals:
        return lines + ["No evaluation results found (run `ragkv eval`, results go to runs/).", ""]
    lines += ["Columns: task metrics (accuracy = a normalized gold answer appears in the output, F1 = SQuAD token "
              "F1 of the first output line, Rouge-L for summaries); fidelity to `full` on the same example: "
              "first-token KL(full || mode) mean and median, top-1 = same first token, greedy= = the first 32 "
              "greedy tokens identical, prefix len = leading tokens shared; TTFT with the example's blocks already "
              "cached (mean, and relative to `full` over the same examples); encode ms = one-time cost of encoding "
              "the example's blocks (not part of TTFT); reused / recomputed tokens at prefill.", ""]
    lines += eval_tables(evals)
    modes = list(dict.fromkeys(m for e in evals for m in e["summary"] if not is_reference(m)))
    groups = [e["label"] for e in evals]
    for key, ylabel, name in (("first_token_kl", "mean first-token KL to full", "quality-kl.png"),
                              ("greedy_agreement", "greedy output = full (32 tokens)", "quality-greedy.png")):
        series = {m: [e["summary"].get(m, {}).get(key) for e in evals] for m in modes}
        plot_grouped_bars(out_dir / name, groups, series, ylabel, f"{ylabel}, per mode and data set")
        lines += [f"![{key}]({name})", ""]
    return lines


def _bench_section(bench: Path | None, out_dir: Path) -> list[str]:
    lines = ["## TTFT and FLOPs to first token (`ragkv bench ttft`)", ""]
    if bench is None or not bench.is_file():
        where = f" at `{bench}`" if bench is not None else ""
        return lines + [f"No `ragkv bench ttft` output found{where}; run `ragkv bench ttft --output-dir bench_out` "
                        "and render again.", ""]
    from ragkv.bench.ttft import render_ttft_markdown

    result = json.loads(bench.read_text())
    lines += [f"From `{bench}`.", "", render_ttft_markdown(result)]
    png = bench.with_suffix(".png")
    if png.is_file():
        if png.resolve() != (out_dir / "ttft.png").resolve():  # the bench may already write into out_dir
            shutil.copyfile(png, out_dir / "ttft.png")
        lines += ["![TTFT vs context](ttft.png)", ""]
    return lines


def _calibration_section(out_dir: Path) -> list[str]:
    files = sorted(out_dir.glob("calibration-*.json"))
    if not files:
        return []
    lines = ["## APE calibration (`ragkv calibrate`)", ""]
    for f in files:
        g = json.loads(f.read_text())
        b = g["best"]
        lines += [f"Calibration split `{g['dataset']}` ({g['n_examples']} examples, first-token KL to `full`, "
                  f"grid T, S in {g['temperatures']}): chosen **T={b['temperature']:g}, S={b['scale']:g}**.", "",
                  "| T, S | KL mean | KL median | top-1 |", "|---|---|---|---|"]
        for tag, row in (("calibrated", b), ("default", g.get("default")), ("plain (no APE scaling)", g.get("plain"))):
            if row:
                lines.append(f"| {tag}: {row['temperature']:g}, {row['scale']:g} | {row['first_token_kl']:.4f} | "
                             f"{row['first_token_kl_median']:.4f} | {row['top1_agreement']:.2f} |")
        lines += ["", f"![calibration grid]({f.with_suffix('.png').name})", ""]
    return lines


def _sweep_section(out_dir: Path) -> list[str]:
    lines = []
    for f in sorted(out_dir.glob("sweep-*.json")):
        s = json.loads(f.read_text())
        png = f.with_suffix(".png").name
        title = {"blend-ratio": "CacheBlend recompute ratio", "ape-grid": "APE T x S grid",
                 "passages": "Number of passages"}.get(s["kind"], s["kind"])
        lines += [f"## Sweep: {title} ({s['dataset']}, n={s['n_examples']})", ""]
        if s["kind"] == "blend-ratio":
            m = s["metric"]
            lines += [f"| r | KL mean | KL median | top-1 | greedy= | {m} | TTFT ms | vs full | recomputed |",
                      "|---|---|---|---|---|---|---|---|---|"]
            full = s.get("full") or {}
            if full:
                lines.append(f"| full | 0 | 0 | 1.00 | 1.00 | {full.get(m, 0):.3f} | {full['ttft_ms']:.0f} | 100% | "
                             f"{full['recomputed_tokens']:.0f} |")
            for r in s["rows"]:
                lines.append(f"| {r['ratio']:g} | {r['first_token_kl']:.4f} | {r['first_token_kl_median']:.4f} | "
                             f"{r['top1_agreement']:.2f} | {r.get('greedy_agreement', 0):.2f} | {r.get(m, 0):.3f} | "
                             f"{r['ttft_ms']:.0f} | {100 * r.get('ttft_vs_full', 0):.1f}% | "
                             f"{r['recomputed_tokens']:.0f} |")
        elif s["kind"] == "ape-grid":
            b = s["best"]
            lines.append(f"Lowest mean KL at T={b['temperature']:g}, S={b['scale']:g}: {b['first_token_kl']:.4f}.")
        elif s["kind"] == "passages":
            modes = list(s["rows"][0]["modes"]) if s["rows"] else []
            lines += ["| passages | " + " | ".join(f"{m} {s['metric']}" for m in modes) + " |",
                      "|---|" + "---|" * len(modes)]
            for r in s["rows"]:
                lines.append(f"| {r['num_passages']} | " + " | ".join(
                    f"{r['modes'][m].get(s['metric'], 0):.3f}" for m in modes) + " |")
        lines += ["", f"![{s['kind']}]({png})", ""]
    return lines


def render_report(eval_paths: list[Path], bench: Path | None, out_dir: Path) -> Path:
    """Write `out_dir/README.md` and `out_dir/summary.json`; returns the README path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    evals = load_eval(eval_paths)
    lines = ["# ragkv results", "",
             f"_Generated by `ragkv report` on {time.strftime('%Y-%m-%d')} from the runs listed below; "
             f"the analysis is `{NOTES}` in this folder, included as is. Edit that, not this page._", ""]
    notes = out_dir / NOTES
    if notes.is_file():
        lines += [notes.read_text().rstrip(), ""]
    lines += _quality_section(evals, out_dir)
    lines += _calibration_section(out_dir)
    lines += _sweep_section(out_dir)
    lines += _bench_section(bench, out_dir)
    (out_dir / "summary.json").write_text(json.dumps(
        {"datasets": {e["label"]: {k: e[k] for k in ("path", "config", "n_examples", "summary", "cpus")} for e in evals},
         "bench": str(bench) if bench is not None and bench.is_file() else None}, indent=1) + "\n")
    path = out_dir / "README.md"
    path.write_text("\n".join(lines).rstrip() + "\n")
    return path
