"""How much attention a query gives each context key, in one pass on the CPU: alpha(t) = sum over query heads h and
query rows i of softmax_t(q_hi . k_t / sqrt(d)) over the first N keys only (ProphetKV's stage-1 score, arXiv
2602.02579; engine/recompute/query.py sums it over layers).

torch computes it as an fp32 product into a [heads, rows, N] buffer, then a row max, a subtraction, a clamp, an
exp, the rows' sums and a second product: 1.1-1.4 ms a layer for the 0.5B's 46 query rows over 1.3K context keys
(AMX Xeon), ~30 ms of a ~113 ms stage 1. Here each KV head's keys are laid out once as [d/2 pairs][N] 32-bit words,
which is AMX's B tile as it lies: with head dim 64 on a CPU with AMX, 16 query rows x 64 keys are 8 tile products
(0.40 ms a layer); elsewhere 4 rows x 64 keys a pass of vdpbf16ps, each row's pair broadcast (0.75 ms). Either way
bf16 products summed in fp32 (exact products: the scores equal the fp32 product's to summation order), then each
row's max, 2^x by the shared polynomial (relative error < 2e-7) and the row's probabilities added into the thread's
column sums. Built where the compiler targets AVX-512 BF16; elsewhere, and for fp32 tensors, `context_mass` returns
None and the recorder keeps torch's ops.
"""

from __future__ import annotations

import torch

from ragkv.config import cpu_has
from ragkv.ops.cpp_build import AMX_TILES, EXP2_NEG_AVX512, LazyExtension
from ragkv.ops.trace import traced

