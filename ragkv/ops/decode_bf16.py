"""The decode-attention kernel's AVX-512 BF16 path (C++ spliced into ragkv.ops.decode_kernel's source, where `Rows`,
`merge_chunks` and `chunk_of` are defined before it): one decode query row per head over each sequence's cache.

Scores of 16 keys at a time come from `vdpbf16ps` (bf16 pairs multiplied exactly, summed in fp32) and their 16
lane-vectors are reduced together (`sum16`); the softmax's exp is a vector polynomial; its numerators are rounded to
bf16 and P V runs on `vdpbf16ps` over pairs of keys, as the AMX path and SDPA's flash attention on AMX do (the
divisor sums the rounded numerators, so the weights P V applies sum to it). Rows are prefetched a few blocks
ahead. Several sequences share one parallel loop over (sequence, KV head, chunk), each sequence's chunks set by its
own length, so its numbers are those it gets alone. Measured on a 2-core Zen 5 at 2.4K
keys: ~210 us per layer for the generic loop (~5 GB/s), 34-55 us here (L3 or memory); a 16-sequence step's attention 80 -> 17 ms.
P V in bf16 pairs against fp32 (2-core Zen 4, 16 sequences x 2.4K keys, 24 layers, interleaved): 0.90x the time
from memory, 0.85x from cache; a 16-sequence decode step of the 0.5B 0.95x.
K stays row-major: a key-major copy kept beside the cache (16 keys' pair of dims a register, no `sum16`, each key
read once for the G rows) took 0.74x the time from cache but 0.94x from memory (2-core Zen 4, 16 x 2.4K keys,
where a step's caches far exceed L3). From memory the step's attention is bound by compute and memory about
equally (with rows asked into L2: 17.1 ms with the KV in cache, 23.4 from memory, where the 472 MB alone take ~16 ms
at the ~30 GB/s a two-thread fp32 sum reads): saving arithmetic alone moves it little.
"""

