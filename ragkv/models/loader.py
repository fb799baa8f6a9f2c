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


def weight_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape from the safetensors headers, without reading the data."""
    from safetensors import SafetensorError

    shapes = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as fh:
                for key in fh.keys():
                    shapes[key] = tuple(fh.get_slice(key).get_shape())
        except (SafetensorError, OSError) as e:
            raise UnsupportedModelError(f"{f} is not a readable safetensors file ({e}); restore the weights") from None
    return shapes


def check_against_weights(path: Path, args: ModelArgs, shapes: dict[str, tuple[int, ...]]) -> None:
    """The config must describe the weights present: layer count first (a config claiming 10^9 layers would
    build 10^9 modules), then the shape of every tensor the model will take."""
    layers = {int(k.split(".")[2]) for k in shapes if k.startswith("model.layers.") and k.split(".")[2].isdigit()}
    found = max(layers) + 1 if layers else 0
    if args.num_layers != found:
        raise UnsupportedModelError(f"{path}: config.json says num_hidden_layers={args.num_layers} but the weights "
                                    f"hold {found} layers")
    a, kv = args, args.num_kv_heads * args.head_dim
    want = {"model.embed_tokens.weight": (a.vocab_size, a.hidden_size),
            "model.layers.0.self_attn.q_proj.weight": (a.num_heads * a.head_dim, a.hidden_size),
            "model.layers.0.self_attn.k_proj.weight": (kv, a.hidden_size),
            "model.layers.0.self_attn.v_proj.weight": (kv, a.hidden_size),
            "model.layers.0.self_attn.o_proj.weight": (a.hidden_size, a.num_heads * a.head_dim),
            "model.layers.0.mlp.gate_proj.weight": (a.intermediate_size, a.hidden_size),
            "model.layers.0.mlp.down_proj.weight": (a.hidden_size, a.intermediate_size)}
    bad = [f"{k} is {shapes.get(k)}, config.json implies {s}" for k, s in want.items() if shapes.get(k) != s]
    if bad:
        raise UnsupportedModelError(f"{path}: config.json does not match the weights: {'; '.join(bad[:3])}")


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
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise UnsupportedModelError(f"{cfg_file} is not valid JSON ({e}); restore the model's config.json") from None
    args = ModelArgs.from_hf_config(cfg)
    files = _weight_files(path)
    check_against_weights(path, args, weight_shapes(files))  # before the model exists: nothing allocated yet
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


def eos_ids(loaded: LoadedModel) -> set[int]:
    """The token ids that end an answer: the tokenizer's EOS and those the model's generation config names."""
    ids = set()
    tok = loaded.tokenizer
    if getattr(tok, "eos_token_id", None) is not None:
        ids.add(tok.eos_token_id)
    gen_cfg = loaded.path / "generation_config.json"
    if gen_cfg.exists():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids
