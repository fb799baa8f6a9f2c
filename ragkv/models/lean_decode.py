"""A decode step's layers as a dozen kernel calls each, for the common case of a bf16 decode copy on the CPU
(`--decode-weights onednn`, or `auto` where bf16 is fast) whose every sequence attends plainly over its own cache.

The general loop (models/loop.py `run_layers` with the decode plan) reaches the same kernels through module calls,
the kernel choice per product, the plan's hooks and the wrappers' checks: ~100 Python and view operations a layer,
~4 ms of a ~40 ms one-stream step of Qwen 0.5B on a Zen 4 (15% beside the kernels' time). Here the choices are read
once per row count and each layer calls the kernels directly, in the general loop's order on the same tensors: a
product on the packed kernel (ops/gemv_kernel) as a direct call, any other kernel the chooser picked for these rows
(AMX, oneDNN) through the linear's own method, as the general loop calls it. The results are the general loop's,
bitwise (tests/test_lean_decode.py).
"""

from __future__ import annotations

import torch

from ragkv.models.onednn import OneDnnLinear
from ragkv.ops import decode_kernel, gemv_kernel, int8_kernel, norm_kernel, rope_kernel
from ragkv.ops.attention import kernel_wins
from ragkv.ops.trace import traced


class LeanDecode:
    """The decode layers of one model (its decode copy), built by `lean_decode` where they apply."""

    def __init__(self, model, kernels: dict):
        a = model.args
        self.model, self.k = model, kernels
        self.heads, self.kv_heads, self.head_dim, self.eps = a.num_heads, a.num_kv_heads, a.head_dim, a.rms_norm_eps
        self.scale = 1.0 / a.head_dim ** 0.5
        # per layer: the norms' weights and the four joined products (q/k/v, output, gate/up, down)
        self.layers = [(layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                        layer.self_attn.__dict__["qkv_proj"], layer.self_attn.o_proj,
                        layer.mlp.__dict__["gate_up_proj"], layer.mlp.down_proj) for layer in model.layers]
        self._ops: dict[int, list] = {}
        self._probe = (torch.zeros(1, a.num_heads, 1, a.head_dim, dtype=torch.bfloat16),
                       torch.zeros(1, a.num_kv_heads, 1, a.head_dim, dtype=torch.bfloat16))

    def takes(self) -> bool:
        """Whether the general loop would attend through the C++ decode kernel (RAGKV_DECODE_ATTENTION may say
        otherwise at any time: asked every step)."""
        q, kv = self._probe
        return kernel_wins(q, kv, kv)

    def products(self, rows: int) -> list:
        """Per layer, the four products of a `rows`-row step as (q/k/v, residual + output, SwiGLU, residual + down)
        callables over [rows, features] tensors. The kernel choice is made with the decode copy, before any step:
        kept per row count."""
        got = self._ops.get(rows)
        if got is None:
            got = self._ops[rows] = [(_product(qkv, rows), _add_product(o, rows), _swiglu(gate_up, rows),
                                      _add_product(down, rows)) for _, _, qkv, o, gate_up, down in self.layers]
        return got

    def run(self, x: torch.Tensor, positions: torch.Tensor, caches: list, lengths: list[int]) -> torch.Tensor:
        """x [B, 1, H] embedded rows at positions [B, 1]; caches[b]: a KVCache with room for one more row after
        lengths[b] (its keys / values [1, Hkv, capacity, D] per layer) -> the residual stream after the last layer
        [B, 1, H]. Writes each layer's new K/V row at lengths[b], as the general loop does."""
        B, H = x.shape[0], x.shape[-1]
        Hq, Hkv, D, eps = self.heads, self.kv_heads, self.head_dim, self.eps
        rms, rope = self.k["norm"].rms_norm, self.k["rope"].apply
        attend = self.k["attention"].append_attention_many
        cos, sin = self.model.rope_tables(positions)
        x = x.reshape(B, H)
        q_end, k_end = Hq * D, (Hq + Hkv) * D
        for i, ((w_in, w_post, *_), (qkv, o_add, swiglu, down_add)) in enumerate(zip(self.layers,
                                                                                     self.products(B))):
            with traced("ragkv::rms_norm"):
                h = rms(x, w_in, eps)
            y = qkv(h)
            with traced("ragkv::rope"):
                q = rope(y[:, :q_end].view(B, 1, Hq, D).transpose(1, 2), cos, sin)
                k = rope(y[:, q_end:k_end].view(B, 1, Hkv, D).transpose(1, 2), cos, sin)
            with traced("ragkv::decode_attention"):
                a = attend(q.reshape(B, Hq, D), k[:, :, 0], y[:, k_end:].view(B, Hkv, D),
                           [c.keys[i] for c in caches], [c.values[i] for c in caches], lengths, self.scale)
            x = o_add(x, a.to(x.dtype).view(B, Hq * D))
            with traced("ragkv::rms_norm"):
                h = rms(x, w_post, eps)
            x = down_add(x, swiglu(h))
        return x.view(B, 1, H)


