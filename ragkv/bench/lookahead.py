"""`ragkv bench lookahead`: what taking a draft's rows as the answer's start saves (DecodeState.lookahead: the rows
that `blend:sel=query,draft=N`'s stage 2 ran after the query). Each question is answered twice in one process,
with the precomputed rows taken and with them dropped before the first token (every answer token decoded by a
forward), alternating which goes first so that the machine's drift hits both alike; time to the whole answer.

Both answers must be the same tokens (a taken row is the row a decode step would compute): `same_answer` says so
per question, and the markdown flags any that differ."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ragkv.bench.common import markdown_table, save_json
from ragkv.engine.options import FusionOptions, GenerationOptions


@dataclass(frozen=True)
class LookaheadBenchConfig:
    ratio: float = 0.15
    draft_tokens: int = 16
    max_new_tokens: int = 32


def answer(engine, segs, fusion: FusionOptions, gen: GenerationOptions, lookahead: bool) -> dict:
    """One greedy answer, timed from the prefill's start to its last token."""
    t0 = time.perf_counter()
    seq = engine.start(segs, fusion, gen)
    if not lookahead:
        seq.state.drop_lookahead()  # the prefill ran the draft's rows; here none of them is used
    while True:
        seq.advance()
        if seq.finished:
            break
        engine.step([seq])
    s = seq.stats
    return {"tokens": list(seq.out.token_ids), "total_ms": round((time.perf_counter() - t0) * 1000, 1),
            "ttft_ms": round(s.ttft_ms, 1), "decode_ms": round(s.decode_ms, 1),
            "taken": s.extra.get("lookahead_taken", 0), "draft": list(s.recompute.draft) if s.recompute else []}


def run_lookahead_bench(engine, cfg: LookaheadBenchConfig, questions: list[tuple[str, object]], out_dir: Path,
                        say=print) -> dict:
    """`questions`: (id, Segments) pairs."""
    fusion = FusionOptions(mode="blend", select="query", ratio=cfg.ratio, draft_tokens=cfg.draft_tokens)
    gen = GenerationOptions(max_new_tokens=cfg.max_new_tokens)
    rows = []
    for i, (qid, segs) in enumerate(questions):
        engine.warm(segs, fusion)  # blocks stored first: both runs reuse them
        order = (True, False) if i % 2 == 0 else (False, True)
        r = {la: answer(engine, segs, fusion, gen, la) for la in order}
        rows.append({"id": qid, "with": r[True], "without": r[False], "same_answer": r[True]["tokens"] ==
                     r[False]["tokens"]})
        say(f"[lookahead] {qid}: {r[True]['taken']} of {len(r[True]['tokens'])} tokens taken; total ms with "
            f"{r[True]['total_ms']:.0f}, without {r[False]['total_ms']:.0f}")
        engine.forget(segs)
    result = {"config": asdict(cfg), "engine": engine.info(), "rows": rows, "summary": summarize(rows)}
    save_json(out_dir / "lookahead.json", result)
    (out_dir / "lookahead.md").write_text(markdown(cfg, result))
    return result


def summarize(rows: list[dict]) -> dict:
    if not rows:
        return {"questions": 0}

    def ratio(key: str) -> float | None:
        pairs = [(r["with"][key], r["without"][key]) for r in rows if r["without"][key] > 0]
        return round(statistics.median(w / wo for w, wo in pairs), 4) if pairs else None

    return {"questions": len(rows), "same_answers": sum(r["same_answer"] for r in rows),
            "tokens": sum(len(r["with"]["tokens"]) for r in rows), "taken": sum(r["with"]["taken"] for r in rows),
            "median_total_ms": {k: statistics.median(r[k]["total_ms"] for r in rows) for k in ("with", "without")},
            "median_ratio": {k: ratio(f"{k}_ms") for k in ("total", "decode", "ttft")}}


def markdown(cfg: LookaheadBenchConfig, result: dict) -> str:
    s, e = result["summary"], result["engine"]
    head = [f"# ragkv bench lookahead: blend:sel=query,r={cfg.ratio:g},draft={cfg.draft_tokens}", "",
            f"{e['model']} {e['dtype']}, {cfg.max_new_tokens} new tokens max; {s['questions']} questions, "
            f"{s.get('same_answers', 0)} with the same answer either way; {s.get('taken', 0)} of "
            f"{s.get('tokens', 0)} answer tokens taken without a forward.", ""]
    if s["questions"]:
        m, q = s["median_total_ms"], s["median_ratio"]
        head += [f"Median time to the whole answer: {m['with']:.0f} ms with, {m['without']:.0f} ms without; median "
                 f"per-question ratio with/without: total {q['total']}, decode {q['decode']}, TTFT {q['ttft']}.", ""]
    table = [[r["id"], f"{r['with']['taken']} / {len(r['with']['tokens'])}", r["with"]["total_ms"],
              r["without"]["total_ms"], r["with"]["decode_ms"], r["without"]["decode_ms"],
              "yes" if r["same_answer"] else "**no**"] for r in result["rows"]]
    return "\n".join(head + [markdown_table(["question", "taken / tokens", "total ms with", "without",
                                             "decode ms with", "without", "same answer"], table), ""])
