"""A decode step's layers as a dozen kernel calls each, for the common case of a bf16 model on the CPU whose every
product at this step's row count runs on ragkv's packed kernel (ops/gemv_kernel) and whose every sequence attends
plainly over its own cache.

The general loop (models/loop.py `run_layers` with the decode plan) reaches the same kernels through module calls,
the kernel choice per product, the plan's hooks and the wrappers' checks: ~100 Python and view operations a layer,
~4 ms of a ~40 ms one-stream step of Qwen 0.5B on a Zen 4 (15% beside the kernels' time). Here the checks run once per
model and row count, and each layer calls the kernels directly, in the general loop's order on the same tensors:
its results are the general loop's, bitwise (tests/test_lean_decode.py).
"""

from __future__ import annotations

import torch

from ragkv.models.onednn import OneDnnLinear
from ragkv.ops import decode_kernel, gemv_kernel, int8_kernel, norm_kernel, rope_kernel
from ragkv.ops.attention import kernel_wins
from ragkv.ops.trace import traced


def _packed(linear) -> tuple | None:
    """(packed, scales, bias, out_features) of an exact decode copy's linear with a packed copy, else None."""
    if not isinstance(linear, OneDnnLinear) or linear.gemv is None:
        return None
    return (*linear.gemv, linear.out_features)


class LeanDecode:
    """The decode layers of one model (its decode copy), built by `lean_decode` where they apply."""

    def __init__(self, model, kernels: dict):
        a = model.args
        self.model, self.k = model, kernels
        self.heads, self.kv_heads, self.head_dim, self.eps = a.num_heads, a.num_kv_heads, a.head_dim, a.rms_norm_eps
        self.scale = 1.0 / a.head_dim ** 0.5
        self.linears = []  # per layer: the four joined products' modules (their kernel choice, read per row count)
        self.layers = []   # per layer: the norms' weights and the four products' packed copies
        for layer in model.layers:
            att, mlp = layer.self_attn, layer.mlp
            mods = (att.__dict__["qkv_proj"], att.o_proj, mlp.__dict__["gate_up_proj"], mlp.down_proj)
            self.linears.append(mods)
            self.layers.append((layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                                *(_packed(m) for m in mods)))
        self._takes: dict[int, bool] = {}
        self._probe = (torch.zeros(1, a.num_heads, 1, a.head_dim, dtype=torch.bfloat16),
                       torch.zeros(1, a.num_kv_heads, 1, a.head_dim, dtype=torch.bfloat16))

    def takes(self, rows: int) -> bool:
        """Whether the general loop would run a `rows`-row step on these kernels: every product on the packed one
        (the choice is made with the decode copy, before any step: kept per row count) and the decode attention on
        the C++ kernel (RAGKV_DECODE_ATTENTION may say otherwise at any time: asked every step)."""
        got = self._takes.get(rows)
        if got is None:
            got = self._takes[rows] = all(m.kernel_for_rows(rows) == "gemv" for mods in self.linears for m in mods)
        q, kv = self._probe
        return got and kernel_wins(q, kv, kv)

    def run(self, x: torch.Tensor, positions: torch.Tensor, caches: list, lengths: list[int]) -> torch.Tensor:
        """x [B, 1, H] embedded rows at positions [B, 1]; caches[b]: a KVCache with room for one more row after
        lengths[b] (its keys / values [1, Hkv, capacity, D] per layer) -> the residual stream after the last layer
        [B, 1, H]. Writes each layer's new K/V row at lengths[b], as the general loop does."""
        B, H = x.shape[0], x.shape[-1]
        Hq, Hkv, D, eps = self.heads, self.kv_heads, self.head_dim, self.eps
        gemv, rms, rope = self.k["gemv"].gemv, self.k["norm"].rms_norm, self.k["rope"].apply
        attend, silu_mul = self.k["attention"].append_attention_many, self.k["silu"].silu_mul
        cos, sin = self.model.rope_tables(positions)
        x = x.reshape(B, H)
        q_end, k_end, half = Hq * D, (Hq + Hkv) * D, self.layers[0][4][-1] // 2
        for i, (w_in, w_post, qkv, o, gate_up, down) in enumerate(self.layers):
            with traced("ragkv::rms_norm"):
                h = rms(x, w_in, eps)
            with traced("ragkv::gemv"):
                y = gemv(h, *qkv)
            with traced("ragkv::rope"):
                q = rope(y[:, :q_end].view(B, 1, Hq, D).transpose(1, 2), cos, sin)
                k = rope(y[:, q_end:k_end].view(B, 1, Hkv, D).transpose(1, 2), cos, sin)
            with traced("ragkv::decode_attention"):
                a = attend(q.reshape(B, Hq, D), k[:, :, 0], y[:, k_end:].view(B, Hkv, D),
                           [c.keys[i] for c in caches], [c.values[i] for c in caches], lengths, self.scale)
            with traced("ragkv::gemv"):
                x = x + gemv(a.to(x.dtype).view(B, Hq * D), *o)
            with traced("ragkv::rms_norm"):
                h = rms(x, w_post, eps)
            with traced("ragkv::gemv"):
                y = gemv(h, *gate_up)
            with traced("ragkv::silu_mul"):
                s = silu_mul(y[:, :half], y[:, half:])
            with traced("ragkv::gemv"):
                x = x + gemv(s, *down)
        return x.view(B, 1, H)


def lean_decode(model) -> LeanDecode | None:
    """The model's lean decode layers (built once, kept on the model), or None where they cannot apply: not a bf16
    decode copy on the CPU with every product packed, or a kernel not built here (`takes` says, step by step,
    whether they apply)."""
    got = model.__dict__.get("_lean_decode", False)
    if got is not False:
        return got
    model.__dict__["_lean_decode"] = got = _build(model)
    return got


def _build(model) -> LeanDecode | None:
    a = model.args
    w = model.model.embed_tokens.weight
    if w.device.type != "cpu" or w.dtype != torch.bfloat16 or a.num_heads % a.num_kv_heads or a.head_dim % 2 \
            or a.head_dim > 512:  # RoPE's pass takes even head sizes up to 512
        return None
    kernels = {"gemv": gemv_kernel.kernel(), "norm": norm_kernel.kernel(), "rope": rope_kernel.kernel(),
               "attention": decode_kernel.kernel(), "silu": int8_kernel.kernel()}
    if any(k is None for k in kernels.values()):
        return None
    for layer in model.layers:
        att, mlp = layer.self_attn, layer.mlp
        qkv, gate_up = att.__dict__.get("qkv_proj"), mlp.__dict__.get("gate_up_proj")
        if qkv is None or gate_up is None or len(getattr(gate_up, "parts", ())) != 2 \
                or any(_packed(m) is None for m in (qkv, att.o_proj, gate_up, mlp.down_proj)) \
                or any(n.weight.dtype != torch.bfloat16 for n in (layer.input_layernorm, layer.post_attention_layernorm)):
            return None
    return LeanDecode(model, kernels)