BF16_PATH = r"""
#ifdef __AVX512BF16__
// bf16 on AVX-512 BF16: the scores of 16 keys at a time by `vdpbf16ps` (bf16 pairs multiplied exactly, summed in
// fp32), their 16 lane-vectors reduced together (`sum16`: 45 shuffles and adds for 16 keys, where one horizontal
// sum per key and query row cost the scalar path ~8 dependent steps each), a vector exp, and P V in bf16 pairs. The
// generic path above spent ~210 us per layer at 2.4K keys (~5 GB/s); this one reads K and V at 23 GB/s from memory
// and 36 GB/s from L3 (2-core Zen 5, which streams 64-80 GB/s: the rest is the scores' and P V's arithmetic).

// lane j of the result = the sum of the 16 lanes of v[j]
static inline __m512 sum16(const __m512* v) {
  __m512 x[8], y[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: (a0+a2, b0+b2, a1+a3, b1+b3)
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: keys 4i..4i+3, each summed over its lane
    const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x88), _mm512_shuffle_f32x4(y[2], y[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

// e^x for x <= 0 (scores less their max): 2^n * 2^f, f in [-0.5, 0.5], 2^f by its Taylor series to degree 7
// (relative error < 1e-8); below -87 it is 0 to fp32's precision.
static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718055994531f));  // f ln 2
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

static inline __m512 widen16(__m256i b) {  // 16 bf16 -> fp32 (a 16-bit shift)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}
static inline __m512 widen16(const uint16_t* p) { return widen16(_mm256_loadu_si256((const __m256i*)p)); }

// Rows read this far ahead are asked of memory first, into L2: the scores and P V spend ~50 cycles a key, so the
// hardware prefetcher alone left a cache far beyond L3 read at ~15 GB/s, a third of what the machine streams; asked
// into L1 instead, a 16-sequence step's attention took 1.11x the time (2-core Zen 4: L1's few miss buffers). The AMX
// path (decode_amx.py) asks through this too, not yet timed both ways on an AMX CPU.
constexpr int64_t PREFETCH = 64;
static inline void prefetch_row(const at::BFloat16* row, int64_t D) {
  for (int64_t off = 0; off < D * 2; off += 64) _mm_prefetch(reinterpret_cast<const char*>(row) + off, _MM_HINT_T1);
}

// One sequence's decode attention as the bf16 path reads it: its query rows, keys, values, length and output.
struct SeqView {
  const uint16_t* q; Rows<at::BFloat16> k, v; int64_t S; float* out;
};

// Several sequences in one parallel loop over (sequence, KV head, chunk of keys): each sequence's chunks depend on
// its own length only, so its numbers are those it gets alone, whatever runs beside it.
template <int G, int D>
static void decode_bf16(const std::vector<SeqView>& seqs, int64_t Hkv, float scale) {
  constexpr int NQ = D / 32;  // bf16 registers per query row
  const WorkItems items(seqs, Hkv);
  const std::vector<int64_t> &chunk = items.chunk, &nchunks = items.nchunks, &first = items.first;
  // partials per work item and group row: max, sum, unnormalized output
  std::vector<float> pmax(items.total() * G), psum(items.total() * G), pout(items.total() * G * D);
  at::parallel_for(0, items.total(), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<uint16_t> p16;  // the numerators in bf16, row g at g * ldp
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = items.seq_of(item);
      const SeqView& sq = seqs[i];
      const int64_t h = (item - first[i]) / nchunks[i], c = (item - first[i]) % nchunks[i];
      const int64_t s0 = c * chunk[i], n = std::min(sq.S, s0 + chunk[i]) - s0, ld = (chunk[i] + 15) / 16 * 16;
      const int64_t ldp = ld + 16;
      scores.resize(G * ld);
      __m512bh qv[G][NQ];
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < NQ; ++j) qv[g][j] = (__m512bh)_mm512_loadu_si512(sq.q + (h * G + g) * D + 32 * j);
      // the chunk's first keys asked for at once (the loop below asks PREFETCH rows ahead of itself); its last
      // blocks ask for the first values, which P V reads next
      for (int64_t j = 0; j < std::min<int64_t>(n, PREFETCH); ++j) prefetch_row(sq.k.row(h, s0 + j), D);
      for (int64_t b = 0; b < n; b += 16) {  // scores, 16 keys at a time
        const int nb = static_cast<int>(std::min<int64_t>(16, n - b));
        const uint16_t* krow[16];
        for (int j = 0; j < 16; ++j)  // a short last block repeats its last key; those lanes are not stored
          krow[j] = reinterpret_cast<const uint16_t*>(sq.k.row(h, s0 + b + std::min(j, nb - 1)));
        const __mmask16 keep = static_cast<__mmask16>((1u << nb) - 1);
        const int64_t ahead = std::min(n + std::min(n, PREFETCH), b + PREFETCH + 16);  // keys, then values
        for (int64_t j = b + PREFETCH; j < ahead; ++j)
          prefetch_row(j < n ? sq.k.row(h, s0 + j) : sq.v.row(h, s0 + j - n), D);
        for (int g = 0; g < G; ++g) {
          __m512 acc[16];
          for (int j = 0; j < 16; ++j) {
            __m512 a = _mm512_setzero_ps();
            for (int q = 0; q < NQ; ++q) a = _mm512_dpbf16_ps(a, qv[g][q], (__m512bh)_mm512_loadu_si512(krow[j] + 32 * q));
            acc[j] = a;
          }
          _mm512_mask_storeu_ps(scores.data() + g * ld + b, keep, _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
        }
      }
      p16.resize(G * ldp);
      for (int g = 0; g < G; ++g) {  // softmax numerators rounded to bf16, their max, and the sum of the rounded
        float* sc = scores.data() + g * ld;
        uint16_t* pr = p16.data() + g * ldp;
        __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        for (int64_t b = 0; b < n; b += 16) {
          const __mmask16 k = static_cast<__mmask16>((1u << std::min<int64_t>(16, n - b)) - 1);
          mv = _mm512_mask_max_ps(mv, k, mv, _mm512_maskz_loadu_ps(k, sc + b));
        }
        const float m = _mm512_reduce_max_ps(mv);
        __m512 sv = _mm512_setzero_ps();
        for (int64_t b = 0; b < ld; b += 16) {  // lanes past n are 0, and so is the pair partner of an odd last key
          const __mmask16 k = static_cast<__mmask16>((1u << std::clamp<int64_t>(n - b, 0, 16)) - 1);
          const __m512 p = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sc + b), _mm512_set1_ps(m))));
          const __m256i r = (__m256i)_mm512_cvtneps_pbh(p);
          _mm256_storeu_si256((__m256i*)(pr + b), r);
          sv = _mm512_add_ps(sv, widen16(r));  // the rounded numerators, as P V applies them
        }
        pr[ld] = 0;  // n == ld: the partner of an odd last key
        pmax[item * G + g] = m;
        psum[item * G + g] = _mm512_reduce_add_ps(sv);
      }
      // P V by `vdpbf16ps` over pairs of keys: two value rows interleaved (lane l of `lo` holds dims 8l..8l+3 of
      // both, of `hi` dims 8l+4..8l+7), each query row's pair of numerators broadcast; 32 dims a pass, so the G x 2
      // accumulators stay in registers. Half the multiply-adds of fp32 P V, no widening of V.
      const __m512i lo_dims = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
      const __m512i hi_dims = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
      for (int d0 = 0; d0 < D; d0 += 32) {
        __m512 a0[G], a1[G];
        for (int g = 0; g < G; ++g) a0[g] = a1[g] = _mm512_setzero_ps();
        for (int64_t s = 0; s < n; s += 2) {
          if (d0 == 0 && s + PREFETCH < n) {
            prefetch_row(sq.v.row(h, s0 + s + PREFETCH), D);
            if (s + PREFETCH + 1 < n) prefetch_row(sq.v.row(h, s0 + s + PREFETCH + 1), D);
          }
          const __m512i x = _mm512_loadu_si512(reinterpret_cast<const uint16_t*>(sq.v.row(h, s0 + s)) + d0);
          const __m512i y = _mm512_loadu_si512(
              reinterpret_cast<const uint16_t*>(sq.v.row(h, s0 + std::min(s + 1, n - 1))) + d0);
          const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x, y), hi = (__m512bh)_mm512_unpackhi_epi16(x, y);
          for (int g = 0; g < G; ++g) {
            int32_t pair;
            std::memcpy(&pair, p16.data() + g * ldp + s, sizeof pair);
            const __m512bh pb = (__m512bh)_mm512_set1_epi32(pair);
            a0[g] = _mm512_dpbf16_ps(a0[g], pb, lo);
            a1[g] = _mm512_dpbf16_ps(a1[g], pb, hi);
          }
        }
        for (int g = 0; g < G; ++g) {  // back to dims in order
          float* po = pout.data() + (item * G + g) * D + d0;
          _mm512_storeu_ps(po, _mm512_permutex2var_ps(a0[g], lo_dims, a1[g]));
          _mm512_storeu_ps(po + 16, _mm512_permutex2var_ps(a0[g], hi_dims, a1[g]));
        }
      }
    }
  });
  items.merge(seqs, pmax, psum, pout, Hkv, G, D);
}

// the instantiation for (G, D), or false where there is none (the generic path takes it)
static bool decode_bf16_fast(const std::vector<SeqView>& seqs, int64_t G, int64_t Hkv, int64_t D, double scale) {
  return for_group_and_dim(G, D, [&](auto g, auto d) {
    decode_bf16<decltype(g)::value, decltype(d)::value>(seqs, Hkv, static_cast<float>(scale));
  });
}
#endif
"""
