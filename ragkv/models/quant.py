"""Decode copies of a model's linears: weight-only quantized, or exact and transposed (prefill keeps the model's).

Decode on a CPU reads every weight once a step. `int8` (per output channel) and `int4` (groups of 32 along K, Q4_1's
layout) read 4x / 8x fewer bytes via torch's weight-only kernels, changing numerics (`ragkv bench decode` prints the
cost); `transposed` adds an [in, out] copy of the wide linears (MKL's batch-1 matmul read it ~2x faster, Zen 3 fp32).

`onednn` runs every linear through oneDNN's kernel (vLLM's CPU backend's). fp32: on the model's own weights in place
(2-core Zen 3: 1.3-2.4x MKL's rate at 1-46 rows, docs/results/serve_vllm/s23); q/k/v and gate/up share one buffer
each. bf16 on a CPU that multiplies bf16 natively (`bf16_matrix_units`): many rows through oneDNN on the model's
weights, few rows through ragkv's bf16 kernels (gemv_kernel, amx_kernel) on a packed copy (docs/results/cpu_bf16.md);
which kernel takes which row class is measured per machine (`choose_kernels`). Exact copies serve every forward: a
long fp32 prompt runs in forwards of FEW_ROWS rows (`forward_rows`; docs/results/serve_vllm/s22). `auto` (the CLI's
default) picks `onednn` where it applies.

`w8a8` changes prefill too: every linear but down_proj holds int8 weights, and many rows quantize their activations
per row (symmetric, dynamic) and multiply in int32 (`torch._int_mm`: VNNI / AMX-INT8; ~2x bf16's rate on a Zen 4,
741 vs 350 GOP/s at [1329, 896] x [896, 4864]); few rows multiply the int8 weights with bf16 activations. down_proj
stays exact: its input carries the MLP's massive activations (Sun et al. 2024; Qwen 0.5B first-token KL 0.008
quantized, 0.0035 not). Replies say so (`fidelity.decode_weights: "w8a8"`); its KV is keyed apart from the exact one.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ragkv.errors import InvalidRequestError
from ragkv.models.onednn import FEW_ROWS, ExactCopyLinear, OneDnnLinear, bf16_matrix_units, choose_kernels
from ragkv.ops import gemv_kernel
from ragkv.ops.int8_kernel import dequantize, quantize_rows
from ragkv.ops.kernel_choice import KernelChooser

DECODE_WEIGHTS = ("exact", "transposed", "onednn", "int8", "int4", "w8a8")
WEIGHT_CHOICES = ("auto",) + DECODE_WEIGHTS  # what the flag takes: `auto` is resolved per model and machine
EXACT_COPIES = ("transposed", "onednn")  # paths whose weights are the model's own: the same products
INEXACT_PREFILL = ("w8a8",)  # copies whose prefill, so the first token too, is not the exact weights'
PREFILL_COPIES = EXACT_COPIES + INEXACT_PREFILL  # copies every forward runs on, prefill included (Engine.forward_model)
INT4_GROUP = 32


def _int8_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: (round(w / scale) as int8, fp32 scale = max |w| / 127) for fp32 w [N, K];
    ragkv's product kernel packs the same (gemv_kernel.pack)."""
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def _int8_pack(w: torch.Tensor):
    q, scale = _int8_quantize(w)
    return q, scale.to(torch.bfloat16)


