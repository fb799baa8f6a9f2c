"""Cheap signals that an approximate answer may be far from `full`'s, computed by the approximate run itself.

`shift`: KL(first-token distribution after stage 2 || after stage 1), how far recomputing r of the tokens moved
the answer; `entropy`: the final first-token distribution's entropy (nats); `margin`: 1 - (top-1 minus top-2
probability), high when the model is unsure between two tokens; `uncovered`: the share of the query's stage-1
attention to the block tokens that falls on tokens left reused (ProphetKV's score mass not recomputed);
`expected_kl`: the reply's own fidelity estimate (engine/measure/estimates.py: the model's fit where it has one, from
the recomputed share and the answer's entropy and margin; else the population's figure). Which one ranks the real distance to `full` best,
and the threshold on it, are measured on held-out data by `ragkv calibrate --target auto` (ragkv/eval/risk.py)."""

from __future__ import annotations

from collections import deque

from ragkv.ops.divergence import confidence, first_token_kl

SIGNALS = ("shift", "entropy", "margin", "uncovered", "expected_kl")
DEFAULT_SIGNAL = "shift"


def measure(logits, previous_logits, uncovered: float | None, expected_kl: float | None = None) -> dict:
    """Every signal's value for one stage-2 answer (`logits`) recomputed from `previous_logits` (None where no
    earlier answer exists: no `shift`); `uncovered` comes from the selection (None where nothing scored the tokens);
    `expected_kl`: the reply's expected first-token KL to `full` (None: not estimated)."""
    conf = confidence(logits)
    shift = None if previous_logits is None else round(first_token_kl(logits, previous_logits), 6)
    return {"shift": shift, "entropy": round(conf["entropy"], 6),
            "margin": round(1.0 - conf["margin"], 6),
            "uncovered": None if uncovered is None else round(uncovered, 6),
            "expected_kl": None if expected_kl is None else round(expected_kl, 6)}


def check_signal(name: str) -> str:
    if name not in SIGNALS:
        raise ValueError(f"unknown risk signal {name!r}; one of {', '.join(SIGNALS)}")
    return name


class RecentShare:
    """The share of the last `window` decisions that were yes (`auto`'s escalations, against its budget)."""

    def __init__(self, window: int = 100):
        self._last: deque[bool] = deque(maxlen=window)

    def add(self, yes: bool) -> None:
        self._last.append(bool(yes))

    def share(self) -> float:
        return sum(self._last) / len(self._last) if self._last else 0.0
