"""A one-off migration: reading the file-based vector index of versions before the document library.

That index kept a folder's chunks in `index.json` (manifest: format 1, generation, count, dim, embedding model),
`vectors-<generation>.npy` (float32 [count, dim] unit vectors) and `chunks-<generation>.jsonl` (one Chunk per
line). A library created in such a folder imports its documents once (`Catalog`); nothing writes this format
any more, and the old files are left where they are.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from ragkv.rag.chunking import Chunk

log = logging.getLogger(__name__)

MANIFEST = "index.json"
FORMAT = 1


def has_legacy_index(folder: Path) -> bool:
    return (Path(folder) / MANIFEST).exists()


def read_legacy_index(folder: Path, embedding_model: str | None) -> tuple[list[Chunk], np.ndarray] | None:
    """The chunks and their vectors of the old index in `folder`; None (with a warning) when it is unreadable,
    inconsistent, of another format or built with another embedding model: the library then starts empty."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        generation, dim, count = str(manifest["generation"]), int(manifest["dim"]), int(manifest["count"])
        model, fmt = manifest.get("embedding_model"), manifest.get("format")
        if fmt != FORMAT:
            raise ValueError(f"format {fmt!r}, not {FORMAT}")
        if embedding_model and model and model != embedding_model:
            raise ValueError(f"built with embedding model {model!r}, not {embedding_model!r}")
        vecs = np.load(folder / f"vectors-{generation}.npy", allow_pickle=False)
        with open(folder / f"chunks-{generation}.jsonl", encoding="utf-8") as f:
            chunks = [Chunk(**json.loads(line)) for line in f if line.strip()]
        if vecs.ndim != 2 or vecs.dtype != np.float32 or vecs.shape[1] != dim:
            raise ValueError(f"vectors are {vecs.dtype} {vecs.shape}, expected float32 [N, {dim}]")
        if not len(vecs) == len(chunks) == count:
            raise ValueError(f"{len(vecs)} vectors but {len(chunks)} chunk records (manifest says {count})")
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("not importing the old vector index in %s (%s); ingest those documents again", folder, e)
        return None
    return chunks, vecs
