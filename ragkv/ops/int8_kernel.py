"""The passes around w8a8's int8 product (models/quant.py), fused: each row of activations quantized to int8 in one
pass, and the int32 sums scaled back (and, for SwiGLU's gate/up product, silu(gate) * up) in one pass to bf16 or fp32.
And the same silu(gate) * up pass over a bf16 gate/up product (`silu_mul`: the bf16 prefill's stock products).

In torch these were five to seven passes over [rows, outputs] tensors: a 1K-token w8a8 prefill of Qwen 0.5B spent
0.9 s of 5.2 s in `copy_`, `mul_`, `silu` and `mul` around 1.9 s of int8 products (1 thread, Zen 4). AVX-512
loops where the compiler targets AVX-512F (plain loops, which it left scalar, took 7 ms and 59 ms where these take
0.1 and 5.6 at 1024 x 896 and 1024 x 9728), plain C++ elsewhere; OpenMP over rows. The same arithmetic as the torch
path in the same order (sum * row scale * column scale + bias, in fp32; rounding half to even), so the two agree
bit for bit, except silu, whose e^x is a polynomial (relative error < 2e-7) where torch's is Sleef's.
Built on first use; with RAGKV_NO_CPP_KERNELS=1 or without a compiler `kernel()` is None and callers keep torch.
"""

from __future__ import annotations

import torch

from ragkv.ops.cpp_build import SILU_AVX512, LazyExtension
from ragkv.ops.trace import traced

