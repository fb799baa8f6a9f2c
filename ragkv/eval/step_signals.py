"""Would `auto` pick its escalations better a few decoded tokens in than at the first?

`auto` decides from the first token (its entropy and margin, or the fitted expected KL of engine/measure/estimates.py).
A signal read after k greedy tokens could see the answer wobble where the first token was sure. Eval records keep
the top-2 log-probabilities of an answer's first tokens (`answer_steps`), so candidate signals can be judged on
recorded runs before any engine change: per signal, how well it singles out the answers that differ from `full`'s
(AUC), and the accuracy left after escalating its riskiest share of the answers to `full`'s (what `auto` would
reach at that budget; escalating at random recovers the same share of the gap on average)."""

from __future__ import annotations

import math

from ragkv.engine.modes import is_reference

STEPS = (2, 4, 8)


def _margin(step: list[float]) -> float:
    """p(top 1) - p(top 2) of one step's two log-probabilities (one entry: the only token worth its mass)."""
    p1 = math.exp(step[0])
    return p1 - (math.exp(step[1]) if len(step) > 1 else 0.0)


def signals(rec: dict, fit_kl: float | None = None) -> dict[str, float]:
    """Risk signals of one approximate record, larger = riskier."""
    conf, steps = rec["answer_confidence"], rec.get("answer_steps") or []
    out = {"first_entropy": conf["entropy"], "first_margin": 1 - conf["margin"]}
    if fit_kl is not None:
        out["expected_kl"] = fit_kl
    for k in STEPS:  # an answer that ended before k tokens is judged on the tokens it has
        head = steps[:k] or [[0.0]]
        out[f"margin@{k}"] = 1 - min(_margin(s) for s in head)
        out[f"logprob@{k}"] = -sum(s[0] for s in head) / len(head)
    return out


def auc(risks: list[float], positive: list[bool]) -> float | None:
    """P(a positive's risk > a negative's), ties counted half; None without both classes."""
    pos = [r for r, p in zip(risks, positive) if p]
    neg = [r for r, p in zip(risks, positive) if not p]
    if not pos or not neg:
        return None
    wins = sum((a > b) + 0.5 * (a == b) for a in pos for b in neg)
    return wins / (len(pos) * len(neg))


def accuracy_after(risks: list[float], acc: list[float], full_acc: list[float], share: float) -> float:
    """Mean accuracy when the riskiest `share` of the answers take `full`'s answer instead."""
    n = len(risks)
    escalate = set(sorted(range(n), key=lambda i: -risks[i])[:round(share * n)])
    return sum(full_acc[i] if i in escalate else acc[i] for i in range(n)) / n


def judge(pairs: list[tuple[dict, dict]], fit=None, shares=(0.1, 0.2, 0.3)) -> dict:
    """pairs: (approximate record, `full`'s record of the same example and layout), every record with answer_steps.
    Per signal: AUC for "the answer differs from full's" (prefix agreement < 1) and for "full is right, this is
    not", and the accuracy minus full's after escalating each share."""
    from ragkv.eval.fidelity_fit import features

    fit_kls = [None] * len(pairs)
    if fit is not None:
        for i, (r, _) in enumerate(pairs):
            mf = r.get("mode_fidelity") or {}
            est = fit.predict(r["mode"], mf.get("select"), features(r)[1:])
            fit_kls[i] = est["expected_kl"] if est else None
    sig = [signals(r, k) for (r, _), k in zip(pairs, fit_kls)]
    acc = [r["scores"]["accuracy"] for r, _ in pairs]
    full_acc = [f["scores"]["accuracy"] for _, f in pairs]
    differs = [r["fidelity"].get("prefix_agreement", 1.0) < 1.0 for r, _ in pairs]
    loses = [f > a for a, f in zip(acc, full_acc)]
    n = len(pairs)
    base = {"n": n, "differs": sum(differs), "loses": sum(loses),
            "accuracy_minus_full": (sum(acc) - sum(full_acc)) / n if n else None}
    rows = {}
    for name in (sig[0] if sig else {}):
        risks = [s.get(name) for s in sig]
        if any(r is None for r in risks):
            continue
        rows[name] = {"auc_differs": auc(risks, differs), "auc_loses": auc(risks, loses),
                      "after": {f"{s:g}": accuracy_after(risks, acc, full_acc, s) - sum(full_acc) / n
                                for s in shares}}
    return {**base, "signals": rows}


def pairs_of(records: list[dict], key: str) -> tuple[list[tuple[dict, dict]], int]:
    """(key's record, full's record) per (example, gold position), for the records with answer_steps; and how many
    of the key's records lack them (written before the field existed)."""
    full = {(r["example_id"], r.get("gold_index")): r for r in records if is_reference(r["mode_key"])}
    out, missing = [], 0
    for r in records:
        if r["mode_key"] != key or (r["example_id"], r.get("gold_index")) not in full:
            continue
        if "answer_steps" not in r:
            missing += 1
            continue
        out.append((r, full[(r["example_id"], r.get("gold_index"))]))
    return out, missing


def markdown(result: dict, key: str) -> str:
    shares = next(iter(result["signals"].values()))["after"] if result["signals"] else {}
    lines = [f"{key}: {result['n']} answers, {result['differs']} differ from full's, {result['loses']} wrong where "
             f"full is right; accuracy minus full {100 * (result['accuracy_minus_full'] or 0):+.1f} points",
             "", "| signal | AUC: differs | AUC: loses | " + " | ".join(f"minus full, {float(s):.0%} escalated"
                                                            for s in shares) + " |",
             "|---|---|---|" + "---|" * len(shares)]
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for name, row in result["signals"].items():
        lines.append(f"| {name} | {fmt(row['auc_differs'])} | {fmt(row['auc_loses'])} | "
                     + " | ".join(f"{100 * v:+.1f}" for v in row["after"].values()) + " |")
    return "\n".join(lines)
