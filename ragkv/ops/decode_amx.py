"""The decode-attention kernel's AMX path (C++ spliced into ragkv.ops.decode_kernel's source after the AVX-512 BF16
path, whose `SeqView`, `exp16`, `widen16` and `prefetch_row` it uses): the same work items, chunks and merge, with
the scores and P V on the matrix unit.

Scores come transposed, 16 keys by 16 query rows a tile: the keys are the A operand as they lie in the cache (a
strided tile load, no shuffles) and the GQA group's query rows the B operand, packed once per item. The softmax runs
over those [key][row] vectors, and its numerators are rounded to bf16 in pairs of keys (the B layout's pairs), then
gathered row by row into the A operand of P V, whose B operand is each pair of value rows interleaved. The sums use
the rounded numerators, so the weights a row applies sum to its divisor. P rounded to bf16 is what SDPA's flash
attention on AMX does too; the output is within bf16 rounding of fp32 attention, not bitwise the AVX-512 path's.
On an Intel Xeon (2 cores) the AVX-512 BF16 path ran ~3x slower than on a Zen 5 (its scores are shuffle-bound).
"""

from ragkv.ops.cpp_build import AMX_TILES

AMX_PATH = r"""
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#include <atomic>

static std::atomic<bool> amx_chosen{false};  // set by the measured choice (ops/attention.choose_decode_attention)

""" + AMX_TILES + r"""
// W: the query rows a tile holds (8 where the GQA group has at most 8: two keys' scores share a vector, halving the
// softmax's work, and P V runs on 8-row tiles; else 16).
// Scores: 0-3 key slices (16 keys x 32 dims), 4-5 the query rows (16 dim pairs x W), 6-7 scores (16 keys x W fp32).
template <int W>
static void amx_configure_scores() {
  TileConfig cfg = palette_one();
  for (int t = 0; t < 8; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = t < 4 ? 64 : 4 * W; }
  _tile_loadconfig(&cfg);
}

// P V: 0-3 accumulators (W query rows x 16 dims fp32), 4 the numerators (W rows x 32 keys), 5-7 values (16 key
// pairs x 16 dims x 2).
template <int W>
static void amx_configure_pv() {
  TileConfig cfg = palette_one();
  for (int t = 0; t < 8; ++t) { cfg.rows[t] = t < 5 ? W : 16; cfg.colsb[t] = 64; }
  _tile_loadconfig(&cfg);
}

// rows asked of memory this many keys ahead: from memory (16 sequences x 2.4K keys x 24 layers, 472 MB a step) 24-32
// read 13.6-14.0 GB/s, 64 and 192 12.6-13.3 (2-core Xeon)
constexpr int64_t AMX_AHEAD = 32;
static const uint16_t amx_zero_row[256] = {0};  // a key or value row past the chunk's end (its weight is 0)

static inline __m512i amx_zip() {  // lanes 0-15 of a and of b interleaved: a0 b0 a1 b1 ...
  alignas(64) int16_t idx[32];
  for (int j = 0; j < 16; ++j) { idx[2 * j] = j; idx[2 * j + 1] = 32 + j; }
  return _mm512_load_si512(idx);
}

// The first of 16 key rows (s0 + b ...) as one strided tile operand: in place where they are 16 rows of one segment,
// else copied into `staging` (zero rows past the chunk's `n` keys). ldk: the operand's row stride in bytes.
template <int D>
static inline const uint16_t* key_block(const SeqView& sq, int64_t h, int64_t s0, int64_t b, int64_t n,
                                        uint16_t* staging, int64_t& ldk) {
  const int64_t nb = std::max<int64_t>(0, std::min<int64_t>(16, n - b));
  if (nb == 16) {
    const bool one_segment = (s0 + b < sq.k.n1) == (s0 + b + 15 < sq.k.n1);
    const int64_t stride = s0 + b < sq.k.n1 ? sq.k.r1 : sq.k.r2;  // in elements
    const uint16_t* first_row = reinterpret_cast<const uint16_t*>(sq.k.row(h, s0 + b));
    if (one_segment && reinterpret_cast<const uint16_t*>(sq.k.row(h, s0 + b + 15)) - first_row == 15 * stride) {
      ldk = stride * 2;
      return first_row;
    }
  }
  for (int64_t j = 0; j < 16; ++j) {
    if (j < nb) std::memcpy(staging + j * D, sq.k.row(h, s0 + b + j), D * 2);
    else std::memset(staging + j * D, 0, D * 2);
  }
  ldk = D * 2;
  return staging;
}

// scores^T = K Q^T for the chunk's n keys into st [ld][W] (ld: n rounded up to 32): two 16-key blocks a step in two
// score tiles, the query rows' B tiles kept while the keys stream (D = 128: its second half's pair swapped in and
// back). qt: [D/32][16 dim pairs][W rows][2].
template <int D, int W>
__attribute__((noinline)) static void amx_scores(const SeqView& sq, int64_t h, int64_t s0, int64_t n,
                                                 const uint16_t* qt, uint16_t* staging, float* st) {
  constexpr int QT = 16 * 2 * W;  // bf16 per query B tile
  amx_configure_scores<W>();
  _tile_loadd(4, qt, 4 * W);
  _tile_loadd(5, qt + QT, 4 * W);
  for (int64_t b = 0; b < n; b += 32) {
    for (int64_t j = b + AMX_AHEAD; j < std::min(n, b + AMX_AHEAD + 32); ++j) prefetch_row(sq.k.row(h, s0 + j), D);
    int64_t l0, l1;
    const uint16_t* k0 = key_block<D>(sq, h, s0, b, n, staging, l0);
    const uint16_t* k1 = key_block<D>(sq, h, s0, b + 16, n, staging + 16 * D, l1);
    _tile_zero(6);
    _tile_zero(7);
    _tile_loadd(0, k0, l0);
    _tile_loadd(1, k0 + 32, l0);
    _tile_loadd(2, k1, l1);
    _tile_loadd(3, k1 + 32, l1);
    _tile_dpbf16ps(6, 0, 4);
    _tile_dpbf16ps(7, 2, 4);
    _tile_dpbf16ps(6, 1, 5);
    _tile_dpbf16ps(7, 3, 5);
    if constexpr (D == 128) {
      _tile_loadd(0, k0 + 64, l0);
      _tile_loadd(1, k0 + 96, l0);
      _tile_loadd(2, k1 + 64, l1);
      _tile_loadd(3, k1 + 96, l1);
      _tile_loadd(4, qt + 2 * QT, 4 * W);
      _tile_loadd(5, qt + 3 * QT, 4 * W);
      _tile_dpbf16ps(6, 0, 4);
      _tile_dpbf16ps(7, 2, 4);
      _tile_dpbf16ps(6, 1, 5);
      _tile_dpbf16ps(7, 3, 5);
      _tile_loadd(4, qt, 4 * W);
      _tile_loadd(5, qt + QT, 4 * W);
    }
    _tile_stored(6, st + b * W, 4 * W);
    _tile_stored(7, st + (b + 16) * W, 4 * W);
  }
}

// The softmax numerators of the chunk's scores st [ld][W] (times `scale`), less their max per query row, rounded to
// bf16 and paired as P V's operand wants them: pw[j][row] (W words) holds keys 2j and 2j+1 (low, high). mx: the max;
// sm: the sum of the rounded numerators, so that the weights P V applies sum to its divisor. A vector holds 16 / W
// keys' scores; four running maxima (a chain of dependent maxima per key was slow).
template <int W>
__attribute__((noinline)) static void amx_numerators(const float* st, int64_t n, int64_t ld, float scale,
                                                     uint32_t* pw, float* mx, float* sm) {
  constexpr int K = 16 / W;            // keys per vector
  const int64_t full = n / K;          // vectors whose keys are all in the chunk
  const __m512 sc = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m0 = lo, m1 = lo, m2 = lo, m3 = lo;
  int64_t v = 0;
  for (; v + 4 <= full; v += 4) {
    m0 = _mm512_max_ps(m0, _mm512_loadu_ps(st + v * 16));
    m1 = _mm512_max_ps(m1, _mm512_loadu_ps(st + v * 16 + 16));
    m2 = _mm512_max_ps(m2, _mm512_loadu_ps(st + v * 16 + 32));
    m3 = _mm512_max_ps(m3, _mm512_loadu_ps(st + v * 16 + 48));
  }
  for (; v < full; ++v) m0 = _mm512_max_ps(m0, _mm512_loadu_ps(st + v * 16));
  if (full * K < n) m0 = _mm512_mask_max_ps(m0, 0x00FF, m0, _mm512_loadu_ps(st + full * 16));  // W = 8, n odd
  __m512 m = _mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3));
  if constexpr (W == 8) m = _mm512_max_ps(m, _mm512_shuffle_f32x4(m, m, 0x4E));  // both keys' halves alike
  const __m512 mv = _mm512_mul_ps(m, sc);  // scale > 0: the max of the scaled scores
  __m512 s0v = _mm512_setzero_ps(), s1v = _mm512_setzero_ps();
  auto numerator = [&](int64_t vec) {  // the vector's keys as bf16, masked past n, summed as rounded
    const int64_t key = vec * K;
    const __mmask16 keep = key + K <= n ? (__mmask16)0xFFFF : key < n ? (__mmask16)0x00FF : (__mmask16)0;
    const __m512 p = _mm512_maskz_mov_ps(keep, exp16(_mm512_fmsub_ps(_mm512_loadu_ps(st + vec * 16), sc, mv)));
    return (__m256i)_mm512_cvtneps_pbh(p);
  };
  auto widen = [](__m256i r) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16)); };
  if constexpr (W == 16) {
    const __m512i zip = amx_zip();
    for (int64_t j = 0; j < ld / 2; ++j) {
      const __m256i r0 = numerator(2 * j), r1 = numerator(2 * j + 1);
      s0v = _mm512_add_ps(s0v, widen(r0));
      s1v = _mm512_add_ps(s1v, widen(r1));
      _mm512_storeu_si512(pw + j * 16, _mm512_permutex2var_epi16(_mm512_castsi256_si512(r0), zip,
                                                                 _mm512_castsi256_si512(r1)));
    }
  } else {  // one vector is one pair: rows 0-7 of key 2j, then of 2j + 1
    alignas(32) int16_t idx[16];
    for (int g = 0; g < 8; ++g) { idx[2 * g] = g; idx[2 * g + 1] = 8 + g; }
    const __m256i pair = _mm256_load_si256((const __m256i*)idx);
    for (int64_t j = 0; j < ld / 2; j += 2) {
      const __m256i r0 = numerator(j), r1 = numerator(j + 1);
      s0v = _mm512_add_ps(s0v, widen(r0));
      s1v = _mm512_add_ps(s1v, widen(r1));
      _mm256_storeu_si256((__m256i*)(pw + j * 8), _mm256_permutexvar_epi16(pair, r0));
      _mm256_storeu_si256((__m256i*)(pw + j * 8 + 8), _mm256_permutexvar_epi16(pair, r1));
    }
  }
  __m512 total = _mm512_add_ps(s0v, s1v);
  if constexpr (W == 8) total = _mm512_add_ps(total, _mm512_shuffle_f32x4(total, total, 0x4E));
  _mm512_storeu_ps(mx, mv);
  _mm512_storeu_ps(sm, total);
}

// P V for one chunk into ot [W rows][D] fp32: each 32-key block's numerators (row g: its 16 pairs, gathered out of
// pw [pair][W]) are the A tile, each pair of value rows interleaved per dim a B tile; four accumulator tiles (0-3)
// cover 64 dims, B tiles rotate over 5-7 so a load need not wait for the product before it to finish reading.
template <int D, int W>
__attribute__((noinline)) static void amx_pv(const SeqView& sq, int64_t h, int64_t s0, int64_t n, int64_t ld,
                                             int64_t G, const uint32_t* pw, uint32_t* pa, float* ot) {
  constexpr int NV = D / 16;
  amx_configure_pv<W>();
  alignas(64) uint16_t vt[4][16][32];  // a block's values for 64 dims: [16-dim slice][key pair][dim][2]
  const __m512i zip = amx_zip();
  const __m512i gather_idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                _mm512_set1_epi32(W));
  const int64_t blocks = ld / 32;
  std::memset(pa, 0, blocks * W * 64);
  for (int64_t kb = 0; kb < blocks; ++kb)
    for (int64_t g = 0; g < G; ++g)
      _mm512_storeu_si512(pa + (kb * W + g) * 16, _mm512_i32gather_epi32(gather_idx, pw + kb * 16 * W + g, 4));
  for (int u0 = 0; u0 < NV; u0 += 4) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);  // (tile numbers must be constants)
    for (int64_t kb = 0; kb < blocks; ++kb) {
      for (int j = 0; j < 16; ++j) {
        const int64_t s = kb * 32 + 2 * j;
        if (u0 == 0 && s + AMX_AHEAD + 1 < n) {
          prefetch_row(sq.v.row(h, s0 + s + AMX_AHEAD), D);
          prefetch_row(sq.v.row(h, s0 + s + AMX_AHEAD + 1), D);
        }
        const uint16_t* v0 = s < n ? reinterpret_cast<const uint16_t*>(sq.v.row(h, s0 + s)) : amx_zero_row;
        const uint16_t* v1 = s + 1 < n ? reinterpret_cast<const uint16_t*>(sq.v.row(h, s0 + s + 1)) : amx_zero_row;
        for (int u = 0; u < 4; ++u) {
          const int d = 16 * (u0 + u);
          _mm512_store_si512(vt[u][j], _mm512_permutex2var_epi16(
              _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(v0 + d))), zip,
              _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(v1 + d)))));
        }
      }
      _tile_loadd(4, pa + kb * W * 16, 64);
      _tile_loadd(5, vt[0], 64);
      _tile_loadd(6, vt[1], 64);
      _tile_loadd(7, vt[2], 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(1, 4, 6);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, vt[3], 64);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, ot + 16 * u0, D * 4);
    _tile_stored(1, ot + 16 * (u0 + 1), D * 4);
    _tile_stored(2, ot + 16 * (u0 + 2), D * 4);
    _tile_stored(3, ot + 16 * (u0 + 3), D * 4);
  }
}

template <int D, int W>
static void decode_amx(const std::vector<SeqView>& seqs, int64_t G, int64_t Hkv, float scale) {
  constexpr int NK = D / 32;  // 32-dim slices of a query row: its B tiles
  const WorkItems items(seqs, Hkv);  // as decode_bf16: the same items and chunks
  const std::vector<int64_t> &chunk = items.chunk, &nchunks = items.nchunks, &first = items.first;
  std::vector<float> pmax(items.total() * G), psum(items.total() * G), pout(items.total() * G * D);
  at::parallel_for(0, items.total(), 1, [&](int64_t begin, int64_t end) {
    alignas(64) uint16_t qt[NK * 16 * 2 * W];  // the query rows as B tiles: [slice][dim pair][row][2]
    alignas(64) uint16_t staging[32 * D];       // key blocks that are short or span two segments, copied
    alignas(64) float ot[W * D], mx[16], sm[16];
    std::vector<float> st;                      // scores: [key][W rows]
    std::vector<uint32_t> pw, pa;               // numerator pairs: [key pair][W rows]; as A tiles [block][row][pair]
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = items.seq_of(item);
      const SeqView& sq = seqs[i];
      const int64_t h = (item - first[i]) / nchunks[i], c = (item - first[i]) % nchunks[i];
      const int64_t s0 = c * chunk[i], n = std::min(sq.S, s0 + chunk[i]) - s0, ld = (n + 31) / 32 * 32;
      std::memset(qt, 0, sizeof(qt));
      uint32_t* qw = reinterpret_cast<uint32_t*>(qt);
      for (int64_t g = 0; g < G; ++g) {
        const uint32_t* qrow = reinterpret_cast<const uint32_t*>(sq.q + (h * G + g) * D);
        for (int t = 0; t < NK; ++t)
          for (int r = 0; r < 16; ++r) qw[(t * 16 + r) * W + g] = qrow[16 * t + r];
      }
      st.resize(ld * W);
      pw.resize(ld / 2 * W);
      pa.resize(ld / 32 * W * 16);
      amx_scores<D, W>(sq, h, s0, n, qt, staging, st.data());
      amx_numerators<W>(st.data(), n, ld, scale, pw.data(), mx, sm);
      amx_pv<D, W>(sq, h, s0, n, ld, G, pw.data(), pa.data(), ot);
      for (int64_t g = 0; g < G; ++g) {
        pmax[item * G + g] = mx[g];
        psum[item * G + g] = sm[g];
        std::memcpy(pout.data() + (item * G + g) * D, ot + g * D, D * sizeof(float));
      }
    }
    _tile_release();
  });
  items.merge(seqs, pmax, psum, pout, Hkv, G, D);
}

// the AMX path where it was chosen and takes the shape (a group of at most 16 rows, head dim 64 or 128), else false
static bool decode_amx_fast(const std::vector<SeqView>& seqs, int64_t G, int64_t Hkv, int64_t D, double scale) {
  if (!amx_chosen.load(std::memory_order_relaxed) || G > 16 || !amx_granted()) return false;
  const float sc = static_cast<float>(scale);
  if (D == 64) G <= 8 ? decode_amx<64, 8>(seqs, G, Hkv, sc) : decode_amx<64, 16>(seqs, G, Hkv, sc);
  else if (D == 128) G <= 8 ? decode_amx<128, 8>(seqs, G, Hkv, sc) : decode_amx<128, 16>(seqs, G, Hkv, sc);
  else return false;
  return true;
}

static bool use_amx(bool on) { amx_chosen = on && amx_granted(); return amx_chosen; }
static bool amx_in_use() { return amx_chosen; }
static bool amx_built() { return amx_granted(); }
#else
static bool use_amx(bool) { return false; }
static bool amx_in_use() { return false; }
static bool amx_built() { return false; }
#ifdef __AVX512BF16__
static bool decode_amx_fast(const std::vector<SeqView>&, int64_t, int64_t, int64_t, double) { return false; }
#endif
#endif

#ifdef __AVX512BF16__
// the bf16 fast paths in order: AMX where chosen and it takes the shape, else AVX-512 BF16 (false: neither does)
static bool decode_fast(const std::vector<SeqView>& seqs, int64_t G, int64_t Hkv, int64_t D, double scale) {
  return decode_amx_fast(seqs, G, Hkv, D, scale) || decode_bf16_fast(seqs, G, Hkv, D, scale);
}
#endif

static void define_amx_switch(py::module& m) {
  m.def("use_amx", &use_amx);        // bf16 decode attention on the matrix unit from now on (false: AVX-512 BF16)
  m.def("amx_in_use", &amx_in_use);
  m.def("amx_built", &amx_built);    // whether this build has the AMX path and the process may use the tiles
}
"""
