"""What `ragkv eval`, `sweep`, `calibrate` and `report` share: the dataset a command names, its examples (ranked by a
real retriever where asked), the engine, the labels of results files, progress lines."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ragkv.cli.common import add_fusion_args, add_model_args, floats, fusion_from_args, ints
from ragkv.errors import RagkvError
from ragkv.rag.order import PASSAGE_ORDERS, order_passages


def base_fusion(args):
    from ragkv.engine.options import FusionOptions

    if not hasattr(args, "check_layers"):  # calibrate has no mode parameters
        return FusionOptions(mode="full")
    return fusion_from_args(args, mode="full")


def dataset_spec(args, name: str | None) -> tuple[str, dict, dict]:
    """(label, description for the results config, load_dataset keyword arguments)."""
    if args.data_file and args.dataset:
        raise RagkvError("pass either --dataset or --data-file (with --format), not both")
    name = None if args.data_file else (args.dataset or name)
    if name is None and not args.data_file:
        raise RagkvError("no data: pass --dataset NAME or --data-file PATH --format F")
    label = name or Path(args.data_file).stem
    gold = getattr(args, "gold_position", None)
    if args.num_passages:
        label += f"-k{args.num_passages}"
    if gold is not None:
        label += f"-g{gold}"
    desc = {"dataset": name, "data_file": str(Path(args.data_file).resolve()) if args.data_file else None,
            "format": args.format, "num_passages": args.num_passages, "split": args.split}
    if gold is not None:  # only when set: results files written before the flag existed still resume
        desc["gold_position"] = gold
    order = getattr(args, "passage_order", "as-given")
    if order != "as-given":
        desc["passage_order"] = order
        label += f"-{order}"
    kw = {"name": name, "data_file": args.data_file, "fmt": args.format, "num_passages": args.num_passages,
          "split": args.split, "gold_position": gold}
    return label, desc, kw


def rank_passages(examples, order: str):
    """Each example's passages ranked by a real retriever (the MiniLM embedder ingest uses: cosine of question and
    passage) and put in `order`; `meta["gold_index"]`, where there is one, follows the gold passage."""
    from dataclasses import replace

    import numpy as np

    from ragkv.rag.embedding import Embedder

    embedder, out = Embedder(), []
    for ex in examples:
        vecs = embedder.encode([ex.question] + [f"{p.title}\n{p.text}" if p.title else p.text for p in ex.passages])
        ranked = [int(i) for i in np.argsort(-(vecs[1:] @ vecs[0]), kind="stable")]  # best first
        placed = order_passages(ranked, order)
        meta = dict(ex.meta)
        if "gold_index" in meta:
            meta["retrieved_gold_rank"] = ranked.index(meta["gold_index"])  # 0: the retriever's best
            meta["gold_index"] = placed.index(meta["gold_index"])
        out.append(replace(ex, passages=[ex.passages[i] for i in placed], meta=meta))
    return out


def load_examples(kw: dict, limit):
    from ragkv.eval.datasets import load_dataset

    return load_dataset(kw["name"], kw["data_file"], kw["fmt"], limit, split=kw["split"],
                        num_passages=kw["num_passages"], gold_position=kw.get("gold_position"))


def load_engine(args, decode_weights: str = "exact"):
    from ragkv.engine.engine import Engine

    return Engine.load(args.model, dtype=args.dtype, device=args.device, decode_weights=decode_weights)


def model_label(args) -> str:
    return Path(args.model).name


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- the flags the eval commands share ---------------------------------------------------------------------

def _floats(s: str) -> tuple[float, ...]:
    return floats(s, "this option")


def _ints(s: str) -> tuple[int, ...]:
    return ints(s, "this option")


def _data_args(p, default: str | None, limit: int | None) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--dataset", default=None, help=f"a named data set (default: {default})")
    g.add_argument("--data-file", default=None, help="any file in one of the loader formats (with --format)")
    g.add_argument("--format", default=None, help="cacheblend | hotpotqa | longbench | samsum | nq | kv")
    g.add_argument("--limit", type=int, default=limit, help="first N examples" + (f" (default {limit})" if limit
                                                                                    else " (default: all)"))
    g.add_argument("--num-passages", type=int, default=None, help="nq: gold passage + N-1 distractors")
    g.add_argument("--gold-position", type=int, default=None,
                   help="nq with distractors (nq-distractors or --num-passages > 1): 0-based index of the gold "
                   "passage (default: cycles over every position)")
    g.add_argument("--split", default=None, help="samsum: test (default) | train | validation | all")
    g.add_argument("--passage-order", default="as-given", choices=PASSAGE_ORDERS,
                   help="as-given (the data set's layout, e.g. --gold-position) or each example's passages ranked "
                        "by a real retriever (MiniLM cosine to the question) and put best-last (as ask and serve "
                        "do) or best-first")
    p.set_defaults(default_dataset=default)


def _model_args(p) -> None:
    add_model_args(p, decode_weights=False)


def _fusion_args(p) -> None:
    add_fusion_args(p, default_mode=None, title="defaults for bare mode keys (a key's own parameters win)")


def _run_args(p, output_help: str) -> None:
    p.add_argument("--max-new-tokens", type=int, default=None, help="greedy tokens per answer (0: first token only)")
    p.add_argument("--overwrite", action="store_true", help="replace a results file of another configuration")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--output", default=None, help=output_help)


def _shard(text: str) -> tuple[int, int]:
    """`K/N` -> (K, N): the K-th of N interleaved parts of the examples, 1 <= K <= N."""
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants K/N like 1/2, got {text!r}") from None
    if not 1 <= k <= n:
        raise argparse.ArgumentTypeError(f"wants K/N with 1 <= K <= N, got {text!r}")
    return k, n
