"""`ragkv ingest DIR|FILE...`: chunk, embed, index, and precompute each chunk's KV into the store."""

from __future__ import annotations

import sys

from ragkv.cli.common import (add_index_arg, add_model_args, add_store_args, engine_from_args, library_location,
                              print_json)


def register(sub) -> None:
    p = sub.add_parser("ingest", help="index documents for retrieval and precompute their KV caches")
    p.add_argument("paths", nargs="+", help="files (.txt, .md, .json, .jsonl) or folders")
    add_index_arg(p)
    p.add_argument("--skip-errors", action="store_true", help="skip unreadable files instead of stopping")
    p.add_argument("--json", action="store_true")
    add_model_args(p)
    add_store_args(p)
    p.set_defaults(func=run_ingest)


def run_ingest(args) -> int:
    from ragkv.rag.library import DocumentLibrary

    location = library_location(args)  # a bad --library fails before the model loads
    engine = engine_from_args(args)
    library = DocumentLibrary(engine, location)
    on_error = (lambda e: print(f"ragkv: skipped {e}", file=sys.stderr)) if args.skip_errors else None
    report = library.ingest_paths(args.paths, progress=True, on_error=on_error)
    out = {"documents": report.documents, "unchanged": report.unchanged, "chunks_added": report.chunks_added,
           "chunks_removed": report.chunks_removed, "skipped": [str(e) for e in report.errors],
           "indexed_documents": len(library.documents())}
    if args.json:
        print_json(out)
    else:
        print(f"ingested {out['documents']} documents: {out['chunks_added']} new chunks (KV precomputed), "
              f"{out['unchanged']} unchanged, {len(out['skipped'])} skipped; index holds "
              f"{out['indexed_documents']} documents")
    return 0
