"""The decode-attention kernel's fp32 path on AVX2 and FMA (C++ spliced into ragkv.ops.decode_kernel's source, where
`Rows`, `merge_chunks` and `chunk_of` are defined before it): one decode query row per head over each sequence's
cache, the path an AVX2-only CPU takes, where fp32 is the default dtype.

The generic loop summed each key's score horizontally for each query row and took a scalar exp per score: on a
2-core AVX2 Zen 3 it was 3.4x slower than SDPA (1.47 against 0.43 ms per layer at 2.4K keys), so fp32 decoded
through SDPA, one call (a thread fork and join) per sequence and layer. Here the scores of 8 keys at a time come
from FMAs over 8-lane vectors reduced together (`sum8`), the softmax's exp is a vector polynomial, P V reads each
value row once for the G query rows of its KV head, rows are asked ahead into L2, and all sequences of a step share
one parallel loop over (sequence, KV head, chunk), each sequence's chunks set by its own length (its numbers are
those it gets alone). Results equal SDPA's to fp32 rounding (the sums' order differs).
"""

F32_PATH = r"""
#if defined(__AVX2__) && defined(__FMA__)
// lane j of the result = the sum of the 8 lanes of v[j]
static inline __m256 sum8(const __m256* v) {
  const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);  // halves of v0..v3 / v4..v7 per lane
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

// e^x for x <= 0 (scores less their max): 2^n * 2^f, f in [-0.5, 0.5], 2^f by its Taylor series to degree 7
// (relative error < 1e-8); below -87 it is e^-87 (the exponent bits stay a normal number), ~1e-38 of the max's 1.
static inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.69314718055994531f));  // f ln 2
  __m256 p = _mm256_set1_ps(1.f / 5040);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 720));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

// one fp32 row's lines asked into L2, this many rows ahead of the loop that reads them: 24 layers x 16 sequences x
// 2,400 keys from memory took 0.90x the time of 32 rows ahead on AVX2 paths, 0.87-0.89x with AVX-512 (2-core Zen 4,
// interleaved; 8 and 24 no better than 16); with no requests 1.29-1.31x; into L1 1.18x
constexpr int64_t F32_AHEAD = 16;
static inline void prefetch_f32(const float* row, int64_t D) {
  for (int64_t off = 0; off < D * 4; off += 64) _mm_prefetch(reinterpret_cast<const char*>(row) + off, _MM_HINT_T1);
}

// One sequence's decode attention as the fp32 path reads it.
struct SeqF32 {
  const float* q; Rows<float> k, v; int64_t S; float* out;
};

template <int G, int D>
static void decode_f32(const std::vector<SeqF32>& seqs, int64_t Hkv, float scale) {
  constexpr int NQ = D / 8;  // registers per row
  const WorkItems items(seqs, Hkv);
  const std::vector<int64_t> &chunk = items.chunk, &nchunks = items.nchunks, &first = items.first;
  std::vector<float> pmax(items.total() * G), psum(items.total() * G), pout(items.total() * G * D);
  at::parallel_for(0, items.total(), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p;  // scores, then numerators: row g at g * ld
    alignas(32) float qs[G * D];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = items.seq_of(item);
      const SeqF32& sq = seqs[i];
      const int64_t h = (item - first[i]) / nchunks[i], c = (item - first[i]) % nchunks[i];
      const int64_t s0 = c * chunk[i], n = std::min(sq.S, s0 + chunk[i]) - s0, ld = (chunk[i] + 7) / 8 * 8;
      p.assign(G * ld, 0.f);
      for (int64_t j = 0; j < G * D; ++j) qs[j] = sq.q[h * G * D + j] * scale;
      for (int64_t j = 0; j < std::min<int64_t>(n, F32_AHEAD); ++j) prefetch_f32(sq.k.row(h, s0 + j), D);
      for (int64_t b = 0; b < n; b += 8) {  // scores, 8 keys at a time
        const int nb = static_cast<int>(std::min<int64_t>(8, n - b));
        const float* krow[8];
        for (int j = 0; j < 8; ++j) krow[j] = sq.k.row(h, s0 + b + std::min(j, nb - 1));  // a short block repeats
        const int64_t ahead = std::min(n + std::min(n, F32_AHEAD), b + F32_AHEAD + 8);  // keys, then values
        for (int64_t j = b + F32_AHEAD; j < ahead; ++j)
          prefetch_f32(j < n ? sq.k.row(h, s0 + j) : sq.v.row(h, s0 + j - n), D);
        for (int g = 0; g < G; ++g) {
          __m256 qv[NQ], acc[8];
          for (int t = 0; t < NQ; ++t) qv[t] = _mm256_load_ps(qs + g * D + 8 * t);
          for (int j = 0; j < 8; ++j) {
            __m256 a = _mm256_mul_ps(qv[0], _mm256_loadu_ps(krow[j]));
            for (int t = 1; t < NQ; ++t) a = _mm256_fmadd_ps(qv[t], _mm256_loadu_ps(krow[j] + 8 * t), a);
            acc[j] = a;
          }
          const __m256 s = sum8(acc);
          if (nb == 8) _mm256_storeu_ps(p.data() + g * ld + b, s);
          else {
            alignas(32) float tmp[8];
            _mm256_store_ps(tmp, s);
            std::memcpy(p.data() + g * ld + b, tmp, nb * sizeof(float));
          }
        }
      }
      for (int g = 0; g < G; ++g) {  // numerators in place, their max and sum (lanes past n stay 0)
        float* sc = p.data() + g * ld;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t s = 0; s < n; ++s) m = std::max(m, sc[s]);
        __m256 sv = _mm256_setzero_ps();
        const __m256 mv = _mm256_set1_ps(m);
        int64_t s = 0;
        for (; s + 8 <= n; s += 8) {
          const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + s), mv));
          _mm256_storeu_ps(sc + s, e);
          sv = _mm256_add_ps(sv, e);
        }
        if (s < n) {  // the last few: computed on a copy, only the valid lanes kept
          alignas(32) float tmp[8] = {0};
          std::memcpy(tmp, sc + s, (n - s) * sizeof(float));
          _mm256_store_ps(tmp, exp8(_mm256_sub_ps(_mm256_load_ps(tmp), mv)));
          for (int64_t j = 0; j < n - s; ++j) sc[s + j] = tmp[j];
          for (int64_t j = n - s; j < 8; ++j) tmp[j] = 0.f;
          sv = _mm256_add_ps(sv, _mm256_load_ps(tmp));
        }
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, sv);
        pmax[item * G + g] = m;
        psum[item * G + g] = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
      }
      // P V: 16 dims a pass, so the G x 2 accumulators stay in registers; each value row read once per pass
      for (int d0 = 0; d0 < D; d0 += 16) {
        __m256 a0[G], a1[G];
        for (int g = 0; g < G; ++g) a0[g] = a1[g] = _mm256_setzero_ps();
        for (int64_t s = 0; s < n; ++s) {
          if (d0 == 0 && s + F32_AHEAD < n) prefetch_f32(sq.v.row(h, s0 + s + F32_AHEAD), D);
          const float* vr = sq.v.row(h, s0 + s) + d0;
          const __m256 x = _mm256_loadu_ps(vr), y = _mm256_loadu_ps(vr + 8);
          for (int g = 0; g < G; ++g) {
            const __m256 w = _mm256_broadcast_ss(p.data() + g * ld + s);
            a0[g] = _mm256_fmadd_ps(w, x, a0[g]);
            a1[g] = _mm256_fmadd_ps(w, y, a1[g]);
          }
        }
        for (int g = 0; g < G; ++g) {
          float* po = pout.data() + (item * G + g) * D + d0;
          _mm256_storeu_ps(po, a0[g]);
          _mm256_storeu_ps(po + 8, a1[g]);
        }
      }
    }
  });
  items.merge(seqs, pmax, psum, pout, Hkv, G, D);
}

// the instantiation for (G, D), or false where there is none (the generic path takes it)
static bool decode_f32_fast(const std::vector<SeqF32>& seqs, int64_t G, int64_t Hkv, int64_t D, double scale) {
  return for_group_and_dim(G, D, [&](auto g, auto d) {
    decode_f32<decltype(g)::value, decltype(d)::value>(seqs, Hkv, static_cast<float>(scale));
  });
}
#endif
"""
