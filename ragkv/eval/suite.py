"""Named evaluation suites: the data sets a paper's quality table reads, each with its own metric, and the mode keys
compared on them. `ragkv eval --suite NAME` runs every set into its own results file (sharded and resumed as one
`--dataset` run is); `ragkv report --share-of-full` prints each key's score as a share of `full`'s."""

from __future__ import annotations

from dataclasses import dataclass

from ragkv.errors import OptionError


@dataclass(frozen=True)
class Suite:
    name: str
    summary: str
    datasets: tuple[str, ...]  # named data sets (eval/datasets.py)
    metrics: dict              # data set -> the metric the papers' table prints for it (else the records' own)
    modes: str                 # the mode keys run on every set, `full` first (the reference)
    limit: int = 60            # questions per set (all of a set that has fewer)


# The KV-reuse papers' table (CacheBlend, EuroSys'25 sec. 7; ProphetKV, arXiv 2602.02579 tab. 2): multi-passage QA
# by token F1, summaries by Rouge-L, SAMSum with its few-shot dialogues as blocks; NQ-10 beside them (accuracy).
# Each selection at r = 0.15 and 0.2, the exact baselines and `reuse` as the floor.
PAPERS = Suite(
    name="papers",
    summary="MuSiQue, HotpotQA dev, MultiNews, SAMSum (4-shot), NQ-10: each selection at r = 0.15 and 0.2, the "
            "query-aware r=0.15 over prefix-conditioned blocks too",
    datasets=("musique", "hotpotqa", "multi_news", "samsum-icl-4", "nq-distractors"),
    # QA by token F1 (CacheBlend and ProphetKV print F1 for MuSiQue and HotpotQA), summaries by Rouge-L, NQ by accuracy
    metrics={"musique": "f1", "hotpotqa": "f1", "multi_news": "rouge_l", "samsum-icl-4": "rouge_l",
             "nq-distractors": "accuracy"},
    # and the query-aware r=0.15 over blocks encoded after the system prompt (the closest first token at that work
    # in the screens, docs/results/quality_suite/screens); r=0.14: on the 1.5B r=0.15 measured 20.4-20.9% of full's
    # token-layers (the query's rows run whole besides the selection), just over the papers' fifth; sfrom=0.5: ranked
    # by the second half of the layers (on the 1.5B the closest first token at r=0.14 in the screens)
    modes=",".join(["full", "reuse"] + [f"blend:{sel}r={r}" for sel in ("", "sel=query,", "sel=recent,")
                                        for r in (0.15, 0.2)]
                   + ["blend:sel=query,r=0.14", "blend:sel=query,r=0.15,cond=prefix",
                      "blend:sel=query,r=0.14,sfrom=0.5"]),
)

SUITES = {s.name: s for s in (PAPERS,)}


def get_suite(name: str) -> Suite:
    if name not in SUITES:
        raise OptionError("suite", f"unknown suite {name!r}; one of {', '.join(SUITES)}")
    return SUITES[name]