_SOURCE = r"""
#include <torch/extension.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

static inline float to_f(const at::BFloat16 v) { return static_cast<float>(v); }
static inline float to_f(const float v) { return v; }

// fp32 -> bf16, rounding to nearest even (torch's conversion); NaN stays NaN
static inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#ifdef __AVX512F__
#include <immintrin.h>
// 16 values as fp32 from bf16 or fp32 memory; `k` masks a row's tail
static inline __m512 load16(const at::BFloat16* p, __mmask16 k) {
  __m256i h = _mm256_maskz_loadu_epi16(k, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512 load16(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
static inline __mmask16 tail(int64_t left) { return left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1); }
// fp32 -> bf16 bits, rounding to nearest even, NaN -> 0x7fc0 (bf16_bits on 16 lanes)
static inline __m256i bf16_16(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
}
""" + SILU_AVX512 + r"""#endif

template <typename T>
static void quantize_impl(const T* x, int64_t M, int64_t K, int64_t ld, int8_t* q, float* s) {
#pragma omp parallel for schedule(static)
  for (int64_t m = 0; m < M; ++m) {
    const T* row = x + m * ld;
    int8_t* out = q + m * K;
#ifdef __AVX512F__
    __m512 mx = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(load16(row + k, tail(K - k))));
    float scale = std::fmax(_mm512_reduce_max_ps(mx) / 127.f, 1e-12f);
    s[m] = scale;
    __m512 sv = _mm512_set1_ps(scale);
    for (int64_t k = 0; k < K; k += 16) {  // x / scale, rounded half to even, saturated to int8
      __mmask16 t = tail(K - k);
      __m512i qi = _mm512_cvt_roundps_epi32(_mm512_div_ps(load16(row + k, t), sv),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm_mask_storeu_epi8(out + k, t, _mm512_cvtsepi32_epi8(qi));
    }
#else
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::fmax(amax, std::fabs(to_f(row[k])));
    float scale = std::fmax(amax / 127.f, 1e-12f);
    s[m] = scale;
    for (int64_t k = 0; k < K; ++k) out[k] = static_cast<int8_t>(std::nearbyint(to_f(row[k]) / scale));
#endif
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

// e^x for x <= 0 in plain arithmetic the compiler vectorizes (std::exp stays scalar without -ffast-math):
// 2^(x log2 e) = 2^n 2^f, n the nearest integer, 2^f by its Taylor polynomial on [-0.5, 0.5] (error < 2e-7)
static inline float exp_nonpositive(float x) {
  float t = std::fmax(x * 1.4426950409f, -126.f);
  float n = std::floor(t + 0.5f);
  float f = t - n;
  float p = 1.5403530e-4f;
  p = p * f + 1.3333558e-3f;
  p = p * f + 9.6181291e-3f;
  p = p * f + 5.5504109e-2f;
  p = p * f + 2.4022651e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// y int32 [M, N] -> y * xs[m] * ws[n] (+ bias[n]) as bf16 or fp32 [M, N]; `swiglu`: N = 2I, the output [M, I] is
// silu(gate) * up with gate the first I columns and up the last I (both scaled first). Each row in a few simple
// loops over a buffer: branch-free inner loops, which the compiler vectorizes.
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
#pragma omp parallel
  {
#ifndef __AVX512F__
    std::vector<float> gbuf(O), ubuf(swiglu ? O : 0);
    float* __restrict g = gbuf.data();
    float* __restrict u = ubuf.data();
#endif
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m) {
      const int32_t* __restrict row = yp + m * N;
      const float xsm = xp[m];
#ifdef __AVX512F__
      const __m512 xv = _mm512_set1_ps(xsm);
      for (int64_t n = 0; n < O; n += 16) {
        __mmask16 t = tail(O - n);
        __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(t, row + n)), xv),
                                 _mm512_maskz_loadu_ps(t, wp + n));
        if (bp) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(t, bp + n));
        if (swiglu) {  // silu(v) * u
          __m512 u = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(t, row + O + n)), xv),
                                   _mm512_maskz_loadu_ps(t, wp + O + n));
          if (bp) u = _mm512_add_ps(u, _mm512_maskz_loadu_ps(t, bp + O + n));
          v = _mm512_mul_ps(silu16(v), u);
        }
        if (to_bf16) _mm256_mask_storeu_epi16(ob + m * O + n, t, bf16_16(v));
        else _mm512_mask_storeu_ps(of + m * O + n, t, v);
      }
#else
      for (int64_t n = 0; n < O; ++n) g[n] = static_cast<float>(row[n]) * xsm * wp[n];
      if (bp) for (int64_t n = 0; n < O; ++n) g[n] += bp[n];
      if (swiglu) {
        for (int64_t n = 0; n < O; ++n) u[n] = static_cast<float>(row[O + n]) * xsm * wp[O + n];
        if (bp) for (int64_t n = 0; n < O; ++n) u[n] += bp[O + n];
        for (int64_t n = 0; n < O; ++n) {  // silu(v) = v sigmoid(v), sigmoid from e^-|v| (no overflow)
          float v = g[n], e = exp_nonpositive(-std::fabs(v));
          float sig = (v >= 0.f ? 1.f : e) / (1.f + e);
          g[n] = v * sig * u[n];
        }
      }
      if (to_bf16) {
        uint16_t* __restrict dst = ob + m * O;
        for (int64_t n = 0; n < O; ++n) dst[n] = bf16_bits(g[n]);
      } else {
        std::memcpy(of + m * O, g, O * sizeof(float));
      }
#endif
    }
  }
  return out;
}

// SwiGLU's pointwise half: silu(gate) * up [M, I] in one pass from the gate and up products (two tensors, or the
// halves of one joined product: rows may be strided), in fp32, rounded to bf16 once (torch reads and writes [M, I]
// three times). AVX-512: the sigmoid's 1 / (1 + e) by rcp14 and one Newton step (relative error ~2^-28; as fast as
// the division on an AMX Xeon: the exponential bounds the pass).
torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up) {
  TORCH_CHECK(gate.dim() == 2 && up.sizes() == gate.sizes() && gate.scalar_type() == at::kBFloat16 &&
              up.scalar_type() == at::kBFloat16 && gate.stride(1) == 1 && up.stride(1) == 1,
              "gate and up must be bf16 [M, I] with contiguous rows");
  int64_t M = gate.size(0), O = gate.size(1), lg = gate.stride(0), lu = up.stride(0);
  auto out = torch::empty({M, O}, gate.options().memory_format(at::MemoryFormat::Contiguous));
  const at::BFloat16* gp = gate.data_ptr<at::BFloat16>();
  const at::BFloat16* upp = up.data_ptr<at::BFloat16>();
  uint16_t* ob = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
#pragma omp parallel for schedule(static)
  for (int64_t m = 0; m < M; ++m) {
    const at::BFloat16* grow = gp + m * lg;
    const at::BFloat16* urow = upp + m * lu;
#ifdef __AVX512F__
    for (int64_t n = 0; n < O; n += 16) {
      __mmask16 t = tail(O - n);
      __m512 v = load16(grow + n, t), u = load16(urow + n, t);
      _mm256_mask_storeu_epi16(ob + m * O + n, t, bf16_16(_mm512_mul_ps(silu16(v), u)));
    }
#else
    for (int64_t n = 0; n < O; ++n) {
      float v = to_f(grow[n]), e = exp_nonpositive(-std::fabs(v));
      ob[m * O + n] = bf16_bits(v * ((v >= 0.f ? 1.f : e) / (1.f + e)) * to_f(urow[n]));
    }
#endif
  }
  return out;
}

// the GIL is released while a kernel runs (the server's HTTP thread streams meanwhile)
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_rows", &quantize_rows, py::call_guard<py::gil_scoped_release>());
  m.def("dequantize", &dequantize, py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, py::call_guard<py::gil_scoped_release>());
}
"""

_NAME = "ragkv_int8_passes_v7"
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


def silu_mul(y: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of a bf16 [..., 2I] gate/up product in one pass (fp32 inside, bf16 out); None where the
    kernel is not built (callers keep torch's ops)."""
    if y.dtype != torch.bfloat16 or y.device.type != "cpu":
        return None
    y2 = y.reshape(-1, y.shape[-1]).contiguous()
    half = y.shape[-1] // 2
    out = silu_mul_pair(y2[:, :half], y2[:, half:])
    return None if out is None else out.reshape(*y.shape[:-1], half)


def silu_mul_pair(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of bf16 [M, I] gate and up products (rows contiguous, possibly strided) in one pass; None
    where the kernel is not built."""
    k = kernel()
    if k is None or gate.dtype != torch.bfloat16 or gate.device.type != "cpu":
        return None
    with traced("ragkv::silu_mul"):
        return k.silu_mul(gate, up)
