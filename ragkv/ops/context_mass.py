"""How much attention a query gives each context key, in one pass on the CPU: alpha(t) = sum over query heads h and
query rows i of softmax_t(q_hi . k_t / sqrt(d)) over the first N keys only (ProphetKV's stage-1 score, arXiv
2602.02579; engine/recompute/query.py sums it over layers).

torch computes it as a product into an fp32 [heads, rows, N] buffer, then a row max, a subtraction, a clamp, an exp,
the rows' sums and a second product: ~26 ms of the 0.5B's ~113 ms stage 1 at 46 query rows over 1.3K context keys
(AMX Xeon), most of it the fp32 product and the passes over the buffer. This pass takes each query row once: its
scores against the N keys as bf16 dot products summed in fp32 (vdpbf16ps: the products are exact, so the scores equal
the fp32 product's to summation order), the row's max, 2^x by the shared polynomial (relative error < 2e-7), and the
row's probabilities added into the thread's column sums. Built where the compiler targets AVX-512 BF16; elsewhere, and
for fp32 tensors, `context_mass` returns None and the recorder keeps torch's ops.
"""

from __future__ import annotations

import torch

from ragkv.ops.cpp_build import EXP2_NEG_AVX512, LazyExtension
from ragkv.ops.trace import traced

_SOURCE = r"""
#include <torch/extension.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <vector>

#ifdef __AVX512BF16__
#include <immintrin.h>
""" + EXP2_NEG_AVX512 + r"""
// q [Hq, Tq, D] bf16 contiguous, k [Hkv, rows >= N, D] bf16 (rows contiguous, heads `head_stride` elements apart),
// D a multiple of 32 -> [N] fp32: the sum over query heads and rows of each row's softmax over the first N keys.
// Each KV head's first N keys are laid out as [D/2 pairs][N][2] (32-bit words), so 16 keys' scores are one vector:
// per pair, one load of 16 keys and a broadcast of the row's pair into vdpbf16ps, no horizontal sums.
torch::Tensor context_mass(torch::Tensor q, torch::Tensor k, int64_t N, int64_t head_stride, double scale) {
  const int64_t Hq = q.size(0), Tq = q.size(1), D = q.size(2), Hkv = k.size(0), groups = Hq / Hkv, R = Hq * Tq;
  const int64_t P = D / 2, Np = (N + 63) / 64 * 64;  // four blocks of 16 keys a pass
  const float to_log2 = static_cast<float>(scale) * 1.4426950409f;  // scores in log2 units: exp(x) = 2^(x log2 e)
  const uint32_t* qp = reinterpret_cast<const uint32_t*>(q.data_ptr<at::BFloat16>());
  const uint32_t* kp = reinterpret_cast<const uint32_t*>(k.data_ptr<at::BFloat16>());
  std::vector<uint32_t> pairs(Hkv * P * Np, 0);  // zero keys past N: their scores are masked off
  // 16 keys at a time (2 KB of K, in L1), each pair's 16 words written as one 64-byte run
  #pragma omp parallel for num_threads(at::get_num_threads()) schedule(static)
  for (int64_t hb = 0; hb < Hkv * (Np / 16); ++hb) {
    const int64_t h = hb / (Np / 16), t0 = hb % (Np / 16) * 16, t1 = std::min<int64_t>(N, t0 + 16);
    const uint32_t* src = kp + h * head_stride / 2;
    for (int64_t j = 0; j < P; ++j)
      for (int64_t t = t0; t < t1; ++t) pairs[(h * P + j) * Np + t] = src[t * P + j];
  }
  // the keys of block t that lie before N
  auto within = [N](int64_t t) { const int64_t n = N - t; return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 :
                                                                 (__mmask16)((1u << n) - 1); };
  // rows go four at a time (each load of 16 keys serves four rows' sums), four within one KV head's rows
  const int64_t seg = groups * Tq, quads_per_seg = (seg + 3) / 4, quads = Hkv * quads_per_seg;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), quads)));
  std::vector<float> sums(threads * Np, 0.f);
  #pragma omp parallel num_threads(threads)
  {
    float* col = sums.data() + omp_get_thread_num() * Np;
    std::vector<float> s(4 * Np);
    #pragma omp for schedule(static)
    for (int64_t qd = 0; qd < quads; ++qd) {
      const int64_t h = qd / quads_per_seg, r0 = h * seg + (qd % quads_per_seg) * 4;
      const int rows = static_cast<int>(std::min<int64_t>(4, (h + 1) * seg - r0));
      const uint32_t* kh = pairs.data() + h * P * Np;
      const uint32_t* qr[4];
      for (int i = 0; i < 4; ++i) qr[i] = qp + (r0 + std::min(i, rows - 1)) * P;  // a short quad repeats its last row
      __m512 mv[4];
      for (int i = 0; i < 4; ++i) mv[i] = _mm512_set1_ps(-INFINITY);
      for (int64_t t = 0; t < Np; t += 64) {  // 4 rows x 4 blocks of 16 keys: 16 independent sums
        __m512 acc[4][4];
        for (int i = 0; i < 4; ++i)
          for (int b = 0; b < 4; ++b) acc[i][b] = _mm512_setzero_ps();
        for (int64_t j = 0; j < P; ++j) {
          const uint32_t* kj = kh + j * Np + t;
          const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kj), k1 = (__m512bh)_mm512_loadu_si512(kj + 16),
                         k2 = (__m512bh)_mm512_loadu_si512(kj + 32), k3 = (__m512bh)_mm512_loadu_si512(kj + 48);
          for (int i = 0; i < 4; ++i) {
            const __m512bh qj = (__m512bh)_mm512_set1_epi32(static_cast<int>(qr[i][j]));
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], qj, k0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], qj, k1);
            acc[i][2] = _mm512_dpbf16_ps(acc[i][2], qj, k2);
            acc[i][3] = _mm512_dpbf16_ps(acc[i][3], qj, k3);
          }
        }
        for (int i = 0; i < 4; ++i)
          for (int b = 0; b < 4; ++b) {
            const __m512 v = _mm512_mul_ps(acc[i][b], _mm512_set1_ps(to_log2));
            _mm512_storeu_ps(&s[i * Np + t + 16 * b], v);
            mv[i] = _mm512_mask_max_ps(mv[i], within(t + 16 * b), mv[i], v);
          }
      }
      for (int i = 0; i < rows; ++i) {  // each row's softmax, added into the thread's column sums
        float* si = &s[i * Np];
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv[i]));
        __m512 total = _mm512_setzero_ps();
        for (int64_t t = 0; t < Np; t += 16) {
          const __m512 e = _mm512_maskz_mov_ps(within(t), exp2_neg(_mm512_sub_ps(_mm512_loadu_ps(si + t), m)));
          _mm512_storeu_ps(si + t, e);
          total = _mm512_add_ps(total, e);
        }
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total));
        for (int64_t t = 0; t < Np; t += 16)
          _mm512_storeu_ps(col + t, _mm512_fmadd_ps(_mm512_loadu_ps(si + t), inv, _mm512_loadu_ps(col + t)));
      }
    }
  }
  auto out = torch::zeros({N}, torch::kFloat32);
  float* o = out.data_ptr<float>();
  for (int th = 0; th < threads; ++th)
    for (int64_t t = 0; t < N; ++t) o[t] += sums[th * Np + t];
  return out;
}
#endif

bool available() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available);
#ifdef __AVX512BF16__
  m.def("context_mass", &context_mass, py::call_guard<py::gil_scoped_release>());
#endif
}
"""

kernel = LazyExtension("ragkv_context_mass_v6", _SOURCE, "context attention mass pass",
                       needs=torch.cpu._is_avx512_bf16_supported)


def context_mass(q: torch.Tensor, k: torch.Tensor, n: int) -> torch.Tensor | None:
    """q [1, Hq, Tq, D], k [1, Hkv, >= n, D] (bf16, CPU) -> [n] fp32: sum over heads and rows of softmax over the first
    n keys of q k^T / sqrt(D); None where the pass does not apply (dtype, device, layout, no kernel here)."""
    if (q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16 or q.device.type != "cpu" or k.device.type != "cpu"
            or q.shape[0] != 1 or k.shape[0] != 1 or q.shape[-1] % 32 or q.shape[1] % k.shape[1]
            or k.stride(-1) != 1 or k.stride(-2) != k.shape[-1] or n < 1 or k.shape[2] < n):
        return None
    mod = kernel()
    if mod is None:
        return None
    D = q.shape[-1]
    with traced("ragkv::context_mass"):
        return mod.context_mass(q[0].contiguous(), k[0], n, k.stride(1), D ** -0.5)
