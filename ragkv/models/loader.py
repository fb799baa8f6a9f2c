"""Load a local Hugging Face folder into our Transformer (meta device + assign, no copy) plus its tokenizer."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ragkv.config import dtype_name
from ragkv.errors import ModelNotFoundError, UnsupportedModelError
from ragkv.models.args import ModelArgs
from ragkv.models.llama import Transformer
from ragkv.models.registry import resolve_model_path


@dataclass
class LoadedModel:
    name: str
    path: Path
    model: Transformer
    tokenizer: object
    fingerprint: str  # identity of weights + tokenizer + dtype + RoPE: part of every cache key (docs/invariants.md, invariant 8)

    @property
    def args(self) -> ModelArgs:
        return self.model.args


def _weight_files(path: Path) -> list[Path]:
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    raise ModelNotFoundError(
        f"{path} has no model.safetensors (or sharded index); ragkv loads safetensors weights only: "
        "re-save the model with save_pretrained(safe_serialization=True)")


def _weights_digest(files: list[Path], samples: int = 32, chunk: int = 1 << 16) -> str:
    """Hash of sizes plus evenly spaced byte samples: tells fine-tuned copies apart without reading 500 MB."""
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            for i in range(samples):
                fh.seek(max(0, size * i // samples - chunk // 2))
                h.update(fh.read(chunk))
    return h.hexdigest()


def model_fingerprint(path: Path, args: ModelArgs, dtype: torch.dtype, files: list[Path]) -> str:
    h = hashlib.sha256()
    h.update((path / "config.json").read_bytes())
    tok = path / "tokenizer.json"
    if tok.exists():
        h.update(hashlib.sha256(tok.read_bytes()).digest())
    h.update(_weights_digest(files).encode())
    h.update(dtype_name(dtype).encode())
    h.update(args.rope.fingerprint().encode())
    return h.hexdigest()[:24]


def load_model(name_or_path: str, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> LoadedModel:
    path = resolve_model_path(name_or_path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise ModelNotFoundError(f"{path} has no config.json; pass a Hugging Face model folder")
    args = ModelArgs.from_hf_config(json.loads(cfg_file.read_text()))
    files = _weight_files(path)
    with torch.device("meta"):
        model = Transformer(args)
    state = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for key in fh.keys():
                state[key] = fh.get_tensor(key).to(dtype=dtype, device=device)
    if "lm_head.weight" not in state:
        if not args.tie_embeddings and "model.embed_tokens.weight" not in state:
            raise UnsupportedModelError(f"{path}: weights lack lm_head.weight")
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    expected = set(model.state_dict().keys())
    missing = expected - state.keys()
    if missing:
        raise UnsupportedModelError(f"{path}: weights are missing {sorted(missing)[:5]} ...; is this a "
                                    f"{args.model_type} checkpoint?")
    model.load_state_dict({k: state[k] for k in expected}, assign=True, strict=True)
    if args.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.eval().requires_grad_(False)
    model.setup_rope()
    tokenizer = load_tokenizer(path)
    fp = model_fingerprint(path, args, dtype, files)
    return LoadedModel(name=name_or_path, path=path, model=model, tokenizer=tokenizer, fingerprint=fp)


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    if not ((path / "tokenizer.json").exists() or (path / "tokenizer.model").exists()):
        raise ModelNotFoundError(f"{path} has no tokenizer (tokenizer.json); copy it into the model folder")
    return AutoTokenizer.from_pretrained(str(path))
