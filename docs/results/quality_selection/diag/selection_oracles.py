"""Issue 27, session 27: what limits the query-aware selection where the gold passage is farthest from the question
(NQ-10, gold 0)? Diagnostics, not product code: they swap the stage-1 score (or the selection) through the engine's
module attributes, so each study runs the engine's own stage 2 and decoding.

  python selection_oracles.py whole-blocks GRID OUT [--bad 3]   # recompute whole blocks instead of chosen tokens
  python selection_oracles.py exact-score GRID OUT [--bad 5]    # score over the EXACT context (a full prefill)
  python selection_oracles.py answer-score GRID OUT [--bad 4]   # score by query + full's answer / + a reuse draft
  python selection_oracles.py draft-accuracy OUT --gold 0 --first 0 --last 60   # greedy answers, query + draft

GRID: a grid results file (grid-nq10-g0-qwen05.jsonl): its `bad` questions are those `full` answers and the
query-aware r=0.3 does not. The first three studies teacher-force full's greedy 32 tokens and print their NLL and
how many of them are each variant's argmax. Qwen2.5-Coder-0.5B, fp32, run from the repo root with the venv.
"""
import argparse
import json
import time

import torch

import ragkv.engine.modes.blend as blend_mode
import ragkv.engine.query_select as qs
from ragkv.engine.engine import Engine
from ragkv.engine.fusion import prefill_full, prefill_over_context
from ragkv.engine.options import GenerationOptions
from ragkv.engine.state import decode_step
from ragkv.engine.stats import RequestStats
from ragkv.engine.stepwise import drain
from ragkv.eval.datasets import load_dataset
from ragkv.eval.harness import task_scores
from ragkv.eval.modes import parse_mode_key
from questions import add_question_range, nq10_questions  # this folder's

SWAP = {"blocks": None, "context": None, "rows": None, "score": None}  # what the current run replaces
_choose, _fuse, _selected = qs.choose_tokens, qs.fuse_layer_scores, blend_mode.prefill_selected


def choose(score, layout, ratio, sinks, per_block):
    if SWAP["blocks"] is None:
        return _choose(score, layout, ratio, sinks, per_block)
    spans = list(zip(layout.block_offsets(), layout.block_lens))
    return torch.cat([torch.arange(spans[k][0], spans[k][0] + spans[k][1]) for k in SWAP["blocks"]])


def selected(model, layer_iter, layout, context_ids, query_ids, *a, **kw):
    """Stage 1's score replaced by the attention of `rows` (query + extra) over the exact or the reused context."""
    if SWAP["context"] is not None:
        N, L = layout.context_len, model.args.num_layers
        rows = query_ids + SWAP["rows"]
        if SWAP["context"] == "exact":
            st = drain(prefill_full(model, context_ids, N + len(rows), RequestStats("full")))
            parts = [[(st.cache.keys[i][0, :, :N], st.cache.values[i][0, :, :N], True)] for i in range(L)]
        else:
            layer_iter = parts = [list(p) for p in layer_iter]
        rec = qs.QueryAttentionRecorder(N)
        prefill_over_context(model, iter(parts), layout, rows, N + len(rows), RequestStats("reuse"), rec)
        SWAP["score"] = _fuse(rec.layer_scores)
        layer_iter = iter(layer_iter)
    return _selected(model, layer_iter, layout, context_ids, query_ids, *a, **kw)


qs.choose_tokens = choose
qs.fuse_layer_scores = lambda scores: SWAP["score"] if SWAP["context"] is not None else _fuse(scores)
blend_mode.prefill_selected = selected


def run(swap: dict, fn):
    SWAP.update(swap)
    try:
        return fn()
    finally:
        SWAP.update(blocks=None, context=None, rows=None, score=None)


def teacher_forced(eng, segs, key: str, tokens: list[int], **swap):
    """NLL of `tokens` after this variant's prefill, and how many are its argmax."""
    state, stats = run(swap, lambda: eng.prefill(segs, parse_mode_key(key)))
    logits, nll, agree = state.logits, 0.0, 0
    for t in tokens:
        lp = logits.float().log_softmax(-1)
        nll, agree = nll - float(lp[t]), agree + int(int(lp.argmax()) == t)
        logits = decode_step(eng.decode_model, state, t)
    state.release()
    return round(nll, 3), agree, stats.extra.get("selected_per_block")


def bad_questions(grid: str, n: int) -> list[str]:
    acc = {(r["example_id"], r["mode_key"]): r["scores"]["accuracy"]
           for r in map(json.loads, open(grid)) if "example_id" in r}
    ids = sorted({e for e, _ in acc}, key=int)
    return [e for e in ids if acc.get((e, "full")) == 1 and acc.get((e, "blend:sel=query,r=0.3")) == 0][:n]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("study", choices=("whole-blocks", "exact-score", "answer-score", "draft-accuracy"))
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--bad", type=int, default=5)
    add_question_range(ap, 60)
    a = ap.parse_args()
    eng = Engine.load(model="qwen2.5-coder-0.5b", dtype="float32")
    out = open(a.paths[-1], "a")
    q = "blend:sel=query,r="
    if a.study == "draft-accuracy":
        examples = nq10_questions(a)
    else:
        wanted = bad_questions(a.paths[0], a.bad)
        examples = [e for e in load_dataset("nq-distractors", limit=60, num_passages=10, gold_position=0)
                    if e.id in wanted]
    for ex in examples:
        segs = eng.segments(ex.question, ex.passages)
        draft = eng.generate(segs, parse_mode_key("reuse"), GenerationOptions(max_new_tokens=16)).token_ids
        row = {"id": ex.id}
        if a.study == "draft-accuracy":
            for r in (0.15, 0.3):
                t0 = time.time()
                ans = run(dict(context="reused", rows=draft),
                          lambda: eng.generate(segs, parse_mode_key(f"{q}{r}"), GenerationOptions(max_new_tokens=32)))
                row[f"draft{r}"] = {"text": ans.text, "acc": task_scores(ex, ans.text)["accuracy"],
                                    "s": round(time.time() - t0, 2)}
        else:
            toks = eng.generate(segs, parse_mode_key("full"), GenerationOptions(max_new_tokens=32)).token_ids
            row["reuse"] = teacher_forced(eng, segs, "reuse", toks)
            for r in (0.15, 0.3):
                row[f"q{r}"] = teacher_forced(eng, segs, f"{q}{r}", toks)
                if a.study == "exact-score":
                    row[f"exact{r}"] = teacher_forced(eng, segs, f"{q}{r}", toks, context="exact", rows=[])
                if a.study == "answer-score":
                    row[f"answer{r}"] = teacher_forced(eng, segs, f"{q}{r}", toks, context="exact", rows=toks)
                    row[f"draft{r}"] = teacher_forced(eng, segs, f"{q}{r}", toks, context="reused", rows=draft)
            if a.study == "whole-blocks":
                for ks in [[k] for k in range(10)] + [[1, 2, 3], [7, 8, 9]]:
                    row["b" + "".join(map(str, ks))] = teacher_forced(eng, segs, f"{q}0.3", toks, blocks=ks)
        print(json.dumps(row), flush=True)
        out.write(json.dumps(row) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