_SOURCE = r"""
#include <torch/extension.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#ifdef __AVX512BF16__
#include <immintrin.h>
""" + EXP2_NEG_AVX512 + r"""
// the keys of block t (16 keys) that lie before N
static inline __mmask16 within(int64_t N, int64_t t) {
  const int64_t n = N - t;
  return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

// one query row's softmax over its N scores s (raw q.k; `to_log2` = scale * log2 e) added into the column sums
static void add_softmax(float* s, int64_t N, int64_t Np, float to_log2, float* col) {
  __m512 mv = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < Np; t += 16) mv = _mm512_mask_max_ps(mv, within(N, t), mv, _mm512_loadu_ps(s + t));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv)), c = _mm512_set1_ps(to_log2);
  __m512 total = _mm512_setzero_ps();
  for (int64_t t = 0; t < Np; t += 16) {
    const __m512 x = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(s + t), m), c);
    const __m512 e = _mm512_maskz_mov_ps(within(N, t), exp2_neg(x));
    _mm512_storeu_ps(s + t, e);
    total = _mm512_add_ps(total, e);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total));
  for (int64_t t = 0; t < Np; t += 16)
    _mm512_storeu_ps(col + t, _mm512_fmadd_ps(_mm512_loadu_ps(s + t), inv, _mm512_loadu_ps(col + t)));
}

// scores of 4 query rows (P pair-words each) against keys [0, Np) of one KV head laid out [P][Np] (32-bit words):
// per pair, 4 loads of 16 keys and a broadcast per row into vdpbf16ps, 16 independent sums, no horizontal adds
static void scores4(const uint32_t* const* qr, const uint32_t* kh, int64_t P, int64_t Np, float* s) {
  for (int64_t t = 0; t < Np; t += 64) {
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
      for (int b = 0; b < 4; ++b) _mm512_storeu_ps(s + i * Np + t + 16 * b, acc[i][b]);
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
""" + AMX_TILES + r"""// scores of 16 query rows (a: 16 rows of D = 64 bf16, 128 bytes apart) against keys [0, Np) of one KV head laid
// out [32 pairs][Np] words: that layout is AMX's B tile as it lies (16 pair-rows Np words apart, 16 keys each), so
// 16 rows x 64 keys take 8 tile products. Tiles 0-3: the four 16 x 16 fp32 blocks, 4-5: A (dims 0-31, 32-63), 6-7: B
static void scores16(const uint16_t* a, const uint32_t* kh, int64_t Np, float* s) {
  const int64_t ld = Np * 4;
  _tile_loadd(4, a, 128);
  _tile_loadd(5, a + 32, 128);
  for (int64_t t = 0; t < Np; t += 64) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    _tile_loadd(6, kh + t, ld);           _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, kh + 16 * Np + t, ld); _tile_dpbf16ps(0, 5, 7);
    _tile_loadd(6, kh + t + 16, ld);           _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, kh + 16 * Np + t + 16, ld); _tile_dpbf16ps(1, 5, 7);
    _tile_loadd(6, kh + t + 32, ld);           _tile_dpbf16ps(2, 4, 6);
    _tile_loadd(7, kh + 16 * Np + t + 32, ld); _tile_dpbf16ps(2, 5, 7);
    _tile_loadd(6, kh + t + 48, ld);           _tile_dpbf16ps(3, 4, 6);
    _tile_loadd(7, kh + 16 * Np + t + 48, ld); _tile_dpbf16ps(3, 5, 7);
    _tile_stored(0, s + t, ld); _tile_stored(1, s + t + 16, ld);
    _tile_stored(2, s + t + 32, ld); _tile_stored(3, s + t + 48, ld);
  }
}
#endif

// q [Hq, Tq, D] bf16 contiguous, k [Hkv, rows >= N, D] bf16 (rows contiguous, heads `head_stride` elements apart),
// D a multiple of 32 -> [N] fp32: the sum over query heads and rows of each row's softmax over the first N keys.
// Rows go in blocks within one KV head's rows (16 on AMX where D = 64, else 4), a short block padded with zero rows.
torch::Tensor context_mass(torch::Tensor q, torch::Tensor k, int64_t N, int64_t head_stride, double scale) {
  const int64_t Hq = q.size(0), Tq = q.size(1), D = q.size(2), Hkv = k.size(0), groups = Hq / Hkv;
  const int64_t P = D / 2, Np = (N + 63) / 64 * 64;  // four blocks of 16 keys a pass
  const float to_log2 = static_cast<float>(scale) * 1.4426950409f;  // exp(x) = 2^(x log2 e)
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
  bool tiles = false;
#ifdef HAVE_AMX
  tiles = D == 64 && amx_granted();
#endif
  const int64_t block = tiles ? 16 : 4, seg = groups * Tq, per_seg = (seg + block - 1) / block;
  // the query rows of each KV head, zero-padded to whole blocks
  std::vector<uint16_t> qpad(Hkv * per_seg * block * D, 0);
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  for (int64_t h = 0; h < Hkv; ++h)
    std::memcpy(qpad.data() + h * per_seg * block * D, qp + h * seg * D, seg * D * 2);
  const int64_t blocks = Hkv * per_seg;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks)));
  std::vector<float> sums(threads * Np, 0.f);
  #pragma omp parallel num_threads(threads)
  {
    float* col = sums.data() + omp_get_thread_num() * Np;
    std::vector<float> s(block * Np);
#ifdef HAVE_AMX
    if (tiles) configure_tiles(8);
#endif
    #pragma omp for schedule(static)
    for (int64_t bk = 0; bk < blocks; ++bk) {
      const int64_t h = bk / per_seg, first = bk % per_seg * block;
      const int rows = static_cast<int>(std::min<int64_t>(block, seg - first));
      const uint16_t* a = qpad.data() + (h * per_seg * block + first) * D;
      const uint32_t* kh = pairs.data() + h * P * Np;
#ifdef HAVE_AMX
      if (tiles) scores16(a, kh, Np, s.data());
#endif
      if (!tiles) {
        const uint32_t* qr[4];
        for (int i = 0; i < 4; ++i) qr[i] = reinterpret_cast<const uint32_t*>(a + i * D);
        scores4(qr, kh, P, Np, s.data());
      }
      for (int i = 0; i < rows; ++i) add_softmax(s.data() + i * Np, N, Np, to_log2, col);
    }
#ifdef HAVE_AMX
    if (tiles) _tile_release();
#endif
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

kernel = LazyExtension("ragkv_context_mass_v9", _SOURCE, "context attention mass pass",
                       needs=lambda: cpu_has("avx512_bf16"))


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
