"""What `ragkv eval`, `sweep`, `calibrate` and `report` share: the dataset a command names, its examples (ranked by a
real retriever where asked), the engine, the labels of results files, progress lines."""

from __future__ import annotations

import sys
from pathlib import Path

from ragkv.cli.common import fusion_from_args
from ragkv.errors import RagkvError
from ragkv.rag.order import order_passages


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
