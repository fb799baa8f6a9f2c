"""`auto` replayed from an evaluation's records: what `auto:r=R,sig=expected_kl,risk=X,budget=B` would have answered,
from the records of `full` and `blend:sel=query,r=R` on the same questions, under a fidelity fit.

`auto` (engine/modes/auto.py) runs the query-aware selection at r = R; when the reply's expected first-token KL (the
model's fit on its recomputed share and first-token entropy and margin: the `features` of its record) exceeds X and
fewer than B of the engine's last 100 `auto` answers escalated, it recomputes every token: `full`'s answer.
Otherwise its answer is the r = R reply. So its answers follow from those two records, and its work is the r = R
reply's plus `full`'s when it escalates (an upper bound: the escalation does not prefill the question twice).
Checked on the committed run (docs/results/fidelity/auto-qwen05: 60 pairs, every one of its 53 kept answers equal to
r = 0.15's token for token and its 7 escalated ones to `full`'s), which `replay_agrees` repeats as a test. One engine
per results file, as `ragkv eval` runs one per shard: the budget's window starts empty in each, in file order.
"""

from __future__ import annotations

from collections import deque

from ragkv.engine.measure.estimates import FidelityFits
from ragkv.eval.fidelity_fit import features

WINDOW = 100  # RecentShare's: the last answers the budget counts


def replay_key(ratio: float, max_risk: float, budget: float) -> str:
    return f"auto:r={ratio},sig=expected_kl,risk={max_risk},budget={budget}"


def replay_auto(records: list[dict], fits: FidelityFits, max_risk: float, budget: float,
                ratio: float = 0.15) -> list[dict]:
    """One results file's records (one engine, in order) -> the replayed `auto` records, one per question that has
    both a `full` and a `blend:sel=query,r=ratio` record: the kept reply's record or `full`'s, with `mode_key`,
    `mode`, `recompute_vs_full`, `replayed: true`, `escalated` and the decision's `expected_kl`."""
    base_key = f"blend:sel=query,r={ratio}"
    by_example: dict[str, dict] = {}
    for r in records:
        by_example.setdefault(r["example_id"], {})[r["mode_key"]] = r
    recent: deque[bool] = deque(maxlen=WINDOW)
    out = []
    for ex, recs in by_example.items():
        base, full = recs.get(base_key), recs.get("full")
        if base is None or full is None:
            continue
        if not base.get("answer_confidence"):
            raise ValueError(f"the {base_key} record of example {ex} has no answer_confidence (an older eval's): "
                             "run the eval again with this version")
        fitted = fits.predict("blend", "query", features(base)[1:])
        if fitted is None:
            raise ValueError(f"the fit {fits.source} has no key for query-aware blend")
        spent = budget < 1.0 and recent and sum(recent) / len(recent) >= budget
        escalate = fitted["expected_kl"] > max_risk and not spent
        recent.append(escalate)
        chosen = full if escalate else base
        out.append({**chosen, "mode_key": replay_key(ratio, max_risk, budget), "mode": "auto", "replayed": True,
                    "escalated": escalate, "expected_kl": fitted["expected_kl"],
                    "recompute_vs_full": round(base["recompute_vs_full"] + (1.0 if escalate else 0.0), 4)})
    return out


def replay_agrees(records: list[dict], fits: FidelityFits, max_risk: float, budget: float,
                  ratio: float = 0.15) -> tuple[int, int]:
    """Against a file that also holds `auto`'s own records at these settings: (questions whose replayed answer
    equals auto's own token for token, questions compared)."""
    key = replay_key(ratio, max_risk, budget)
    own = {r["example_id"]: r for r in records if r["mode_key"] == key}
    replayed = replay_auto([r for r in records if r["mode_key"] != key], fits, max_risk, budget, ratio)
    pairs = [(r, own[r["example_id"]]) for r in replayed if r["example_id"] in own]
    return sum(a["token_ids"] == b["token_ids"] for a, b in pairs), len(pairs)
