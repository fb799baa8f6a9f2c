"""Shadow verification: a sampled share of the approximate answers is re-run with `full` while the
server is idle (on the exact weights, for a w8a8 server), and how close the answer was is measured, per mode: the
first-token KL(full || answer), whether the first tokens agree, and (for greedy answers) how many of the answer's tokens `full` reproduces. /metrics
exports the running means beside the means of the estimates the answers stated (`usage.fidelity.estimate`), so the
estimates' calibration can be watched on the live workload.

It never delays a live request: a check is a background job whose units (a prefill unit, one decode step) run
only while no answer is decoding (the scheduler's idle_only jobs), and it is dropped when it cannot be queued.
Budget: at most `max_pending` checks wait at once (each keeps its prompt's segments and one first-token
distribution, a vocabulary of floats), each compares at most `max_tokens` tokens."""

from __future__ import annotations

import logging
import random
import threading
from dataclasses import dataclass

import torch
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ragkv.engine.decode.sampling import GREEDY_BELOW
from ragkv.engine.options import FusionOptions, GenerationOptions
from ragkv.serve.scheduling import QueueFull
from ragkv.ops.divergence import first_token_kl, prefix_agreement, top1_agreement

log = logging.getLogger(__name__)
FIELDS = ("kl", "top1", "greedy", "expected_kl", "expected_top1")


@dataclass
class Check:
    mode: str
    segs: object
    namespace: str | None
    first_logits: torch.Tensor  # the answer's first-token distribution, on the CPU
    tokens: list[int]           # the answer's first tokens (greedy answers only, else [])
    expected: dict              # the estimate the answer stated (engine/measure/estimates.py), or {}


class ShadowChecks:
    def __init__(self, engine, scheduler, fraction: float, prefill_chunk: int, max_pending: int = 4,
                 max_tokens: int = 32, seed: int = 0, timeout_s: float = 600.0):
        if not 0 <= fraction <= 1:
            raise ValueError(f"the shadow fraction must be in [0, 1], got {fraction}")
        self.engine, self.scheduler, self.fraction = engine, scheduler, fraction
        # `full` on the exact weights: a w8a8 server's replies, `full`'s too, are judged against them (their estimate
        # states the distance to them)
        self.reference = engine.exact_twin() if fraction > 0 else engine
        self.prefill_chunk, self.max_pending, self.max_tokens = prefill_chunk, max_pending, max_tokens
        self.timeout_s = timeout_s
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.pending = 0
        self.skipped = 0  # sampled but not checked: the budget was full or the background queue was
        self.sums: dict[str, dict[str, float]] = {}  # mode -> field -> sum, and "n", "n_greedy", "n_expected"

    def consider(self, p, seq) -> None:
        """An answer finished: maybe queue its check (called on the scheduler's thread)."""
        fidelity = seq.stats.fidelity or {}
        if self.fraction == 0 or fidelity.get("exact", True) or self.rng.random() >= self.fraction:
            return
        with self.lock:
            if self.pending >= self.max_pending:
                self.skipped += 1
                return
            self.pending += 1
        greedy = p.gen.temperature < GREEDY_BELOW and p.gen.grammar is None
        tokens = list(seq.out.token_ids[:self.max_tokens]) if greedy else []
        check = Check(seq.stats.mode, p.segs, p.namespace, seq.first_logits.detach().float().cpu(), tokens,
                      dict(fidelity.get("estimate") or {}))
        try:
            job = self.scheduler.submit_background(lambda: self.run(check), self.timeout_s, idle_only=True)
        except QueueFull:
            with self.lock:
                self.pending -= 1
                self.skipped += 1
            return
        job.future.add_done_callback(self._done)

    def _done(self, future) -> None:
        with self.lock:
            self.pending -= 1
        if future.exception() is not None:
            log.warning("a shadow check failed: %s", future.exception())

    def run(self, check: Check):
        """The check's units: `full`'s prefill of the same prompt, then greedy steps as long as the answer's."""
        gen = GenerationOptions(max_new_tokens=max(1, len(check.tokens)), temperature=0.0)
        seq = yield from self.reference.start_steps(check.segs, FusionOptions(mode="full"), gen, check.namespace,
                                                    self.prefill_chunk)
        first = seq.first_logits.detach().float().cpu()
        if check.tokens:
            while True:
                seq.advance()
                if seq.finished:
                    break
                self.reference.step([seq])
                yield
        agree = prefix_agreement(seq.out.token_ids, check.tokens) / len(check.tokens) if check.tokens else None
        self.record(check, first_token_kl(first, check.first_logits), top1_agreement(first, check.first_logits),
                    agree)

    def record(self, check: Check, kl: float, top1: float, greedy: float | None) -> None:
        with self.lock:
            s = self.sums.setdefault(check.mode, {f: 0.0 for f in (*FIELDS, "n", "n_greedy", "n_expected")})
            s["n"] += 1
            s["kl"] += kl
            s["top1"] += top1
            if greedy is not None:
                s["n_greedy"] += 1
                s["greedy"] += greedy
            if "expected_kl" in check.expected:
                s["n_expected"] += 1
                s["expected_kl"] += check.expected["expected_kl"]
                s["expected_top1"] += check.expected["expected_top1"]

    def means(self) -> dict[str, dict]:
        """Per mode: checks run, and the means of what was measured and of what the answers had stated."""
        with self.lock:
            out = {}
            for mode, s in self.sums.items():
                n, g, e = s["n"], s["n_greedy"], s["n_expected"]
                out[mode] = {"checks": int(n), "first_token_kl": s["kl"] / n, "top1_agreement": s["top1"] / n,
                             "greedy_agreement": s["greedy"] / g if g else None,
                             "expected_kl": s["expected_kl"] / e if e else None,
                             "expected_top1": s["expected_top1"] / e if e else None}
            return out

    def collect(self):
        """Prometheus collector: the per-mode means at each scrape."""
        means = self.means()
        checks = CounterMetricFamily("ragkv_fidelity_checks", "Approximate answers re-run with `full` while idle "
                                     "(shadow verification, --shadow-fraction), by mode.", labels=["mode"])
        gauges = {
            "top1_agreement": GaugeMetricFamily("ragkv_fidelity_top1_agreement", "Share of checked answers whose "
                                                "first token is full's, by mode.", labels=["mode"]),
            "first_token_kl": GaugeMetricFamily("ragkv_fidelity_first_token_kl", "Mean first-token KL(full || "
                                                "answer) of checked answers, by mode.", labels=["mode"]),
            "greedy_agreement": GaugeMetricFamily("ragkv_fidelity_greedy_agreement", "Mean share of a checked "
                                                  "greedy answer's tokens full reproduces, by mode.", labels=["mode"]),
            "expected_top1": GaugeMetricFamily("ragkv_fidelity_expected_top1", "Mean expected_top1 the checked "
                                               "answers stated (compare with the measured agreement).",
                                               labels=["mode"]),
            "expected_kl": GaugeMetricFamily("ragkv_fidelity_expected_kl", "Mean expected_kl the checked answers "
                                             "stated (compare with the measured KL).", labels=["mode"]),
        }
        for mode, m in sorted(means.items()):
            checks.add_metric([mode], m["checks"])
            for field, family in gauges.items():
                if m[field] is not None:
                    family.add_metric([mode], m[field])
        yield checks
        yield from gauges.values()
        yield CounterMetricFamily("ragkv_fidelity_checks_skipped", "Sampled answers not checked: the check budget "
                                  "(--shadow-max-pending) or the background queue was full.", value=self.skipped)
