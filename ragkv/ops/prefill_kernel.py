"""A CPU kernel for causal prefill attention in bf16 on AVX-512 BF16 or AMX, flash-style (one pass, online softmax).

torch's CPU flash attention runs a bf16 prefill at ~110 GFLOP/s on a 2-core Zen 4, a quarter of what the same
cores reach in a bf16 GEMM (~430): at 1.3K tokens it was 19-24% of Qwen 0.5B's `full` prefill. This kernel does
both products with `vdpbf16ps`: Q K^T with K packed per KV head as [S/16][D/2][16][2] (16 keys per vector, a
broadcast pair of the query's dimensions), P V with V packed as [S/2][D][2] (a broadcast pair of probabilities).
Scores, the running max and sum, and the output are fp32; the probabilities are rounded to bf16 for P V, as
torch's bf16 kernel does. The running maximum is lazy (FlashAttention-4's conditional rescaling, as the AMX path
below): a row's reference moves, and its output is rescaled, only when a score passes it by more than 2^8, which
took 11% off the kernel's time at 1,024 causal rows on a Zen 4. Every query head of a KV group reads the same
packed K/V (grouped-query attention without copies). Rows see keys causally from `past` on (row i at position
past + i sees keys 0..past + i), or every key, or each up to its own position (`row_limits`: the scattered rows a
selective recompute runs). Returns the output in bf16 and, if asked, each row's log-sum-exp (natural log) in fp32.

The AMX path (`amx=True`, head dim 64) reads the same packed K and V, which are AMX's B-tile layouts as they lie: 16
query rows a block, both products on the matrix unit (`tdpbf16ps`), the output accumulated in tiles across the key
steps, the softmax on AVX-512 between them with a lazy maximum (FlashAttention-4's conditional rescaling: the tiles
are rescaled only when a row's maximum grows by more than 2^8). On an AMX Xeon, 14/2 heads, it took 2.35 / 3.66 ms
at 1,024 / 1,329 causal rows against SDPA's 4.48 / 6.68 (oneDNN's brgemm, also on the matrix unit) and the AVX-512
path's 11.2 / 18.4.

Built where the compiler targets AVX-512 BF16; elsewhere, or with RAGKV_NO_CPP_KERNELS=1, `kernel()` is None and
callers keep SDPA. Tested against fp32 SDPA (tests/test_cpu_bf16.py).
"""

from __future__ import annotations

import torch

from ragkv.config import cpu_has
from ragkv.ops.cpp_build import AMX_TILES, EXP2_NEG_AVX512, LazyExtension
from ragkv.ops.trace import traced

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>
#include <sys/syscall.h>
#include <unistd.h>

bool available() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

#ifdef __AVX512BF16__
static constexpr int KB = 64;  // keys per block: four vectors of 16 scores per row
static constexpr float LAZY_MAX = 8.f;  // P <= 2^8 between rescalings (both paths)

