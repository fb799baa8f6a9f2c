"""`ragkv report --paired`: paired differences of a task metric between mode keys, each with its 95% bootstrap
interval (ragkv.eval.summary.bootstrap_ci), on the questions every compared key answered.

One run (a results file, or the shards of one): each key minus `full`, and each key minus the longest other given
key its parameters extend (`blend:sel=query,r=0.15,draft=16` minus `blend:sel=query,r=0.15`). Two runs on the same
questions (another model, another passage order): per key, each run's accuracy and gap to its own `full`, the same
key in the second run minus the first, the second run's gap minus the first's, and each run's first-token KL to its
own `full`. `--vs-work` pools runs instead and sets each mode against its work.
"""

from __future__ import annotations

from pathlib import Path

from ragkv.bench.common import markdown_table
from ragkv.engine.modes import is_reference
from ragkv.eval.results import read_runs
from ragkv.eval.summary import bootstrap_ci

REFERENCE = "full"


def paired_report(paths: list[Path], modes: list[str] | None = None, metric: str = "accuracy") -> dict:
    """Returns {"runs", "n", "rows": [{key, ...}], "markdown"}; raises ValueError on more than two runs, a key no
    run holds, or no question that every compared key answered."""
    runs = read_runs(paths)
    if not 1 <= len(runs) <= 2:
        raise ValueError(f"--paired compares one run or two (got {len(runs)} runs in {len(paths)} files: files of "
                         "one run are its shards)")
    tables = [_by_question(records, metric) for _, _, records in runs]
    keys = [k for k in modes or dict.fromkeys(k for _, k in tables[0]) if not is_reference(k.partition(":")[0])]
    missing = [k for k in keys + [REFERENCE] if not all(any(m == k for _, m in t) for t in tables)]
    if missing:
        raise ValueError(f"no records of {', '.join(missing)} in every run")
    ids = sorted(set.intersection(*({e for e, _ in t} for t in tables)),
                 key=lambda e: (len(e), e))  # numeric ids in numeric order
    ids = [e for e in ids if all((e, k) in t for t in tables for k in keys + [REFERENCE])]
    if not ids:
        raise ValueError("no question has records of every compared key (and full) in every run")
    rows = _one_run(tables[0], keys, ids) if len(tables) == 1 else _two_runs(tables, keys, ids)
    labels = [", ".join(map(str, files)) for files, _, _ in runs]
    return {"metric": metric, "runs": labels, "n": len(ids), "rows": rows,
            "markdown": _markdown(rows, len(tables), metric, len(ids))}


def _by_question(records: list[dict], metric: str) -> dict[tuple[str, str], tuple[float, float | None]]:
    """(example, key) -> (metric, first-token KL to the run's own full)."""
    return {(r["example_id"], r["mode_key"]): (r["scores"][metric], r.get("fidelity", {}).get("first_token_kl"))
            for r in records if metric in r.get("scores", {})}


def _diff(xs: list[float]) -> dict:
    ci = bootstrap_ci(xs)
    return {"mean": round(sum(xs) / len(xs), 6), "ci": list(ci)}


def _mean(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(sum(xs) / len(xs), 6) if xs else None


def _base(key: str, keys: list[str]) -> str | None:
    """The longest other given key that `key` extends by parameters."""
    bases = [b for b in keys if key.startswith(b + ",")]
    return max(bases, key=len) if bases else None


def _one_run(t: dict, keys: list[str], ids: list[str]) -> list[dict]:
    rows = [{"key": REFERENCE, "value": _mean([t[e, REFERENCE][0] for e in ids])}]
    for k in keys:
        row = {"key": k, "value": _mean([t[e, k][0] for e in ids]),
               "minus_full": _diff([t[e, k][0] - t[e, REFERENCE][0] for e in ids]),
               "kl": _mean([t[e, k][1] for e in ids])}
        base = _base(k, keys)
        if base:
            row.update(base=base, minus_base=_diff([t[e, k][0] - t[e, base][0] for e in ids]))
        rows.append(row)
    return rows


def _two_runs(tables: list[dict], keys: list[str], ids: list[str]) -> list[dict]:
    a, b = tables
    rows = []
    for k in [REFERENCE] + keys:
        gap_a = [a[e, k][0] - a[e, REFERENCE][0] for e in ids]
        gap_b = [b[e, k][0] - b[e, REFERENCE][0] for e in ids]
        row = {"key": k, "value_a": _mean([a[e, k][0] for e in ids]), "value_b": _mean([b[e, k][0] for e in ids]),
               "b_minus_a": _diff([b[e, k][0] - a[e, k][0] for e in ids]),
               "kl_a": _mean([a[e, k][1] for e in ids]), "kl_b": _mean([b[e, k][1] for e in ids])}
        if k != REFERENCE:
            row.update(minus_full_a=_diff(gap_a), minus_full_b=_diff(gap_b),
                       gap_b_minus_gap_a=_diff([y - x for x, y in zip(gap_a, gap_b)]))
        rows.append(row)
    return rows


def _pts(d: dict | None) -> str:
    """A difference in points (x100) with its interval: '+6.7 [+1.7, +13.3]'."""
    if d is None:
        return "-"
    lo, hi = d["ci"]
    return f"{100 * d['mean']:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]"


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _markdown(rows: list[dict], n_runs: int, metric: str, n: int) -> str:
    if n_runs == 1:
        head = ["mode", metric, "minus full, points [95% CI]", "minus the key it extends", "first-token KL"]
        body = [[r["key"], _num(r["value"]), _pts(r.get("minus_full")),
                 f"{_pts(r['minus_base'])} ({r['base']})" if r.get("base") else "-", _num(r.get("kl"))]
                for r in rows]
    else:
        head = ["mode", f"{metric} A", f"{metric} B", "A minus full", "B minus full", "B minus A",
                "B's gap minus A's", "KL to own full A / B"]
        body = [[r["key"], _num(r["value_a"]), _num(r["value_b"]), _pts(r.get("minus_full_a")),
                 _pts(r.get("minus_full_b")), _pts(r["b_minus_a"]), _pts(r.get("gap_b_minus_gap_a")),
                 f"{_num(r['kl_a'])} / {_num(r['kl_b'])}"] for r in rows]
    return f"{n} questions, paired\n\n" + markdown_table(head, body)
