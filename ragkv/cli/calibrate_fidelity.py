"""`ragkv calibrate --target fidelity --records FILES [--test-records FILES]`: fit the per-reply fidelity estimate
(eval/fidelity_fit.py) on eval records of held-out data, report it out of sample (with a reliability diagram), and
save it for the records' model: its replies then state `calibration: "fitted"`, `basis: "per-reply"`."""

from __future__ import annotations

import json
from pathlib import Path

from ragkv.cli.common import print_json, say
from ragkv.errors import RagkvError


def _records(spec: str | None, flag: str) -> tuple[list[dict], list[str], set[tuple[str, str]]]:
    """Records of the files, the files' descriptions (data set, dtype, name) and their (model, dtype)s."""
    from ragkv.eval.results import read_results

    rows, names, models = [], [], set()
    for name in [s for s in (spec or "").split(",") if s.strip()]:
        path = Path(name.strip())
        if not path.exists():
            raise RagkvError(f"{flag} {path}: no such file")
        config, recs = read_results(path)
        rows += recs
        names.append(f"{config.get('dataset') or 'data file'} {config.get('dtype')} ({path.name})")
        models.add((str(config.get("model")), str(config.get("dtype"))))
    return rows, names, models


def _names(spec: str | None) -> list[str]:
    return [s.strip() for s in (spec or "").split(",") if s.strip()]


def run_fidelity_calibration(args) -> int:
    from ragkv.engine.measure.estimates import FidelityFits, fidelity_fit_path
    from ragkv.eval import fidelity_fit

    rows, names, models = _records(args.records, "--records")
    if not rows:
        raise RagkvError("--target fidelity fits eval records: pass --records FILE[,FILE] (ragkv eval runs of full and "
                         "the approximate modes on held-out data, e.g. nq-distractors-heldout)")
    if len(models) != 1:
        raise RagkvError(f"--records mix models or dtypes ({', '.join(' '.join(m) for m in sorted(models))}): fit one "
                         "model in one dtype at a time (a fit holds for the dtype it was fitted on)")
    model, dtype = models.pop()
    test, test_names, test_models = _records(args.test_records, "--test-records")
    if test and test_models != {(model, dtype)}:
        raise RagkvError(f"--test-records are of {', '.join(' '.join(m) for m in sorted(test_models))}, not "
                         f"{model} {dtype}")
    fits = fidelity_fit.fit(rows)
    if args.keys:  # only these keys are saved (the others keep what replies state without them)
        wanted = [k.strip() for k in args.keys.split(",") if k.strip()]
        unknown = [k for k in wanted if k not in fits]
        if unknown:
            raise RagkvError(f"--keys {', '.join(unknown)}: not fitted from these records (fitted: "
                             f"{', '.join(sorted(fits)) or 'none'})")
        fits = {k: fits[k] for k in wanted}
    if not fits:
        raise RagkvError(f"no (mode, selection) has {fidelity_fit.MIN_RECORDS} usable records (approximate answers "
                         "with a fidelity to full and answer_confidence: records written by this version's eval)")
    save_to = Path(args.save_to) if args.save_to else fidelity_fit_path(model)
    earlier = _earlier_fits(save_to, model, dtype)  # keys these records do not fit (e.g. the exact weights' beside w8a8's)
    base = FidelityFits(earlier[1], earlier[0]) if earlier else None
    judged = fidelity_fit.held_out(rows, test or None, base=base)
    unjudged = []  # a key with no out-of-sample figure is not saved: nothing says its estimates hold
    for k in list(fits):
        figures = fidelity_fit.held_out_figures(judged, k)
        if figures is None:
            unjudged.append(k)
            del fits[k]
        else:
            fits[k]["held_out"] = figures
    if not fits:
        raise RagkvError(f"no key could be judged out of sample ({', '.join(unjudged)}): two folds need "
                         f"{2 * fidelity_fit.MIN_RECORDS} records per key, or pass --test-records")
    desc = (f"{model}, fitted on {'; '.join(names)}: {sum(f['n'] for f in fits.values())} replies (ragkv calibrate "
            "--target fidelity)")
    kept = {k: {"source": earlier[0], **v} for k, v in earlier[1].items() if k not in fits} if earlier else {}
    files = {"records": _names(args.records), "test_records": _names(args.test_records)}
    doc = fidelity_fit.document(model, dtype, desc, {**kept, **{k: {**v, "source": desc, **files}
                                                                for k, v in fits.items()}})
    save_to.parent.mkdir(parents=True, exist_ok=True)
    save_to.write_text(json.dumps(doc, indent=1) + "\n")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = {"model": model, "dtype": dtype, "saved_to": str(save_to), "fits": {k: v["n"] for k, v in fits.items()},
              "kept": sorted(kept), "not_saved": unjudged,
              "judged_on": ", ".join(test_names) if test else "two folds by question of --records",
              "held_out": judged}
    (out / "fidelity_calibration.json").write_text(json.dumps(result, indent=1))
    plot_reliability(judged, out / "fidelity_reliability.png")
    if args.json:
        print_json(result)
        return 0
    print(render(result))
    if unjudged:
        say(f"not saved, no held-out figure: {', '.join(unjudged)} (none in --test-records, or fewer than "
            f"{2 * fidelity_fit.MIN_RECORDS} records for two folds; replies of these keys state the population estimate)")
    if result["kept"]:
        say(f"kept the earlier fits of {', '.join(result['kept'])} (not in these records)")
    say(f"saved to {save_to}; {model}'s approximate replies now state this per-reply estimate")
    return 0


def _earlier_fits(save_to: Path, model: str, dtype: str) -> tuple[str, dict] | None:
    """(source, fits) of the fit this one is saved over (the file at --save-to, else the one shipped for the model),
    so that a fit of some keys keeps the others: one of w8a8's replies does not drop the exact weights' fits."""
    from ragkv.engine.measure.estimates import FEATURES, shipped_fit_path

    for path in (save_to, shipped_fit_path(model)):
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if doc.get("kind") == "fidelity-fit" and doc.get("model") == model and doc.get("dtype") == dtype \
                and doc.get("features") == list(FEATURES):
            return str(doc.get("source") or path), dict(doc.get("fits") or {})
    return None


def render(result: dict) -> str:
    lines = [f"per-reply fidelity estimate for {result['model']}, judged on {result['judged_on']}", "",
             "| key | n | calibration error (fitted / without) | max bin error | Spearman KL (fitted / without) |",
             "|---|---|---|---|---|"]
    rows = [("pooled", result["held_out"]["pooled"])] + list(result["held_out"]["per_key"].items())
    for key, j in rows:
        f, p = j["fitted"], j["without"]
        lines.append(f"| {key} | {j['n']} | {f['calibration_error']} / {p['calibration_error']} | "
                     f"{f['max_bin_error']} / {p['max_bin_error']} | {f['spearman_kl']} / {p['spearman_kl']} |")
    return "\n".join(lines)


def plot_reliability(judged: dict, path: Path) -> None:
    """Stated expected_top1 against measured agreement per bin, fitted and without the fit, pooled."""
    try:
        from ragkv.figures import pyplot, save_figure
        plt = pyplot()
    except RagkvError:
        return  # no matplotlib: the JSON has the bins
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--")
    for name, style in (("fitted", "o-"), ("without", "s--")):
        bins = judged["pooled"][name]["calibration_bins"]
        ax.plot([b["stated"] for b in bins], [b["measured"] for b in bins], style, label=name)
    ax.set_xlabel("stated expected_top1")
    ax.set_ylabel("measured top-1 agreement with full")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.legend()
    save_figure(fig, path)
