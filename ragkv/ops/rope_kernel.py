"""RoPE in one pass over q or raw k on the CPU: x [B, H, T, D] in bf16 or fp32, cos/sin fp32, the result in x's dtype.

torch's `xf * cos + rotate_half(xf) * sin` (ops/rope.py) makes six tensors per call (the fp32 copy, the two halves
concatenated, two products, their sum) and a seventh for the cast: at 1.3K tokens ~3% of a bf16 prefill, every layer,
and again for every stored block a later prompt re-rotates. This pass reads x once and writes the result once, with
the same fp32 operations in the same order and one rounding (no fused multiply-add: each product is rounded to fp32
as torch's are), so it returns torch's result bitwise (tests/test_rope_kernel.py). bf16 on AVX-512 BF16 runs 16
lanes at a time with the CPU's own rounding to bf16 (the scalar loop took ~0.5 ms a 1,024-token q); elsewhere plain
C++ that the compiler vectorizes; where it cannot be built (or RAGKV_NO_CPP_KERNELS=1) ops/rope.py keeps torch's ops.
"""

from __future__ import annotations

import torch

from ragkv.ops.cpp_build import SCALAR_IO, WIDEN_BF16_AVX512, LazyExtension
from ragkv.ops.trace import traced

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <cstring>
#include <type_traits>

""" + SCALAR_IO + r"""
// out = x * cos + rotate_half(x) * sin per row of D, in fp32: each product rounded before the sum (as torch's ops);
// c/s: the tables of the first half, c2/s2 of the second (the same where the caller holds half tables)
template <typename T>
__attribute__((optimize("fp-contract=off")))
static void rotate(const T* x, const float* c, const float* s, const float* c2, const float* s2, T* out, int64_t D) {
  int64_t half = D / 2;
  float xf[512];
  for (int64_t d = 0; d < D; ++d) xf[d] = load(x + d);
  for (int64_t d = 0; d < half; ++d) {
    float a = xf[d] * c[d], b = -xf[d + half] * s[d];
    store(out + d, a + b);
  }
  for (int64_t d = 0; d < half; ++d) {
    float a = xf[d + half] * c2[d], b = xf[d] * s2[d];
    store(out + d + half, a + b);
  }
}

#ifdef __AVX512BF16__
#include <immintrin.h>
""" + WIDEN_BF16_AVX512 + r"""
// bf16 rows with D % 32 == 0 on AVX-512 BF16: `rotate`'s operations 16 lanes at a time (products, then their sum: no
// fused multiply-add), rounded by vcvtneps2bf16 (nearest even, as torch's cast)
static inline void rotate_avx512(const at::BFloat16* x, const float* c, const float* s, const float* c2,
                                 const float* s2, at::BFloat16* out, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < half; d += 16) {
    const __m512 lo = widen(x + d), hi = widen(x + d + half);
    const __m512 a = _mm512_mul_ps(lo, _mm512_loadu_ps(c + d));
    const __m512 b = _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), hi), _mm512_loadu_ps(s + d));
    const __m512 e = _mm512_mul_ps(hi, _mm512_loadu_ps(c2 + d));
    const __m512 f = _mm512_mul_ps(lo, _mm512_loadu_ps(s2 + d));
    _mm256_storeu_si256((__m256i*)(out + d), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a, b)));
    _mm256_storeu_si256((__m256i*)(out + d + half), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(e, f)));
  }
}
#endif

// half: cos/sin hold one half of D (rows of RoPE's tables are two equal halves), read for both
template <typename T>
static void run(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& out,
                bool half) {
  int64_t B = x.size(0), H = x.size(1), L = x.size(2), D = x.size(3);
  const T* xd = x.data_ptr<T>();
  T* od = out.data_ptr<T>();
  const float* cd = cos.data_ptr<float>();
  const float* sd = sin.data_ptr<float>();
  auto xs = x.strides(), os = out.strides(), cs = cos.strides(), ss = sin.strides();
  // positions outer, heads inner: one position's cos/sin row serves all its heads from L1
  at::parallel_for(0, B * H * L, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      int64_t b = r / (H * L), t = (r / H) % L, h = r % H;
      const T* xr = xd + b * xs[0] + h * xs[1] + t * xs[2];
      const float* cr = cd + b * cs[0] + h * cs[1] + t * cs[2];
      const float* sr = sd + b * ss[0] + h * ss[1] + t * ss[2];
      T* orow = od + b * os[0] + h * os[1] + t * os[2];
      const float* cr2 = half ? cr : cr + D / 2;
      const float* sr2 = half ? sr : sr + D / 2;
#ifdef __AVX512BF16__
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        if (D % 32 == 0) { rotate_avx512(xr, cr, sr, cr2, sr2, orow, D); continue; }
      }
#endif
      rotate<T>(xr, cr, sr, cr2, sr2, orow, D);
    }
  });
}