def _int4_pack(w: torch.Tensor, group: int):
    """Asymmetric 4-bit groups: w ~ (q - 8) * scale + zero with q in 0..15 (the kernel's convention)."""
    N, K = w.shape
    g = w.reshape(N, K // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).reshape(N, K)
    zeros = lo + 8 * scale
    scales_zeros = torch.stack([scale, zeros], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 8), scales_zeros  # [K/group, N, 2]


class PackedLinear(nn.Module):
    """y = x W^T (+ b) with W stored as int8 or int4; computed with bf16 activations, returned in x's dtype. int8 runs
    through ragkv's product kernel where it is built (AVX-512 BF16: ragkv.ops.gemv_kernel), else torch's."""

    def __init__(self, linear: nn.Linear | list[nn.Linear], kind: str):
        """Several linears reading the same input are packed as one (outputs concatenated): one matmul."""
        super().__init__()
        parts = linear if isinstance(linear, list) else [linear]
        w = torch.cat([m.weight.detach() for m in parts]).float()
        self.out_features, self.in_features = w.shape
        self.kind = kind if not (kind == "int4" and self.in_features % INT4_GROUP) else "int8"
        self.bias = None if parts[0].bias is None else torch.cat([m.bias.detach() for m in parts])
        self.gemv = None
        if self.kind == "int8" and gemv_kernel.kernel() is not None and self.in_features % 2 == 0 and w.is_cpu:
            # ragkv's kernel (AVX-512 BF16): the int8 weights at ~2x the rate of torch's int8 kernel (fp32 scales)
            self.gemv = gemv_kernel.pack(w, self.bias, int8=True)
            return
        if self.kind == "int4":
            packed, sz = _int4_pack(w, INT4_GROUP)
        else:
            packed, sz = _int8_pack(w)
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales", sz, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if self.gemv is not None:  # in slices of the kernel's rows: the same sums at any batch size
            step = gemv_kernel.MAX_ROWS
            y = torch.cat([gemv_kernel.gemv(x2[a:a + step], *self.gemv, self.out_features)
                           for a in range(0, x2.shape[0], step)])
            return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        if self.kind == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, INT4_GROUP, self.scales)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.packed, self.scales)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y


