"""`ragkv ask`: answer questions over given documents (or retrieved chunks) with a chosen fusion mode."""

from __future__ import annotations

import sys
from pathlib import Path

from ragkv.cli.common import (
    add_fusion_args,
    add_index_arg,
    add_model_args,
    add_store_args,
    engine_from_args,
    fusion_from_args,
    library_location,
    print_json,
)
from ragkv.errors import RagkvError
from ragkv.rag.order import PASSAGE_ORDERS, order_passages
from ragkv.settings import DEFAULT_DOCUMENTS_MODE, DEFAULT_PASSAGE_ORDER

DOC_SUFFIXES = (".txt", ".md")


def register(sub) -> None:
    p = sub.add_parser("ask", help="answer questions over documents, reusing their cached KV")
    p.add_argument("question_pos", nargs="?", metavar="QUESTION", help="the question (or use --question)")
    p.add_argument("--question", action="append", default=[], help="a question (repeatable: same passages)")
    p.add_argument("--doc", action="append", default=[], help="a passage file (repeatable)")
    p.add_argument("--docs-dir", default=None, help="use every .txt/.md file of this folder as a passage")
    p.add_argument("--top-k", type=int, default=5, help="without --doc/--docs-dir: chunks retrieved from the index")
    p.add_argument("--passage-order", default=DEFAULT_PASSAGE_ORDER, choices=PASSAGE_ORDERS,
                   help="retrieved chunks in the prompt: best-last (ascending relevance, the best next to the "
                        "question; Block-Attention 3.2), best-first, or as-given (the index's ranking, best first); "
                        "--doc/--docs-dir documents keep their order")
    add_index_arg(p)
    p.add_argument("--system", default=None, help="replace the default instruction")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--json", action="store_true", help="print answer and statistics as JSON")
    add_fusion_args(p, default_mode=DEFAULT_DOCUMENTS_MODE, mode_key=True)
    add_model_args(p)
    add_store_args(p)
    p.set_defaults(func=run_ask)


def read_passages(docs: list[str], docs_dir: str | None):
    from ragkv.engine.request.segments import Passage

    paths = [Path(d) for d in docs]
    if docs_dir:
        folder = Path(docs_dir)
        if not folder.is_dir():
            raise RagkvError(f"--docs-dir {folder} is not a folder")
        paths += sorted(p for p in folder.iterdir() if p.suffix.lower() in DOC_SUFFIXES)
        if not paths:
            raise RagkvError(f"{folder} holds no .txt or .md files")
    out = []
    for p in paths:
        try:
            out.append(Passage(text=p.read_text(encoding="utf-8").strip(), title=p.stem.replace("_", " ")))
        except (OSError, UnicodeDecodeError) as e:
            raise RagkvError(f"cannot read passage file {p}: {e}") from e
    return out


def run_ask(args) -> int:
    from ragkv.engine.options import GenerationOptions

    questions = ([args.question_pos] if args.question_pos else []) + args.question
    if not questions:
        raise RagkvError("no question: pass QUESTION or --question TEXT")
    fusion = fusion_from_args(args)
    library_location(args)  # a bad --library fails before the model loads
    engine = engine_from_args(args)
    passages = read_passages(args.doc, args.docs_dir)
    retrieved = None
    if not passages:
        retrieved = retrieve_for(questions, args, engine)
    results = []
    for i, q in enumerate(questions):
        used = retrieved[i] if retrieved is not None else passages
        segs = engine.segments(q, [r[0] for r in used] if retrieved is not None else used, system=args.system)
        ans = engine.generate(segs, fusion, GenerationOptions(max_new_tokens=args.max_new_tokens))
        rec = {"question": q, "answer": ans.text.strip(), **ans.stats.to_dict(), "blocks": len(segs.blocks)}
        if retrieved is not None:
            rec["sources"] = [{"title": p.title, "score": round(s, 4), "chunk_id": cid} for p, s, cid in used]
        results.append(rec)
        if not args.json:
            if len(questions) > 1:
                print(f"Q: {q}\nA: {rec['answer']}")
            else:
                print(rec["answer"])
            if retrieved is not None:
                print("sources: " + "; ".join(f"{s['title']} ({s['score']})" for s in rec["sources"]))
            print(f"[{mode_label(fusion)}] ttft {ans.stats.ttft_ms:.0f} ms, blocks hit {ans.stats.cache_hits}/"
                  f"{ans.stats.cache_hits + ans.stats.cache_misses}, reused {ans.stats.reused_tokens} tokens, "
                  f"recomputed {ans.stats.recomputed_tokens}; {describe_fidelity(ans.stats.fidelity)}",
                  file=sys.stderr)
    if args.json:
        print_json(results[0] if len(results) == 1 else results)
    return 0


def mode_label(fusion) -> str:
    """A selection and its ratio beside the mode's name where the mode reads them (`blend select=query r=0.15`):
    the line says what ran."""
    from ragkv.engine.modes import get_mode

    if "select" in get_mode(fusion.mode).option_fields:
        ranked = f" score_from={fusion.score_from:g}" if fusion.score_from else ""  # the default's ranking
        return f"{fusion.mode} select={fusion.select} r={fusion.ratio:g}{ranked}"
    return fusion.mode


def describe_fidelity(fidelity: dict) -> str:
    """One phrase of the mode's own statement of how close to `full` the answer is: its estimate (the expected KL
    of the first token's distribution to full's, and how often that token is full's) and what the estimate rests on."""
    if fidelity.get("exact"):
        return "exact (equals full)"
    signal, name = fidelity.get("signal"), fidelity.get("signal_name")
    est = fidelity.get("estimate") or {}
    parts = []
    if est.get("expected_kl") is not None:
        parts.append(f"expected KL to full {est['expected_kl']:.3f}")
    if est.get("expected_top1") is not None:
        parts.append(f"first token as full's {est['expected_top1']:.0%}")
    if parts:
        basis = {"fitted": "fitted on this model", "extrapolated": "fitted, extrapolated",
                 "none": "population figure, not fitted"}.get(est.get("calibration"), est.get("calibration"))
        parts[-1] += f" ({basis})"
    if signal is not None:
        parts.append(f"risk {name} {signal:.3f}")
    return "approximate" + (": " + ", ".join(parts) if parts else "")


def retrieve_for(questions, args, engine):
    """Top-k chunks per question from the persisted index of `ragkv ingest`: [(Passage, score, chunk_id)]."""
    from ragkv.rag.library import DocumentLibrary

    library = DocumentLibrary(engine, library_location(args))
    if not library.documents():
        raise RagkvError("no passages: pass --doc FILE or --docs-dir DIR, or run `ragkv ingest DIR` first")
    return [order_passages([(r.passage, r.score, r.chunk_id) for r in library.retrieve(q, args.top_k)],
                           args.passage_order) for q in questions]
