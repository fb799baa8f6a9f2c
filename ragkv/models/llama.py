"""Llama-family decoder (Llama, Mistral, Qwen2) with Hugging Face parameter names, driven layer by layer.

Each decoder layer exposes its steps separately so that the fusion modes can run them on chosen tokens:
`project_qkv` (raw, pre-RoPE), RoPE via `Transformer.rope`, attention through ragkv.ops.attention,
and `finish` (output projection + MLP with both residuals).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ragkv.models.args import ModelArgs
from ragkv.models.loop import CausalPlan, Forward
from ragkv.ops.norm_kernel import rms_norm_pass
from ragkv.ops.rope import RotaryTable, apply_rope


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:  # one pass where the kernel is built, else torch's op (seven inside)
            out = rms_norm_pass(x, self.weight, self.eps)
            return out if out is not None else F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.float()  # variance in fp32, as HF does
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def add_linear(linear: nn.Module, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """residual + linear(x); a decode copy's linear may add the residual inside its product (models/onednn.py)."""
    add_to = getattr(linear, "add_to", None)
    return add_to(residual, x) if add_to is not None else residual + linear(x)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.q_proj = nn.Linear(a.hidden_size, a.num_heads * a.head_dim, bias=a.qkv_bias)
        self.k_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.v_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=False)


class MLP(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.swiglu(x))

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.__dict__.get("gate_up_proj")  # decode copies fuse gate and up (ragkv.models.quant)
        if fused is not None:
            if hasattr(fused, "swiglu"):  # oneDNN's copy fuses silu and the product into the GEMMs
                return fused.swiglu(x)
            gate, up = fused(x).chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.silu(self.gate_proj(x)) * self.up_proj(x)  # SwiGLU

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + MLP(x); oneDNN's copy may run the whole MLP tile by tile (models/onednn.py)."""
        tiled = getattr(self.__dict__.get("gate_up_proj"), "mlp_add_to", None)
        out = tiled(self.down_proj, residual, x) if tiled is not None else None
        return out if out is not None else add_linear(self.down_proj, residual, self.swiglu(x))


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        self.self_attn = Attention(a)
        self.mlp = MLP(a)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def project_qkv(self, x: torch.Tensor, need_q: bool = True):
        """x: residual stream [B, T, H] -> q [B, Hq, T, D] (or None), raw k, v [B, Hkv, T, D]."""
        a, att = self.args, self.self_attn
        B, T, _ = x.shape
        h = self.input_layernorm(x)
        fused = att.__dict__.get("qkv_proj")  # decode copies fuse q, k and v (ragkv.models.quant)
        if fused is not None:
            q, k, v = fused(h).split([a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim,
                                      a.num_kv_heads * a.head_dim], dim=-1)
            return (q.view(B, T, a.num_heads, a.head_dim).transpose(1, 2) if need_q else None,
                    k.view(B, T, a.num_kv_heads, a.head_dim).transpose(1, 2),
                    v.view(B, T, a.num_kv_heads, a.head_dim).transpose(1, 2))
        q = att.q_proj(h).view(B, T, a.num_heads, a.head_dim).transpose(1, 2) if need_q else None
        k = att.k_proj(h).view(B, T, a.num_kv_heads, a.head_dim).transpose(1, 2)
        v = att.v_proj(h).view(B, T, a.num_kv_heads, a.head_dim).transpose(1, 2)
        return q, k, v

    def project_v(self, x: torch.Tensor) -> torch.Tensor:
        """Values only (CacheBlend's deviation check needs no Q or K)."""
        a = self.args
        B, T, _ = x.shape
        return self.self_attn.v_proj(self.input_layernorm(x)).view(B, T, a.num_kv_heads, a.head_dim).transpose(1, 2)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """x: [B, T, H] residual; attn: [B, Hq, T, D] attention output -> next residual stream."""
        B, T, _ = x.shape
        x = add_linear(self.self_attn.o_proj, x, attn.transpose(1, 2).reshape(B, T, -1))
        return self.mlp.add_to(x, self.post_attention_layernorm(x))


class Inner(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(a) for _ in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class Transformer(nn.Module):
    """Causal LM; parameter names match Hugging Face's *ForCausalLM so weights load without renaming."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        self.model = Inner(a)
        self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        self.rotary: RotaryTable | None = None  # built after weights are on their device

    def setup_rope(self) -> None:
        self.rotary = RotaryTable(self.args.rope, device=self.model.embed_tokens.weight.device)

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for positions [T] ([T, D]) or per row [B, T] ([B, 1, T, D], broadcast over heads)."""
        cos, sin = self.rotary.lookup(positions)
        if positions.dim() == 2:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return cos, sin

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate q or raw k [B, H, T, D] to integer positions (fp32 math, cast once)."""
        return apply_rope(x, *self.rope_tables(positions))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(x)).float()

    def causal_forward(self, ids: torch.Tensor, positions: torch.Tensor | None = None, cache=None,
                       mask: torch.Tensor | None = None) -> Forward:
        """The plain causal forward of ids [B, T] over `cache` (a KVCache, or None), not yet run; the caller commits
        the T new rows to the cache once it has (`forward` runs it alone; a server step runs it with others)."""
        past = cache.length if cache is not None else 0
        if positions is None:
            positions = torch.arange(past, past + ids.shape[1], device=ids.device)
        return Forward(self, self.embed(ids), CausalPlan(positions, cache, mask, self.args.sliding_window))

    def forward(self, ids: torch.Tensor, positions: torch.Tensor | None = None, cache=None,
                mask: torch.Tensor | None = None, all_logits: bool = False, hidden: bool = False) -> torch.Tensor:
        """Plain causal forward of ids [B, T], appending to `cache` (a KVCache) when given.

        Without a mask, each new token attends to the whole cache and causally to the new tokens.
        Returns logits [B, T, V] (all_logits) or [B, 1, V] for the last token; with `hidden`, the last layer's
        output [B, T, H] before the final norm (`logits(x)` turns any rows of it into logits).
        """
        x = self.causal_forward(ids, positions, cache, mask).run()
        if cache is not None:
            cache.commit(ids.shape[1])
        if hidden:
            return x
        return self.logits(x if all_logits else x[:, -1:])