""" + EXP2_NEG_AVX512 + r"""// R query rows (one head) against every visible key block; D = 32 * DP.
template <int R, int DP>
static void rows_attend(const uint32_t* const* q, const uint16_t* kp, const uint16_t* vp, const int64_t* limit,
                        float scale2, uint16_t* const* out, float* lse) {
  constexpr int D = 32 * DP;
  float m[R];
  __m512 lv[R];  // each row's sum of P, lane-wise (reduced once at the end)
  alignas(64) float o[R][D];
  alignas(64) uint16_t p16[R][KB];
  const __m512 sc = _mm512_set1_ps(scale2);
  for (int r = 0; r < R; ++r) { m[r] = -std::numeric_limits<float>::infinity(); lv[r] = _mm512_setzero_ps(); }
  std::memset(o, 0, sizeof(o));
  int64_t last = limit[0];
  for (int r = 1; r < R; ++r) last = limit[r] > last ? limit[r] : last;
  for (int64_t k0 = 0; k0 <= last; k0 += KB) {
    // scores of R rows x 64 keys: s[r][t] holds keys k0 + 16 t .. + 15
    __m512 s[R][4];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < 4; ++t) s[r][t] = _mm512_setzero_ps();
    const uint16_t* kb = kp + (k0 / 16) * (D * 16);  // 4 tiles of [D/2][16][2]
    for (int dp = 0; dp < D / 2; ++dp) {
      __m512bh k_t[4];
      for (int t = 0; t < 4; ++t) k_t[t] = (__m512bh)_mm512_loadu_si512(kb + t * D * 16 + dp * 32);
      for (int r = 0; r < R; ++r) {
        __m512bh qb = (__m512bh)_mm512_set1_epi32(q[r][dp]);
        for (int t = 0; t < 4; ++t) s[r][t] = _mm512_dpbf16_ps(s[r][t], qb, k_t[t]);
      }
    }
    for (int r = 0; r < R; ++r) {
      __mmask16 ok[4];
      // a lazy maximum, as the AMX path keeps: the reference m moves only when a score passes it by more than 2^8
      const __m512 bar = _mm512_set1_ps(m[r] + LAZY_MAX);
      __mmask16 over = 0;
      for (int t = 0; t < 4; ++t) {
        int64_t first = k0 + 16 * t;  // keys first..first+15 visible while <= limit[r]
        int64_t n = limit[r] - first + 1;
        ok[t] = n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
        s[r][t] = _mm512_mul_ps(s[r][t], sc);
        over |= _mm512_mask_cmp_ps_mask(ok[t], s[r][t], bar, _CMP_GT_OQ);
      }
      if (over) {  // a score passed the reference by more than 2^8: move it to this block's max
        __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        for (int t = 0; t < 4; ++t) mx = _mm512_mask_max_ps(mx, ok[t], mx, s[r][t]);
        float mnew = _mm512_reduce_max_ps(mx);
        float alpha = std::exp2(m[r] - mnew);  // 0 on the row's first visible block (m = -inf)
        m[r] = mnew;
        const __m512 av = _mm512_set1_ps(alpha);
        lv[r] = _mm512_mul_ps(lv[r], av);
        for (int c = 0; c < D; c += 16) _mm512_storeu_ps(o[r] + c, _mm512_mul_ps(_mm512_loadu_ps(o[r] + c), av));
      }
      if (m[r] == -std::numeric_limits<float>::infinity()) {  // nothing visible yet in this row
        std::memset(p16[r], 0, sizeof(p16[r]));
        continue;
      }
      __m512 mv = _mm512_set1_ps(m[r]), sum = _mm512_setzero_ps();
      for (int t = 0; t < 4; ++t) {
        __m512 p = _mm512_maskz_mov_ps(ok[t], exp2_neg(_mm512_sub_ps(s[r][t], mv)));
        sum = _mm512_add_ps(sum, p);
        _mm256_storeu_si256((__m256i*)(p16[r] + 16 * t), (__m256i)_mm512_cvtneps_pbh(p));
      }
      lv[r] = _mm512_add_ps(lv[r], sum);
    }
    // O += P V over the block's 32 key pairs; V pair j holds D dims x 2 keys
    const uint16_t* vb = vp + (k0 / 2) * (D * 2);
    int64_t pairs = (last - k0 + 1 + 1) / 2;
    if (pairs > KB / 2) pairs = KB / 2;
    // each pair's V vectors loaded once for all R rows (R x 2DP accumulators stay in registers)
    __m512 acc[R][2 * DP];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 2 * DP; ++c) acc[r][c] = _mm512_loadu_ps(o[r] + 16 * c);
    for (int64_t j = 0; j < pairs; ++j) {
      const uint16_t* vj = vb + j * D * 2;
      __m512bh vv[2 * DP];
      for (int c = 0; c < 2 * DP; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vj + 32 * c);
      for (int r = 0; r < R; ++r) {
        __m512bh pb = (__m512bh)_mm512_set1_epi32(reinterpret_cast<const uint32_t*>(p16[r])[j]);
        for (int c = 0; c < 2 * DP; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pb, vv[c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 2 * DP; ++c) _mm512_storeu_ps(o[r] + 16 * c, acc[r][c]);
  }
  for (int r = 0; r < R; ++r) {
    const float l = _mm512_reduce_add_ps(lv[r]);
    float inv = l > 0.f ? 1.f / l : 0.f;
    for (int c = 0; c < D; c += 16) {
      __m512 v = _mm512_mul_ps(_mm512_loadu_ps(o[r] + c), _mm512_set1_ps(inv));
      _mm256_storeu_si256((__m256i*)(out[r] + c), (__m256i)_mm512_cvtneps_pbh(v));
    }
    if (lse) lse[r] = l > 0.f ? (m[r] + std::log2(l)) * 0.69314718055994531f
                           : -std::numeric_limits<float>::infinity();
  }
}

// K and V of every KV head packed as the kernels read them, zero past S (those keys are never visible):
// K as [Sp/16][D/2][16][2] (16 keys per vector / AMX B tile), V as [Sp/2][D][2] (key pairs)
static void pack_kv(const torch::Tensor& k, const torch::Tensor& v, int64_t D, int64_t Sp,
                    std::vector<uint16_t>& kp, std::vector<uint16_t>& vp) {
  int64_t Hkv = k.size(1), S = k.size(2);
  kp.assign(Hkv * Sp * D, 0);
  vp.assign(Hkv * Sp * D, 0);
  const uint16_t* kd = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const uint16_t* vd = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  int64_t ksh = k.stride(1), ksr = k.stride(2), vsh = v.stride(1), vsr = v.stride(2);
  #pragma omp parallel for schedule(static) num_threads(at::get_num_threads())
  for (int64_t hs = 0; hs < Hkv * (Sp / 16); ++hs) {
    int64_t h = hs / (Sp / 16), tile = hs % (Sp / 16);
    uint16_t* kt = kp.data() + h * Sp * D + tile * D * 16;
    uint16_t* vt = vp.data() + h * Sp * D + tile * 16 * D;  // 8 key pairs of D dims x 2
    for (int i = 0; i < 16; ++i) {
      int64_t key = tile * 16 + i;
      if (key >= S) break;
      const uint16_t* kr = kd + h * ksh + key * ksr;
      const uint16_t* vr = vd + h * vsh + key * vsr;
      for (int d = 0; d < D; ++d) {
        kt[(d / 2) * 32 + i * 2 + (d % 2)] = kr[d];
        vt[(i / 2) * D * 2 + d * 2 + (i % 2)] = vr[d];
      }
    }
  }
}

// the last key row `r` of a query block sees: its own limit, the causal one, or every key
static inline int64_t row_limit(int64_t row, int64_t T, const int64_t* row_limits, bool causal, int64_t past,
                                int64_t S) {
  int64_t lim = row >= T ? -1 : row_limits ? row_limits[row] : causal ? past + row : S - 1;  // padding: nothing
  return lim > S - 1 ? S - 1 : lim;
}

// one call's shapes, strides and packed K/V, as both paths read them
struct Problem {
  int64_t Hq, T, Hkv, S, g, Sp, qsh, qsr, osh, osr;
  std::vector<uint16_t> kp, vp;
  const uint16_t* qd;
  uint16_t* od;
  float scale2;  // scores in base-2 units: exp2 does the softmax
};

static void prepare(Problem& p, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                    torch::Tensor& out, int64_t D, int64_t keys_per_step) {
  p.Hq = q.size(1); p.T = q.size(2); p.Hkv = k.size(1); p.S = k.size(2); p.g = p.Hq / p.Hkv;
  p.Sp = (p.S + keys_per_step - 1) / keys_per_step * keys_per_step;
  pack_kv(k, v, D, p.Sp, p.kp, p.vp);
  p.qd = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  p.od = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  p.qsh = q.stride(1); p.qsr = q.stride(2); p.osh = out.stride(1); p.osr = out.stride(2);
  p.scale2 = 1.4426950408889634f / std::sqrt((float)D);
}

template <int DP>
static void run(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t past, bool causal,
                const int64_t* row_limits, torch::Tensor& out, float* lse) {
  constexpr int D = 32 * DP, R = DP == 2 ? 4 : 2;
  Problem p;
  prepare(p, q, k, v, out, D, KB);
  const int64_t Hq = p.Hq, T = p.T, S = p.S, g = p.g, Sp = p.Sp;
  int64_t groups = (T + R - 1) / R, items = Hq * groups;
  #pragma omp parallel for schedule(dynamic, 8) num_threads(at::get_num_threads())
  for (int64_t it = 0; it < items; ++it) {
    int64_t hq = it / groups, i0 = (it % groups) * R, h = hq / g;
    int rows = T - i0 < R ? (int)(T - i0) : R;
    const uint32_t* qr[R];
    uint16_t* orow[R];
    int64_t limit[R];
    alignas(64) uint16_t dummy_q[D] = {0};
    alignas(64) uint16_t dummy_o[D];
    for (int r = 0; r < R; ++r) {
      bool real = r < rows;
      qr[r] = reinterpret_cast<const uint32_t*>(real ? p.qd + hq * p.qsh + (i0 + r) * p.qsr : dummy_q);
      orow[r] = real ? p.od + hq * p.osh + (i0 + r) * p.osr : dummy_o;
      limit[r] = row_limit(i0 + r, T, row_limits, causal, past, S);
    }
    float lrow[R];
    rows_attend<R, DP>(qr, p.kp.data() + h * Sp * D, p.vp.data() + h * Sp * D, limit, p.scale2, orow,
                       lse ? lrow : nullptr);
    if (lse)
      for (int r = 0; r < rows; ++r) lse[hq * T + i0 + r] = lrow[r];
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define RAGKV_AMX 1
// AMX: 16 query rows (one head, D = 64) a block, keys 32 a step. Tiles (all 16 rows x 64 bytes): 0-1 Q (dims 0-31,
// 32-63); 2 a K or V B tile; 3 the scores of 16 keys, then P (16 rows x 32 keys in bf16); 4-7 O (four 16-dim chunks,
// fp32), accumulated in the tiles across steps. The softmax runs on AVX-512 between the two products, online in base
// 2 with a lazy maximum (as FlashAttention-4 rescales): a row's reference max m moves only when a score exceeds it by
// more than LAZY_MAX, so P <= 2^LAZY_MAX and the O tiles are stored, rescaled and reloaded only on those steps (the
// softmax is the same for any reference; only roundings differ).
static constexpr int AMX_KB = 32;

""" + AMX_TILES + r"""
static void block_attend_amx(const uint16_t* qb, const uint16_t* kp, const uint16_t* vp, const int64_t* limit,
                             float scale2, uint16_t* const* out, float* lse) {
  constexpr int D = 64;
  float m[16], alpha[16];
  alignas(64) float lsum[16][16];  // each row's sum of P, lane-wise (reduced once at the end)
  alignas(64) float o[16][D];
  alignas(64) float s[16][AMX_KB];
  alignas(64) uint16_t p[16][AMX_KB];
  const float neg_inf = -std::numeric_limits<float>::infinity();
  int64_t last = -1;
  for (int r = 0; r < 16; ++r) {
    m[r] = neg_inf;
    last = limit[r] > last ? limit[r] : last;
  }
  std::memset(lsum, 0, sizeof(lsum));
  _tile_loadd(0, qb, 2 * D);
  _tile_loadd(1, qb + 32, 2 * D);
  _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
  const __m512 sc = _mm512_set1_ps(scale2);
  for (int64_t k0 = 0; k0 <= last; k0 += AMX_KB) {
    const uint16_t* kb = kp + (k0 / 16) * (D * 16);  // two 16-key tiles of [32 pairs][16][2]
    for (int half = 0; half < 2; ++half) {
      _tile_zero(3);
      _tile_loadd(2, kb + half * D * 16, 64); _tile_dpbf16ps(3, 0, 2);
      _tile_loadd(2, kb + half * D * 16 + 512, 64); _tile_dpbf16ps(3, 1, 2);
      _tile_stored(3, &s[0][16 * half], 4 * AMX_KB);
    }
    bool rescale = false;
    for (int r = 0; r < 16; ++r) {
      const int64_t n = limit[r] - k0 + 1;  // keys of this step the row sees
      const __mmask16 ok0 = n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
      const __mmask16 ok1 = n >= 32 ? (__mmask16)0xFFFF : n <= 16 ? (__mmask16)0 : (__mmask16)((1u << (n - 16)) - 1);
      const __m512 s0 = _mm512_mul_ps(_mm512_load_ps(&s[r][0]), sc);
      const __m512 s1 = _mm512_mul_ps(_mm512_load_ps(&s[r][16]), sc);
      const __m512 bar = _mm512_set1_ps(m[r] + LAZY_MAX);
      alpha[r] = 1.f;
      if (_mm512_mask_cmp_ps_mask(ok0, s0, bar, _CMP_GT_OQ) | _mm512_mask_cmp_ps_mask(ok1, s1, bar, _CMP_GT_OQ)) {
        __m512 mx = _mm512_mask_max_ps(_mm512_set1_ps(neg_inf), ok0, s0, s0);
        mx = _mm512_mask_max_ps(mx, ok1, mx, s1);
        const float mnew = _mm512_reduce_max_ps(mx);
        alpha[r] = std::exp2(m[r] - mnew);  // 0 on the row's first visible step (m = -inf)
        m[r] = mnew;
        _mm512_store_ps(lsum[r], _mm512_mul_ps(_mm512_load_ps(lsum[r]), _mm512_set1_ps(alpha[r])));
        rescale = true;
      }
      if (m[r] == neg_inf) {  // nothing visible yet in this row
        std::memset(p[r], 0, sizeof(p[r]));
        continue;
      }
      const __m512 mv = _mm512_set1_ps(m[r]);
      const __m512 p0 = _mm512_maskz_mov_ps(ok0, exp2_neg(_mm512_sub_ps(s0, mv)));
      const __m512 p1 = _mm512_maskz_mov_ps(ok1, exp2_neg(_mm512_sub_ps(s1, mv)));
      _mm512_store_ps(lsum[r], _mm512_add_ps(_mm512_load_ps(lsum[r]), _mm512_add_ps(p0, p1)));
      _mm256_store_si256((__m256i*)&p[r][0], (__m256i)_mm512_cvtneps_pbh(p0));
      _mm256_store_si256((__m256i*)&p[r][16], (__m256i)_mm512_cvtneps_pbh(p1));
    }
    if (rescale) {  // O *= alpha, row by row, through memory
      _tile_stored(4, &o[0][0], 4 * D); _tile_stored(5, &o[0][16], 4 * D);
      _tile_stored(6, &o[0][32], 4 * D); _tile_stored(7, &o[0][48], 4 * D);
      for (int r = 0; r < 16; ++r) {
        const __m512 av = _mm512_set1_ps(alpha[r]);
        for (int c = 0; c < D; c += 16) _mm512_store_ps(&o[r][c], _mm512_mul_ps(_mm512_load_ps(&o[r][c]), av));
      }
      _tile_loadd(4, &o[0][0], 4 * D); _tile_loadd(5, &o[0][16], 4 * D);
      _tile_loadd(6, &o[0][32], 4 * D); _tile_loadd(7, &o[0][48], 4 * D);
    }
    // O += P V over the step's 16 key pairs: V pair rows are D dims x 2 (256 bytes), a B tile per 16 dims
    const uint16_t* vb = vp + (k0 / 2) * (D * 2);
    _tile_loadd(3, &p[0][0], 2 * AMX_KB);
    _tile_loadd(2, vb, 4 * D); _tile_dpbf16ps(4, 3, 2);
    _tile_loadd(2, vb + 32, 4 * D); _tile_dpbf16ps(5, 3, 2);
    _tile_loadd(2, vb + 64, 4 * D); _tile_dpbf16ps(6, 3, 2);
    _tile_loadd(2, vb + 96, 4 * D); _tile_dpbf16ps(7, 3, 2);
  }
  _tile_stored(4, &o[0][0], 4 * D); _tile_stored(5, &o[0][16], 4 * D);
  _tile_stored(6, &o[0][32], 4 * D); _tile_stored(7, &o[0][48], 4 * D);
  for (int r = 0; r < 16; ++r) {
    const float l = _mm512_reduce_add_ps(_mm512_load_ps(lsum[r]));
    if (lse) lse[r] = l > 0.f ? (m[r] + std::log2(l)) * 0.69314718055994531f : neg_inf;
    if (!out[r]) continue;  // a padding row
    const float inv = l > 0.f ? 1.f / l : 0.f;
    for (int c = 0; c < D; c += 16) {
      __m512 v = _mm512_mul_ps(_mm512_load_ps(&o[r][c]), _mm512_set1_ps(inv));
      _mm256_storeu_si256((__m256i*)(out[r] + c), (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

static void run_amx(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t past, bool causal,
                    const int64_t* row_limits, torch::Tensor& out, float* lse) {
  constexpr int D = 64;
  Problem p;
  prepare(p, q, k, v, out, D, AMX_KB);
  const int64_t Hq = p.Hq, T = p.T, S = p.S, g = p.g, Sp = p.Sp;
  int64_t blocks = (T + 15) / 16, items = Hq * blocks;
  #pragma omp parallel num_threads(at::get_num_threads())
  {
    configure_tiles(8);
    alignas(64) uint16_t qb[16 * D];
    #pragma omp for schedule(dynamic, 4)
    for (int64_t it = 0; it < items; ++it) {
      // the longest blocks first (the last rows see the most keys): the two cores end together
      int64_t hq = it % Hq, i0 = (blocks - 1 - it / Hq) * 16, h = hq / g;
      int rows = T - i0 < 16 ? (int)(T - i0) : 16;
      uint16_t* orow[16];
      int64_t limit[16];
      for (int r = 0; r < 16; ++r) {
        if (r < rows) std::memcpy(qb + r * D, p.qd + hq * p.qsh + (i0 + r) * p.qsr, 2 * D);
        else std::memset(qb + r * D, 0, 2 * D);
        orow[r] = r < rows ? p.od + hq * p.osh + (i0 + r) * p.osr : nullptr;
        limit[r] = row_limit(i0 + r, T, row_limits, causal, past, S);
      }
      float lrow[16];
      block_attend_amx(qb, p.kp.data() + h * Sp * D, p.vp.data() + h * Sp * D, limit, p.scale2, orow,
                       lse ? lrow : nullptr);
      if (lse)
        for (int r = 0; r < rows; ++r) lse[hq * T + i0 + r] = lrow[r];
    }
    _tile_release();
  }
}
#endif
#endif

// the AMX path: built for AMX-BF16 (-march=native on an AMX CPU) and granted the tile state by the kernel
bool amx_available() {
#ifdef RAGKV_AMX
  return amx_granted();
#else
  return false;
#endif
}

// q [1, Hq, T, D], k, v [1, Hkv, S, D] bf16 with unit stride on D -> (out [1, Hq, T, D] bf16, lse [1, Hq, T] fp32)
// row_limits (int64 [T], or empty): row i sees keys 0..row_limits[i] (then `past` and `causal` are unused)
std::vector<torch::Tensor> attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t past, bool causal,
                                     bool want_lse, torch::Tensor row_limits, bool amx) {
  TORCH_CHECK(available(), "built without AVX-512 BF16");
  TORCH_CHECK(!amx || (amx_available() && q.size(3) == 64), "the AMX path: head dim 64, on a CPU with AMX-BF16");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
              v.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(q.size(0) == 1 && q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "batch 1, D contiguous");
  int64_t Hq = q.size(1), T = q.size(2), D = q.size(3);
  const bool limited = row_limits.defined() && row_limits.numel() > 0;
  TORCH_CHECK(!limited || (row_limits.scalar_type() == at::kLong && row_limits.is_contiguous() &&
                           row_limits.numel() == T), "row_limits: int64 [T], contiguous");
  const int64_t* lim = limited ? row_limits.data_ptr<int64_t>() : nullptr;
  auto out = torch::empty({1, T, Hq, D}, q.options()).transpose(1, 2);  // [1, Hq, T, D] over [T, Hq, D] memory
  torch::Tensor lse = want_lse ? torch::empty({1, Hq, T}, q.options().dtype(at::kFloat)) : torch::Tensor();
#ifdef __AVX512BF16__
  float* lp = want_lse ? lse.data_ptr<float>() : nullptr;
#ifdef RAGKV_AMX
  if (amx) { run_amx(q, k, v, past, causal, lim, out, lp); return {out, lse}; }
#endif
  if (D == 64) run<2>(q, k, v, past, causal, lim, out, lp);
  else if (D == 128) run<4>(q, k, v, past, causal, lim, out, lp);
  else TORCH_CHECK(false, "head dim 64 or 128 only");
#endif
  return {out, lse};
}

// the GIL is released while a kernel runs: the server's HTTP thread streams tokens meanwhile (holding it,
// these kernels starved the event loop: a first token reached the client ~0.2 s after it was sampled)
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available);
  m.def("amx_available", &amx_available);
  m.def("attention", &attention, py::call_guard<py::gil_scoped_release>());
}
"""

_NAME = "ragkv_bf16_prefill_attention_v8"
HEAD_DIMS = (64, 128)
# the compiled module where this CPU has AVX-512 BF16, else None (callers use SDPA)
kernel = LazyExtension(_NAME, _SOURCE, "bf16 prefill-attention kernel", needs=lambda: cpu_has("avx512_bf16"))


def applies(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the kernel can take these rows: bf16 on the CPU, batch 1, a head dim of 64 or 128, more than a few
    rows (decode has its own kernel), no gradient wanted (it has no backward), and built here."""
    return (q.dtype == torch.bfloat16 and not (q.requires_grad and torch.is_grad_enabled()) and q.device.type == "cpu" and q.shape[0] == 1 and q.shape[2] > 16
            and q.shape[-1] in HEAD_DIMS and k.dtype == torch.bfloat16 and kernel() is not None)


def amx_applies(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the AMX path can take these rows too: `applies`, a head dim of 64, AMX-BF16 here."""
    return applies(q, k) and q.shape[-1] == 64 and kernel().amx_available()


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int = 0, causal: bool = True,
                      want_lse: bool = False, row_limits: torch.Tensor | None = None, amx: bool = False):
    """q [1, Hq, T, D], k, v [1, Hkv, S, D] (S = past + T when causal) -> out [1, Hq, T, D] bf16, or (out, lse
    [1, Hq, T] fp32) with `want_lse`. `row_limits` [T]: row i sees keys 0..row_limits[i] instead (the recomputed
    rows of a selection at their positions, cache index == position). `amx`: on the matrix unit (amx_applies)."""
    limits = torch.empty(0, dtype=torch.long) if row_limits is None else row_limits.to("cpu", torch.long).contiguous()
    if q.stride(-1) != 1:
        q = q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    with traced("ragkv::prefill_attention"):
        out, lse = kernel().attention(q, k, v, int(past), bool(causal), bool(want_lse), limits, bool(amx))
    return (out, lse) if want_lse else out