def _packed_call(linear: OneDnnLinear):
    gemv, pack = gemv_kernel.kernel().gemv, (*linear.gemv, linear.out_features)

    def call(h: torch.Tensor) -> torch.Tensor:
        with traced("ragkv::gemv"):
            return gemv(h, *pack)
    return call


def _product(linear: OneDnnLinear, rows: int):
    """h [rows, K] -> h W^T (+ b) [rows, N]: the packed kernel directly where chosen, else the linear itself (over
    [rows, 1, K], the shape the general loop hands it)."""
    if linear.kernel_for_rows(rows) == "gemv":
        return _packed_call(linear)
    return lambda h: linear(h.unsqueeze(1)).squeeze(1)


def _add_product(linear: OneDnnLinear, rows: int):
    """(x, h) -> x + h W^T, as models/llama.py `add_linear` computes it (the linear's `add_to`: a kernel other than
    the packed one may add the residual inside its product)."""
    if linear.kernel_for_rows(rows) == "gemv":
        product = _packed_call(linear)
        return lambda x, h: x + product(h)
    return lambda x, h: linear.add_to(x.unsqueeze(1), h.unsqueeze(1)).squeeze(1)


def _swiglu(gate_up: OneDnnLinear, rows: int):
    """h [rows, K] -> silu(gate) * up [rows, I]: the joined product on the packed kernel then one pass, or the
    linear's own `swiglu` (the general loop's MLP calls it)."""
    if gate_up.kernel_for_rows(rows) != "gemv":
        return lambda h: gate_up.swiglu(h.unsqueeze(1)).squeeze(1)
    product, silu_mul, half = _packed_call(gate_up), int8_kernel.kernel().silu_mul, gate_up.out_features // 2

    def call(h: torch.Tensor) -> torch.Tensor:
        y = product(h)
        with traced("ragkv::silu_mul"):
            return silu_mul(y[:, :half], y[:, half:])
    return call


def lean_decode(model) -> LeanDecode | None:
    """The model's lean decode layers (built once, kept on the model), or None where they cannot apply: not a bf16
    decode copy on the CPU whose q/k/v, output, gate/up and down products are `OneDnnLinear`s (the MLP's SwiGLU
    through the copy's own method), or a kernel not built here (`takes` says, step by step, whether they apply)."""
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
    kernels = {"norm": norm_kernel.kernel(), "rope": rope_kernel.kernel(), "attention": decode_kernel.kernel()}
    if any(k is None for k in kernels.values()) or gemv_kernel.kernel() is None or int8_kernel.kernel() is None:
        return None  # the products' packed kernel and the SwiGLU pass are fetched per product (`_packed_call`)
    for layer in model.layers:
        att, mlp = layer.self_attn, layer.mlp
        mods = (att.__dict__.get("qkv_proj"), att.o_proj, mlp.__dict__.get("gate_up_proj"), mlp.down_proj)
        if not all(isinstance(m, OneDnnLinear) and m.weight.dtype == torch.bfloat16 for m in mods) \
                or len(mods[2].parts) != 2 \
                or any(n.weight.dtype != torch.bfloat16 for n in (layer.input_layernorm, layer.post_attention_layernorm)):
            return None
    return LeanDecode(model, kernels)