class Int8ProductLinear(nn.Module):
    """W8A8 (see the module docstring): y = x W^T (+ b) with W as int8 per output channel; many rows in int8 x int8
    (activations quantized per row), few rows through `PackedLinear("int8")`, on the same int8 weights."""

    def __init__(self, linear: nn.Linear | list[nn.Linear]):
        super().__init__()
        self.few = PackedLinear(linear, "int8")  # decode rows: bandwidth-bound, int8 activations would buy nothing
        w, bias = _joined(linear)
        self.out_features, self.in_features = w.shape
        q, self.scales = _int8_quantize(w.float())
        self.weight = getattr(self.few, "packed", q)  # [N, K] for oneDNN's int8 product (torch's int8 copy, if any)
        self.bias = None if bias is None else bias.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._product(x)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of joined gate/up linears: at many rows scaled back and combined in one pass."""
        if x.numel() > gemv_kernel.MAX_ROWS * self.in_features:
            return self._product(x, swiglu=True)
        gate, up = self(x).chunk(2, dim=-1)
        return nn.functional.silu(gate) * up

    def _product(self, x: torch.Tensor, swiglu: bool = False) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] <= gemv_kernel.MAX_ROWS:
            return self.few(x)
        xq, xs = quantize_rows(x2)
        y = int8_product(xq, xs, self.weight, self.scales, self.bias, x.dtype, swiglu)
        return y.reshape(*x.shape[:-1], y.shape[-1])


def int8_product(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype = torch.float32, swiglu: bool = False) -> torch.Tensor:
    """(xq * xs) (wq * ws)^T (+ bias) in `dtype` (fp32 arithmetic): the int32 sums through oneDNN's int8 kernel,
    then both scales in one pass (ragkv.ops.int8_kernel; `swiglu`: silu(gate) * up of the output's halves)."""
    return dequantize(torch._int_mm(xq, wq.t()), xs, ws, bias, dtype, swiglu)


def _joined(linear: nn.Linear | list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight and bias of one linear, or of several reading the same input as one (outputs concatenated)."""
    parts = linear if isinstance(linear, list) else [linear]
    w = torch.cat([m.weight.detach() for m in parts])
    return w, None if parts[0].bias is None else torch.cat([m.bias.detach() for m in parts])


class TransposedLinear(ExactCopyLinear):
    """y = x W^T (+ b) from an exact copy of W stored [in, out] (see the module docstring), in W's dtype."""

    def __init__(self, linear: nn.Linear | list[nn.Linear]):
        super().__init__(linear)
        w, self.bias = _joined(linear)
        self.register_buffer("wt", w.t().contiguous(), persistent=False)

    def few_rows(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.wt
        return y + self.bias if self.bias is not None else y


def _decode_linear(parts: nn.Linear | list[nn.Linear], kind: str) -> nn.Module | None:
    """The decode copy of one linear (or of several fused); None: keep the exact module (transposing a linear no
    wider than its input gains nothing)."""
    if kind == "onednn":
        return OneDnnLinear(parts)
    if kind == "w8a8":
        return Int8ProductLinear(parts)
    if kind != "transposed":
        return PackedLinear(parts, kind)
    linears = parts if isinstance(parts, list) else [parts]
    out = sum(m.out_features for m in linears)
    return TransposedLinear(parts) if out > linears[0].in_features else None


def _swap_linears(module: nn.Module, kind: str) -> nn.Module:
    """A shallow copy of `module` whose nn.Linear children (at any depth) are packed; the rest is shared.
    q/k/v and gate/up are packed once each, fused, as plain attributes read by project_qkv / MLP.forward."""
    new = copy.copy(module)
    new._modules = {}
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    inside_fused = set()  # the linears a fused copy computes
    for attr, names in fused.items():
        if names[0] in module._modules:
            copy_ = _decode_linear([module._modules[n] for n in names], kind)
            if copy_ is not None:
                new.__dict__[attr] = copy_
                inside_fused.update(names)
    for name, child in module._modules.items():
        if name in inside_fused:  # computed inside qkv_proj / gate_up_proj; kept for CacheBlend's project_v
            if kind == "w8a8" and name == "v_proj":  # the deviation check's values as qkv_proj computes them
                new._modules[name] = Int8ProductLinear(child)
            else:
                new._modules[name] = child if kind in EXACT_COPIES else None
        elif isinstance(child, nn.Linear):
            if kind == "w8a8" and name == "down_proj":  # exact: its input's massive activations (docstring)
                new._modules[name] = OneDnnLinear(child) if onednn_refusal(child.weight) is None else child
            else:
                new._modules[name] = _decode_linear(child, kind) or child
        else:
            new._modules[name] = _swap_linears(child, kind)
    return new


def onednn_refusal(model) -> str | None:
    """Why `onednn` cannot serve this model (or weight: anything with a device and a dtype) here, or None: fp32 on a
    CPU with oneDNN, or bf16 on one that multiplies bf16 natively."""
    if model.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return f"oneDNN's kernels are for the CPU (the model is on {model.device.type})"
    if model.dtype == torch.bfloat16 and not bf16_matrix_units():
        return "this CPU has neither AVX-512 BF16 nor AMX, so oneDNN's bf16 kernel is emulated: use --dtype float32"
    if model.dtype not in (torch.float32, torch.bfloat16):
        return f"oneDNN's kernels here take float32 or bfloat16, not {model.dtype}"
    return None


def resolve_decode_weights(kind: str, model) -> tuple[str, str]:
    """(weights, why): `auto` becomes `onednn` where it applies (`onednn_refusal`): fp32 on a CPU (no copy; on Zen 3
    every exact forward took 0.73-0.92x MKL's time), bf16 on AVX-512 BF16 or AMX (packed weights); else
    `exact`. Any other kind is itself."""
    if kind != "auto":
        return kind, "asked for"
    why_not = onednn_refusal(model)
    if why_not is not None:
        return "exact", f"auto: {why_not}"
    return "onednn", f"auto: {str(model.dtype).removeprefix('torch.')} on a CPU with oneDNN"


def decode_copy(model, kind: str, chooser: KernelChooser | None = None):
    """`model` itself for "exact"; otherwise a copy with transposed or weight-only quantized linears (CPU only)."""
    if kind not in DECODE_WEIGHTS:
        raise InvalidRequestError(f"unknown decode weights {kind!r}; choose one of {', '.join(DECODE_WEIGHTS)}")
    if kind == "exact":
        return model
    if model.device.type != "cpu":
        raise InvalidRequestError(f"--decode-weights {kind} uses torch's CPU kernels; use 'exact' on "
                                  f"{model.device.type}")
    if kind == "onednn" and onednn_refusal(model):
        raise InvalidRequestError(f"--decode-weights onednn: {onednn_refusal(model)}; or use 'exact' or "
                                  f"'transposed'")
    with torch.no_grad():
        copy_ = _swap_linears(model, kind)
        if kind == "onednn" and model.dtype == torch.bfloat16:
            choose_kernels(copy_, chooser or KernelChooser())
    if kind in EXACT_COPIES and model.dtype != torch.bfloat16:  # prefill_chunks runs a long prompt in forwards of
        copy_.forward_rows = FEW_ROWS  # this many rows on it; in bf16 oneDNN's GEMM needs no slicing, and the
        # slices' masked attention made a 1K-token prefill 1.09x one forward's time (Zen 4, docs/results/cpu_bf16)
    return copy_