// x [B, H, T, D] (bf16 or fp32, unit stride on D); cos, sin fp32 broadcastable to it (unit stride on D)
torch::Tensor apply(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1 && x.size(3) % 2 == 0 && x.size(3) <= 512, "x [B, H, T, D], D even");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat, "cos/sin in fp32");
  auto c = cos.expand(x.sizes()), s = sin.expand(x.sizes());
  TORCH_CHECK(c.stride(3) == 1 && s.stride(3) == 1, "cos/sin with unit stride on D");
  auto out = torch::empty_like(x);  // x's own layout (q is a view of the fused projection's [B, T, H, D])
  if (x.scalar_type() == at::kBFloat16) run<at::BFloat16>(x, c, s, out, false);
  else if (x.scalar_type() == at::kFloat) run<float>(x, c, s, out, false);
  else TORCH_CHECK(false, "bf16 or fp32 only");
  return out;
}

// out = rope(x) written into out (a view, e.g. a cache slot), both [B, H, T, D] of one dtype with unit stride on D;
// cos_h / sin_h fp32 [T, D/2]: the first halves of the tables (ops/rope.py `half_tables`)
void apply_half_into(torch::Tensor out, torch::Tensor x, torch::Tensor cos_h, torch::Tensor sin_h) {
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1 && x.size(3) % 2 == 0 && x.size(3) <= 512, "x [B, H, T, D], D even");
  TORCH_CHECK(out.sizes() == x.sizes() && out.stride(3) == 1 && out.scalar_type() == x.scalar_type(),
              "out: x's shape and dtype, unit stride on D");
  TORCH_CHECK(cos_h.scalar_type() == at::kFloat && sin_h.scalar_type() == at::kFloat, "cos/sin in fp32");
  auto half = x.sizes().vec();
  half[3] /= 2;
  auto c = cos_h.expand(half), s = sin_h.expand(half);
  TORCH_CHECK(c.stride(3) == 1 && s.stride(3) == 1, "cos/sin with unit stride on D");
  if (x.scalar_type() == at::kBFloat16) run<at::BFloat16>(x, c, s, out, true);
  else if (x.scalar_type() == at::kFloat) run<float>(x, c, s, out, true);
  else TORCH_CHECK(false, "bf16 or fp32 only");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("apply", &apply, py::call_guard<py::gil_scoped_release>());
  m.def("apply_half_into", &apply_half_into, py::call_guard<py::gil_scoped_release>());
}
"""

kernel = LazyExtension("ragkv_rope_v3", _SOURCE, "RoPE pass")


def broadcasts_to(shape: torch.Size, target: torch.Size) -> bool:
    """Whether `shape` broadcasts to `target` unchanged: `torch.broadcast_shapes(shape, target) == target`, without
    its Python reference path (~26 us a call, 1.2 ms of a one-stream decode step of the 0.5B at two calls a layer)."""
    return len(shape) <= len(target) and all(a in (1, b) for a, b in zip(reversed(shape), reversed(target)))


def _takes(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, table_shape) -> bool:
    """Whether the pass takes x [B, H, T, D] (CPU, bf16 or fp32, D even up to 512, unit stride on D, no gradient
    wanted) with fp32 tables of one shape that broadcasts to `table_shape`."""
    return (x.device.type == "cpu" and x.dim() == 4 and x.dtype in (torch.bfloat16, torch.float32)
            and cos.dtype == torch.float32 and sin.dtype == torch.float32 and x.shape[-1] % 2 == 0
            and x.shape[-1] <= 512 and x.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1
            and x.numel() > 0 and cos.shape == sin.shape and broadcasts_to(cos.shape, table_shape)
            and not (torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad)))


def rope_pass(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x rotated in one pass, or None where the pass does not apply (another device or dtype, a gradient wanted,
    shapes it does not take, or no kernel here): the caller then runs torch's ops."""
    k = kernel() if _takes(x, cos, sin, x.shape) else None
    if k is None:
        return None
    with traced("ragkv::rope"):
        return k.apply(x, cos, sin)


def rope_half_into(out: torch.Tensor, x: torch.Tensor, cos_h: torch.Tensor, sin_h: torch.Tensor) -> bool:
    """out = rope(x) written in place from half tables (ops/rope.py `rope_into`'s contract) in one pass; False
    (nothing written) where the pass does not apply: the caller then runs torch's ops."""
    takes = out.device.type == "cpu" and out.shape == x.shape and out.dtype == x.dtype and out.stride(-1) == 1 \
        and _takes(x, cos_h, sin_h, x.shape[:-1] + (x.shape[-1] // 2,))
    k = kernel() if takes else None
    if k is None:
        return False
    with traced("ragkv::rope"):
        k.apply_half_into(out, x, cos_h, sin_h)
    return True
