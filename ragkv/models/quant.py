"""Weight-only quantized copies of a model for decoding (prefill keeps the exact weights).

Decode on a CPU reads every weight once per step, so its speed is the weights' bytes over memory bandwidth
(measured: fp32 SmolLM2 decode spends 80% of a step in matmuls at ~10 GB/s). A decode copy with int8
(per output channel) or int4 (groups of 32 along K, asymmetric, llama.cpp Q4_1's layout) weights reads 4x or
8x fewer bytes through torch's CPU weight-only kernels, which take bf16 activations. The copy shares the
embedding and norms with the exact model; only the linear layers are packed. It changes numerics: `ragkv bench
decode` prints the fidelity cost (KL and top-1 against the exact path).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ragkv.errors import InvalidRequestError

DECODE_WEIGHTS = ("exact", "int8", "int4")
INT4_GROUP = 32


def _int8_pack(w: torch.Tensor):
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale.to(torch.bfloat16)


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
    """y = x W^T (+ b) with W stored as int8 or int4; computed with bf16 activations, returned in x's dtype."""

    def __init__(self, linear: nn.Linear | list[nn.Linear], kind: str):
        """Several linears reading the same input are packed as one (outputs concatenated): one matmul."""
        super().__init__()
        parts = linear if isinstance(linear, list) else [linear]
        w = torch.cat([m.weight.detach() for m in parts]).float()
        self.out_features, self.in_features = w.shape
        self.kind = kind if not (kind == "int4" and self.in_features % INT4_GROUP) else "int8"
        self.bias = None if parts[0].bias is None else torch.cat([m.bias.detach() for m in parts])
        if self.kind == "int4":
            packed, sz = _int4_pack(w, INT4_GROUP)
        else:
            packed, sz = _int8_pack(w)
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales", sz, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if self.kind == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, INT4_GROUP, self.scales)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.packed, self.scales)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y


def _swap_linears(module: nn.Module, kind: str) -> nn.Module:
    """A shallow copy of `module` whose nn.Linear children (at any depth) are packed; the rest is shared.
    q/k/v and gate/up are packed once each, fused, as plain attributes read by project_qkv / MLP.forward."""
    new = copy.copy(module)
    new._modules = {}
    for name, child in module._modules.items():
        if name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            new._modules[name] = None  # packed inside qkv_proj / gate_up_proj below
        elif isinstance(child, nn.Linear):
            new._modules[name] = PackedLinear(child, kind)
        else:
            new._modules[name] = _swap_linears(child, kind)
    if "q_proj" in module._modules:
        new.__dict__["qkv_proj"] = PackedLinear([module.q_proj, module.k_proj, module.v_proj], kind)
    if "gate_proj" in module._modules:
        new.__dict__["gate_up_proj"] = PackedLinear([module.gate_proj, module.up_proj], kind)
    return new


def decode_copy(model, kind: str):
    """`model` itself for "exact"; otherwise a copy with weight-only quantized linears (CPU only)."""
    if kind not in DECODE_WEIGHTS:
        raise InvalidRequestError(f"unknown decode weights {kind!r}; choose one of {', '.join(DECODE_WEIGHTS)}")
    if kind == "exact":
        return model
    if model.device.type != "cpu":
        raise InvalidRequestError(f"--decode-weights {kind} uses torch's CPU kernels; use 'exact' on "
                                  f"{model.device.type}")
    with torch.no_grad():
        return _swap_linears(model, kind)
