"""RMSNorm in one pass on the CPU (Zhang & Sennrich 2019, eq. 4: x / RMS(x) * g), bf16 or fp32, for the rows of a
decode step or a prefill.

torch's `F.rms_norm` on the CPU is a composite of seven ops (pow, mean, add, rsqrt, mul, the cast, the weight's
product): ~28 us a call at one row, 49 calls a decode step of a 24-layer model (~1.4 ms of a 23 ms step on a Zen 5).
This pass reads each row once: the sum of squares in fp32, then x * (1 / RMS) * g in fp32, rounded to x's dtype
once, as torch's op computes it (bf16 rows on AVX-512 BF16: 16 lanes at a time, rounded by the CPU's own bf16
conversion). Its sum runs in another order than torch's reduction, so a row's scale may differ in its last bit:
results equal torch's to one rounding, most of them bitwise (tests/test_norm_kernel.py). Where it
cannot be built (or RAGKV_NO_CPP_KERNELS=1), `rms_norm_pass` returns None and the model keeps torch's op.
"""

from __future__ import annotations

import torch

from ragkv.ops.cpp_build import SCALAR_IO, WIDEN_BF16_AVX512, LazyExtension
from ragkv.ops.trace import traced

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>

""" + SCALAR_IO + r"""
template <typename T>
static void run(const torch::Tensor& x, const torch::Tensor& w, double eps, torch::Tensor& out) {
  const int64_t D = x.size(-1), R = x.numel() / D;
  const T* xd = x.data_ptr<T>();
  const T* wd = w.data_ptr<T>();
  T* od = out.data_ptr<T>();
  at::parallel_for(0, R, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const T* row = xd + r * D;
      float acc[16] = {0};  // 16 partial sums: the compiler keeps them in one vector register
      int64_t d = 0;
      for (; d + 16 <= D; d += 16)
        for (int j = 0; j < 16; ++j) { const float v = load(row + d + j); acc[j] += v * v; }
      float ss = 0.f;
      for (int j = 0; j < 16; ++j) ss += acc[j];
      for (; d < D; ++d) { const float v = load(row + d); ss += v * v; }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + static_cast<float>(eps));
      T* o = od + r * D;
      for (int64_t i = 0; i < D; ++i) store(o + i, load(row + i) * inv * load(wd + i));
    }
  });
}

#ifdef __AVX512BF16__
#include <immintrin.h>
""" + WIDEN_BF16_AVX512 + r"""
// bf16 rows of D % 16 == 0 on AVX-512 BF16: the same fp32 operations 16 lanes at a time (the scalar loop runs at
// ~2 G values/s, a tenth of what a prefill's 1,024 x 896 rows need to stay out of the profile), rounded by
// vcvtneps2bf16 (nearest even, as torch's cast)
static void run_bf16_avx512(const torch::Tensor& x, const torch::Tensor& w, double eps, torch::Tensor& out) {
  const int64_t D = x.size(-1), R = x.numel() / D;
  const at::BFloat16* xd = x.data_ptr<at::BFloat16>();
  const at::BFloat16* wd = w.data_ptr<at::BFloat16>();
  at::BFloat16* od = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, R, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const at::BFloat16* row = xd + r * D;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 v = widen(row + d);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
      }
      const float ss = _mm512_reduce_add_ps(acc);
      const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(ss / static_cast<float>(D) + static_cast<float>(eps)));
      at::BFloat16* o = od + r * D;
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 y = _mm512_mul_ps(_mm512_mul_ps(widen(row + d), inv), widen(wd + d));
        _mm256_storeu_si256((__m256i*)(o + d), (__m256i)_mm512_cvtneps_pbh(y));
      }
    }
  });
}
#endif

// x [..., D] contiguous, bf16 or fp32; w [D] of x's dtype
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && w.dim() == 1 && w.size(0) == x.size(-1), "x [..., D], w [D]");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "x and w of one dtype");
  auto out = torch::empty_like(x);
#ifdef __AVX512BF16__
  if (x.scalar_type() == at::kBFloat16 && x.size(-1) % 16 == 0) {
    run_bf16_avx512(x, w, eps, out);
    return out;
  }
#endif
  if (x.scalar_type() == at::kBFloat16) run<at::BFloat16>(x, w, eps, out);
  else if (x.scalar_type() == at::kFloat) run<float>(x, w, eps, out);
  else TORCH_CHECK(false, "bf16 or fp32 only");
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, py::call_guard<py::gil_scoped_release>());
}
"""

kernel = LazyExtension("ragkv_rms_norm_v3", _SOURCE, "RMSNorm pass")


def rms_norm_pass(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x normalized in one pass, or None where the pass does not apply (another device or dtype, a gradient wanted,
    a layout it does not take, or no kernel here): the caller then runs torch's op."""
    if (x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float32) or weight.dtype != x.dtype
            or not x.is_contiguous() or x.numel() == 0 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return None
    k = kernel()
    if k is None:
        return None
    with traced("ragkv::rms_norm"):
        return k.rms_norm(x, weight.contiguous(), eps)
