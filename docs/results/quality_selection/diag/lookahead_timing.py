"""Time to the whole answer of `blend:sel=query,draft=N` with the draft's rows taken as the answer's start
(DecodeState.lookahead) and without (every answer token decoded by a forward), in one process on the same
questions, alternating the two per question. Prints per-question figures and the medians; writes JSON.

  python docs/results/quality_selection/diag/lookahead_timing.py OUT.json [--gold 0] [--first 0] [--last 8]
"""
import argparse
import json
import statistics
import time

from ragkv.config import cpu_name
from ragkv.engine.engine import Engine
from ragkv.engine.options import FusionOptions, GenerationOptions
from ragkv.engine.state import DecodeState
from questions import add_question_range, nq10_questions  # this folder's

TAKE = DecodeState.take_lookahead


def run(eng, segs, fusion, gen, lookahead: bool) -> dict:
    DecodeState.take_lookahead = TAKE if lookahead else (lambda self, token: self.drop_lookahead())
    t0 = time.perf_counter()
    ans = eng.generate(segs, fusion, gen)
    total = (time.perf_counter() - t0) * 1000
    s = ans.stats
    return {"tokens": ans.token_ids, "total_ms": round(total, 1), "ttft_ms": round(s.ttft_ms, 1),
            "decode_ms": round(s.decode_ms, 1), "taken": s.extra.get("lookahead_taken", 0)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    add_question_range(p, 8)
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument("--draft", type=int, default=16)
    a = p.parse_args()
    eng = Engine.load(model="qwen2.5-coder-0.5b", dtype="float32")
    fusion = FusionOptions(mode="blend", select="query", ratio=a.ratio, draft_tokens=a.draft)
    gen = GenerationOptions(max_new_tokens=32)
    rows = []
    for i, ex in enumerate(nq10_questions(a)):
        segs = eng.segments(ex.question, ex.passages)
        eng.warm(segs, fusion)
        order = (True, False) if i % 2 == 0 else (False, True)  # alternate which goes first
        r = {la: run(eng, segs, fusion, gen, la) for la in order}
        assert r[True]["tokens"] == r[False]["tokens"], ex.id  # the same answer either way
        rows.append({"id": ex.id, "with": r[True], "without": r[False]})
        print(ex.id, "taken", r[True]["taken"], "of", len(r[True]["tokens"]), "total ms with %.0f without %.0f" % (
            r[True]["total_ms"], r[False]["total_ms"]), flush=True)
        eng.forget(segs)
    DecodeState.take_lookahead = TAKE
    med = {k: statistics.median(r[k]["total_ms"] for r in rows) for k in ("with", "without")}
    ratio = statistics.median(r["with"]["total_ms"] / r["without"]["total_ms"] for r in rows)
    print("median total ms with %.0f without %.0f; median ratio with/without %.3f" % (med["with"], med["without"],
                                                                                       ratio))
    json.dump({"cpu": cpu_name(), "args": vars(a), "median_total_ms": med, "median_ratio": ratio, "rows": rows},
              open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
