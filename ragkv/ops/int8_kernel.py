"""The passes around w8a8's int8 product (models/quant.py), fused: each row of activations quantized to int8 in one
pass, and the int32 sums scaled back (and, for SwiGLU's gate/up product, silu(gate) * up) in one pass to bf16 or fp32.

In torch these were five to seven passes over [rows, outputs] tensors: a 1K-token w8a8 prefill of Qwen 0.5B spent
0.9 s of 5.2 s in `copy_`, `mul_`, `silu` and `mul` around 1.9 s of int8 products (1 thread, Zen 4). Plain C++
with OpenMP, vectorized by the compiler for this CPU; the same arithmetic as the torch path in the same order
(sum * row scale * column scale + bias, in fp32; rounding half to even), so the two agree to the output's rounding.
Built on first use; with RAGKV_NO_CPP_KERNELS=1 or without a compiler `kernel()` is None and callers keep torch.
"""

from __future__ import annotations

import torch

from ragkv.ops.cpp_build import LazyExtension

_SOURCE = r"""
#include <torch/extension.h>
#include <cmath>
#include <cstdint>
#include <cstring>

static inline float to_f(const at::BFloat16 v) { return static_cast<float>(v); }
static inline float to_f(const float v) { return v; }

// fp32 -> bf16, rounding to nearest even (torch's conversion); NaN stays NaN
static inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

template <typename T>
static void quantize_impl(const T* x, int64_t M, int64_t K, int64_t ld, int8_t* q, float* s) {
#pragma omp parallel for schedule(static)
  for (int64_t m = 0; m < M; ++m) {
    const T* row = x + m * ld;
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::fmax(amax, std::fabs(to_f(row[k])));
    float scale = std::fmax(amax / 127.f, 1e-12f);
    s[m] = scale;
    int8_t* out = q + m * K;
    for (int64_t k = 0; k < K; ++k) out[k] = static_cast<int8_t>(std::nearbyint(to_f(row[k]) / scale));
  }
}

// x [M, K] bf16 or fp32 (rows may be strided) -> (int8 [M, K], fp32 scales [M])
std::vector<torch::Tensor> quantize_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with contiguous rows");
  int64_t M = x.size(0), K = x.size(1);
  auto q = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto s = torch::empty({M}, x.options().dtype(torch::kFloat32));
  if (x.scalar_type() == at::kBFloat16)
    quantize_impl(x.data_ptr<at::BFloat16>(), M, K, x.stride(0), q.data_ptr<int8_t>(), s.data_ptr<float>());
  else if (x.scalar_type() == at::kFloat)
    quantize_impl(x.data_ptr<float>(), M, K, x.stride(0), q.data_ptr<int8_t>(), s.data_ptr<float>());
  else
    TORCH_CHECK(false, "x must be bf16 or fp32");
  return {q, s};
}

// y int32 [M, N] -> y * xs[m] * ws[n] (+ bias[n]) as bf16 or fp32 [M, N]; `swiglu`: N = 2I, the output [M, I] is
// silu(gate) * up with gate the first I columns and up the last I (both scaled first)
torch::Tensor dequantize(torch::Tensor y, torch::Tensor xs, torch::Tensor ws, torch::Tensor bias, bool to_bf16,
                         bool swiglu) {
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.scalar_type() == at::kInt, "y must be contiguous int32 [M, N]");
  int64_t M = y.size(0), N = y.size(1), O = swiglu ? N / 2 : N;
  TORCH_CHECK(!swiglu || N % 2 == 0, "swiglu needs an even number of columns");
  TORCH_CHECK(xs.numel() == M && ws.numel() == N, "one scale per row and per column");
  TORCH_CHECK(bias.numel() == 0 || bias.numel() == N, "bias must have one value per column");
  auto out = torch::empty({M, O}, y.options().dtype(to_bf16 ? torch::kBFloat16 : torch::kFloat32));
  const int32_t* yp = y.data_ptr<int32_t>();
  const float* xp = xs.data_ptr<float>();
  const float* wp = ws.data_ptr<float>();
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  uint16_t* ob = to_bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr;
  float* of = to_bf16 ? nullptr : out.data_ptr<float>();
#pragma omp parallel for schedule(static)
  for (int64_t m = 0; m < M; ++m) {
    const int32_t* row = yp + m * N;
    const float xsm = xp[m];
    for (int64_t n = 0; n < O; ++n) {
      float v = static_cast<float>(row[n]) * xsm * wp[n];
      if (bp) v += bp[n];
      if (swiglu) {
        float u = static_cast<float>(row[n + O]) * xsm * wp[n + O];
        if (bp) u += bp[n + O];
        v = v / (1.f + std::exp(-v)) * u;
      }
      if (to_bf16) ob[m * O + n] = bf16_bits(v);
      else of[m * O + n] = v;
    }
  }
  return out;
}

// the GIL is released while a kernel runs (the server's HTTP thread streams meanwhile)
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_rows", &quantize_rows, py::call_guard<py::gil_scoped_release>());
  m.def("dequantize", &dequantize, py::call_guard<py::gil_scoped_release>());
}
"""

_NAME = "ragkv_int8_passes_v1"
kernel = LazyExtension(_NAME, _SOURCE, "int8 quantize/dequantize passes",
                       needs=lambda: torch.backends.mkldnn.is_available())


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], fp32 scales [M]): each row symmetric, max |x| -> 127 (rounding half to even)."""
    k = kernel() if x.is_cpu and x.dtype in (torch.bfloat16, torch.float32) else None
    if k is not None:
        return tuple(k.quantize_rows(x if x.stride(-1) == 1 else x.contiguous()))
    xf = x.float()
    scales = (xf.abs().amax(dim=1) / 127).clamp(min=1e-12)
    return (xf / scales[:, None]).round_().to(torch.int8), scales


def dequantize(sums: torch.Tensor, xs: torch.Tensor, ws: torch.Tensor, bias: torch.Tensor | None,
               dtype: torch.dtype, swiglu: bool = False) -> torch.Tensor:
    """int32 sums [M, N] -> sums * xs[m] * ws[n] (+ bias) in `dtype` (bf16 or fp32; fp32 arithmetic); `swiglu`:
    silu(gate) * up of the halves [M, N/2] (gate first)."""
    k = kernel() if sums.is_cpu and dtype in (torch.bfloat16, torch.float32) else None
    if k is not None:
        empty = torch.empty(0, dtype=torch.float32)
        return k.dequantize(sums.contiguous(), xs, ws, bias if bias is not None else empty, dtype == torch.bfloat16,
                            swiglu)
    y = sums.float().mul_(xs[:, None]).mul_(ws)
    if bias is not None:
        y = y.add_(bias)
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate) * up
    return y.to(dtype)
