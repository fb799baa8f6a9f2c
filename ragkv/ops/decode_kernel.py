"""A CPU kernel for decode attention: one new query row per head over a long cache, read once.

PyTorch's CPU matmuls are slow for this shape (3 query rows per KV head against thousands of keys): measured
~300 us per layer at 2.5K keys, about 6 GB/s, and a copy of K to make it contiguous, while the machine reads
~30 GB/s. This kernel streams K and V once per KV head, in fp32 math (bf16 inputs widened on load), with the
keys split into chunks across threads and merged through their log-sum-exps (flash-decoding). In bf16 on AVX-512
BF16 the scores of 16 keys come from `vdpbf16ps` reduced together and the rows are prefetched ahead: at 2.4K keys
per sequence, a 16-sequence decode step's attention took 80 ms in the generic loop and 17 ms in this one (Zen 5).
`decode_attention_many` runs every plain sequence of a step in one call.

Built on first use with torch.utils.cpp_extension (cached under ~/.cache/torch_extensions); where that fails
(no compiler) or RAGKV_NO_CPP_KERNELS=1, `decode_attention` keeps its pure-torch path. Tested against SDPA.
On a CPU with AMX the bf16 path may run on the matrix unit instead (ops/decode_amx.py), where measured faster.
Sequences over shared blocks read in place: `parts_attention` (ops/decode_parts.py).
"""

from __future__ import annotations

import torch

from ragkv.ops.cpp_build import LazyExtension
from ragkv.ops.decode_amx import AMX_PATH
from ragkv.ops.decode_bf16 import BF16_PATH
from ragkv.ops.decode_f32 import F32_PATH
from ragkv.ops.decode_parts import PARTS_PATH
from ragkv.ops.trace import traced

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#include <immintrin.h>

// GCC/Clang vector extensions: the compiler lowers them to AVX-512, AVX2 or SSE, whatever -march=native has.
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef float v4 __attribute__((vector_size(16), aligned(4)));

static inline float hsum(v16 v) {  // a reduction tree, not 16 scalar adds
  v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// a key or value row widened to fp32 (bf16 -> fp32 is a 16-bit shift)
static inline const float* widen(const float* row, float*, int64_t) { return row; }
static inline const float* widen(const at::BFloat16* row, float* buf, int64_t D) {
  const uint16_t* u = reinterpret_cast<const uint16_t*>(row);
  uint32_t* b = reinterpret_cast<uint32_t*>(buf);
  for (int64_t d = 0; d < D; ++d) b[d] = static_cast<uint32_t>(u[d]) << 16;
  return buf;
}

static inline float dot(const float* a, const float* b, int64_t D) {
  int64_t d = 0;
  v16 acc = {0};
  for (; d + 16 <= D; d += 16) {
    v16 x, y;
    std::memcpy(&x, a + d, sizeof(v16));
    std::memcpy(&y, b + d, sizeof(v16));
    acc += x * y;
  }
  float out = hsum(acc);
  for (; d < D; ++d) out += a[d] * b[d];
  return out;
}

static inline void axpy(float p, const float* x, float* y, int64_t D) {  // y += p * x
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    v16 xv, yv;
    std::memcpy(&xv, x + d, sizeof(v16));
    std::memcpy(&yv, y + d, sizeof(v16));
    yv += p * xv;
    std::memcpy(y + d, &yv, sizeof(v16));
  }
  for (; d < D; ++d) y[d] += p * x[d];
}

// The rows of a cache's keys (or values): one buffer, or a shared prompt prefix (rows 0..n1) followed by a
// sequence's own rows. Row s of head h is found in place, so two segments give the same arithmetic as one buffer.
template <typename T>
struct Rows {
  const T* p1; int64_t h1, r1, n1;
  const T* p2; int64_t h2, r2;
  Rows(const at::Tensor& a, const at::Tensor* b)
      : p1(a.data_ptr<T>()), h1(a.stride(0)), r1(a.stride(1)), n1(a.size(1)),
        p2(b ? b->data_ptr<T>() : nullptr), h2(b ? b->stride(0) : 0), r2(b ? b->stride(1) : 0) {}
  // the first n rows of a buffer [Hkv, capacity, D] given by its strides (no view made)
  Rows(const T* p, int64_t h, int64_t r, int64_t n) : p1(p), h1(h), r1(r), n1(n), p2(nullptr), h2(0), r2(0) {}
  inline const T* row(int64_t h, int64_t s) const {
    return s < n1 ? p1 + h * h1 + s * r1 : p2 + h * h2 + (s - n1) * r2;
  }
};

// The chunks' partials (per KV head, chunk, group row: max, sum, unnormalized output) merged through their
// log-sum-exps into out [Hq, D] (flash-decoding's reduction).
static void merge_chunks(const float* pmax, const float* psum, const float* pout, int64_t Hkv, int64_t nchunks,
                         int64_t G, int64_t D, float* op) {
  for (int64_t h = 0; h < Hkv; ++h)
    for (int64_t g = 0; g < G; ++g) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < nchunks; ++c) m = std::max(m, pmax[(h * nchunks + c) * G + g]);
      float total = 0.f;
      float* o = op + (h * G + g) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
      for (int64_t c = 0; c < nchunks; ++c) {
        const int64_t slot = (h * nchunks + c) * G + g;
        const float w = std::exp(pmax[slot] - m);
        total += w * psum[slot];
        const float* po = pout + slot * D;
        for (int64_t d = 0; d < D; ++d) o[d] += w * po[d];
      }
      for (int64_t d = 0; d < D; ++d) o[d] /= total;
    }
}

static inline int64_t chunk_of(int64_t S) { return std::max<int64_t>(256, (S + 7) / 8); }

// A step's work items over several sequences, (sequence, KV head, chunk of keys) in that order: each sequence's
// chunks are set by its own length, so its numbers are those it gets alone, whatever runs beside it.
struct WorkItems {
  std::vector<int64_t> chunk, nchunks, first;  // first[b]: sequence b's first item
  template <typename Seq>
  WorkItems(const std::vector<Seq>& seqs, int64_t Hkv)
      : chunk(seqs.size()), nchunks(seqs.size()), first(seqs.size() + 1, 0) {
    for (size_t i = 0; i < seqs.size(); ++i) {
      chunk[i] = chunk_of(seqs[i].S);
      nchunks[i] = (seqs[i].S + chunk[i] - 1) / chunk[i];
      first[i + 1] = first[i] + Hkv * nchunks[i];
    }
  }
  int64_t total() const { return first.back(); }
  int64_t seq_of(int64_t item) const { return std::upper_bound(first.begin(), first.end(), item) - first.begin() - 1; }
  // each sequence's partials (item order (head, chunk) within it, as merge_chunks reads them) into its output
  template <typename Seq>
  void merge(const std::vector<Seq>& seqs, const std::vector<float>& pmax, const std::vector<float>& psum,
             const std::vector<float>& pout, int64_t Hkv, int64_t G, int64_t D) const {
    for (size_t i = 0; i < seqs.size(); ++i) {
      const int64_t at = first[i] * G;
      merge_chunks(pmax.data() + at, psum.data() + at, pout.data() + at * D, Hkv, nchunks[i], G, D, seqs[i].out);
    }
  }
};

// f(integral_constant G, integral_constant D) for the group sizes (1-8) and head dims (64, 128) the vector paths
// are instantiated for; false for any other shape (the generic loop takes it)
template <typename F>
static bool for_group_and_dim(int64_t G, int64_t D, F&& f) {
  auto with_dim = [&](auto g) {
    if (D == 64) f(g, std::integral_constant<int, 64>{});
    else if (D == 128) f(g, std::integral_constant<int, 128>{});
    else return false;
    return true;
  };
  switch (G) {
    case 1: return with_dim(std::integral_constant<int, 1>{});
    case 2: return with_dim(std::integral_constant<int, 2>{});
    case 3: return with_dim(std::integral_constant<int, 3>{});
    case 4: return with_dim(std::integral_constant<int, 4>{});
    case 5: return with_dim(std::integral_constant<int, 5>{});
    case 6: return with_dim(std::integral_constant<int, 6>{});
    case 7: return with_dim(std::integral_constant<int, 7>{});
    case 8: return with_dim(std::integral_constant<int, 8>{});
    default: return false;
  }
}
""" + BF16_PATH + AMX_PATH + F32_PATH + r"""
template <typename T>
static void decode_attn_impl(const at::Tensor& q, const Rows<T>& kr_, const Rows<T>& vr_, int64_t Hkv, int64_t S,
                             at::Tensor& out, double scale) {
  // q: [Hq, D] contiguous; keys and values: [Hkv, S, D] rows with unit stride in D; out: [Hq, D] fp32
  const int64_t Hq = q.size(0), D = q.size(1);
  const int64_t G = Hq / Hkv;
  const T* qp = q.data_ptr<T>();
  float* op = out.data_ptr<float>();
  const int64_t chunk = chunk_of(S);
  const int64_t nchunks = (S + chunk - 1) / chunk;
  // partial results per (kv head, chunk): max and sum per query row, and an unnormalized output
  std::vector<float> pmax(Hkv * nchunks * G), psum(Hkv * nchunks * G), pout(Hkv * nchunks * G * D, 0.f);
  at::parallel_for(0, Hkv * nchunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), scores(G * chunk), acc(G * D), row(D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / nchunks, c = item % nchunks;
      const int64_t s0 = c * chunk, s1 = std::min(S, s0 + chunk), n = s1 - s0;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = static_cast<float>(qp[(h * G + g) * D + d]) * scale;
      for (int64_t s = 0; s < n; ++s) {
        const float* kr = widen(kr_.row(h, s0 + s), row.data(), D);
        for (int64_t g = 0; g < G; ++g) scores[g * chunk + s] = dot(qf.data() + g * D, kr, D);
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sc = scores.data() + g * chunk;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t s = 0; s < n; ++s) m = std::max(m, sc[s]);
        float sum = 0.f;
        for (int64_t s = 0; s < n; ++s) { sc[s] = std::exp(sc[s] - m); sum += sc[s]; }
        const int64_t slot = (h * nchunks + c) * G + g;
        pmax[slot] = m;
        psum[slot] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t s = 0; s < n; ++s) {  // each value row read once for all G query rows
        const float* vr = widen(vr_.row(h, s0 + s), row.data(), D);
        for (int64_t g = 0; g < G; ++g) axpy(scores[g * chunk + s], vr, acc.data() + g * D, D);
      }
      for (int64_t g = 0; g < G; ++g)
        std::memcpy(pout.data() + ((h * nchunks + c) * G + g) * D, acc.data() + g * D, D * sizeof(float));
    }
  });
  merge_chunks(pmax.data(), psum.data(), pout.data(), Hkv, nchunks, G, D, op);
}

static void check_kv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3, "k/v [Hkv, S, D]");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k and v need unit stride along D");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "one dtype");
}

// keys and values in one buffer (k, v), or in two segments read as one (k, v then k2, v2: a shared prefix first)
static at::Tensor attend(at::Tensor q, const at::Tensor& k, const at::Tensor& v, const at::Tensor* k2,
                         const at::Tensor* v2, double scale) {
  TORCH_CHECK(q.dim() == 2, "q [Hq, D]");
  check_kv(q, k, v);
  if (k2) {
    check_kv(q, *k2, *v2);
    TORCH_CHECK(k2->size(0) == k.size(0) && k2->size(1) == v2->size(1), "segments of one cache");
  }
  q = q.contiguous();
  const int64_t Hkv = k.size(0), S = k.size(1) + (k2 ? k2->size(1) : 0);
  auto out = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  if (q.scalar_type() == at::kFloat) {
    const Rows<float> kr(k, k2), vr(v, v2);
#if defined(__AVX2__) && defined(__FMA__)
    const std::vector<SeqF32> one{{q.data_ptr<float>(), kr, vr, S, out.data_ptr<float>()}};
    if (decode_f32_fast(one, q.size(0) / Hkv, Hkv, q.size(1), scale)) return out;
#endif
    decode_attn_impl<float>(q, kr, vr, Hkv, S, out, scale);
  }
  else if (q.scalar_type() == at::kBFloat16) {
    const Rows<at::BFloat16> kr(k, k2), vr(v, v2);
#ifdef __AVX512BF16__
    const std::vector<SeqView> one{{reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()), kr, vr, S,
                                    out.data_ptr<float>()}};
    if (decode_fast(one, q.size(0) / Hkv, Hkv, q.size(1), scale)) return out;
#endif
    decode_attn_impl<at::BFloat16>(q, kr, vr, Hkv, S, out, scale);
  }
  else TORCH_CHECK(false, "decode_attention supports float32 and bfloat16");
  return out;
}

at::Tensor decode_attention(at::Tensor q, at::Tensor k, at::Tensor v, double scale) {
  return attend(q, k, v, nullptr, nullptr, scale);
}

// Several sequences' decode attention in one call: q [B, Hq, D], keys[b] / values[b] [Hkv, S_b, D] -> [B, Hq, D]
// fp32. Each sequence's numbers equal its own `decode_attention` call's (bitwise): the bf16 and fp32 paths' work items of
// all sequences share one parallel loop; other dtypes and shapes go sequence by sequence.
at::Tensor decode_attention_many(at::Tensor q, std::vector<at::Tensor> ks, std::vector<at::Tensor> vs, double scale) {
  TORCH_CHECK(q.dim() == 3 && (int64_t)ks.size() == q.size(0) && ks.size() == vs.size(), "q [B, Hq, D], B keys, B values");
  q = q.contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  auto out = at::empty({B, Hq, D}, q.options().dtype(at::kFloat));
#ifdef __AVX512BF16__
  if (q.scalar_type() == at::kBFloat16 && B > 0) {
    std::vector<SeqView> seqs;
    for (int64_t b = 0; b < B; ++b) {
      check_kv(q, ks[b], vs[b]);
      TORCH_CHECK(ks[b].size(0) == ks[0].size(0) && ks[b].size(1) == vs[b].size(1), "one model's caches");
      seqs.push_back({reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()) + b * Hq * D,
                      Rows<at::BFloat16>(ks[b], nullptr), Rows<at::BFloat16>(vs[b], nullptr), ks[b].size(1),
                      out.data_ptr<float>() + b * Hq * D});
    }
    if (decode_fast(seqs, Hq / ks[0].size(0), ks[0].size(0), D, scale)) return out;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (q.scalar_type() == at::kFloat && B > 0) {
    std::vector<SeqF32> seqs;
    for (int64_t b = 0; b < B; ++b) {
      check_kv(q, ks[b], vs[b]);
      TORCH_CHECK(ks[b].size(0) == ks[0].size(0) && ks[b].size(1) == vs[b].size(1), "one model's caches");
      seqs.push_back({q.data_ptr<float>() + b * Hq * D, Rows<float>(ks[b], nullptr), Rows<float>(vs[b], nullptr),
                      ks[b].size(1), out.data_ptr<float>() + b * Hq * D});
    }
    if (decode_f32_fast(seqs, Hq / ks[0].size(0), ks[0].size(0), D, scale)) return out;
  }
#endif
  for (int64_t b = 0; b < B; ++b) out.select(0, b).copy_(attend(q.select(0, b), ks[b], vs[b], nullptr, nullptr, scale));
  return out;
}

// A decode step's plain sequences in one call, their new rows written first: k_new / v_new [B, Hkv, D] go to row
// lengths[b] of each cache's buffers kbufs[b] / vbufs[b] [1, Hkv, capacity, D] (capacity > lengths[b]), then each
// sequence attends over its lengths[b] + 1 rows, as `decode_attention_many` over those views would (bitwise). One
// call a layer instead of two slice copies and two views a sequence from Python; on the bf16 paths no view at all
// (four per sequence and layer were ~1,500 view ops a 16-sequence step).
at::Tensor append_attention_many(at::Tensor q, at::Tensor k_new, at::Tensor v_new, std::vector<at::Tensor> kbufs,
                                 std::vector<at::Tensor> vbufs, std::vector<int64_t> lengths, double scale) {
  const int64_t B = q.size(0);
  TORCH_CHECK((int64_t)kbufs.size() == B && (int64_t)vbufs.size() == B && (int64_t)lengths.size() == B &&
              k_new.dim() == 3 && k_new.size(0) == B && v_new.sizes() == k_new.sizes(), "B rows, B caches");
  TORCH_CHECK(k_new.scalar_type() == q.scalar_type() && v_new.scalar_type() == q.scalar_type() &&
              k_new.stride(2) == 1 && v_new.stride(2) == 1, "new rows in q's dtype, unit stride along D");
  const int64_t Hkv = k_new.size(1), D = k_new.size(2), es = k_new.element_size();
  TORCH_CHECK(q.dim() == 3 && q.size(2) == D && Hkv > 0 && q.size(1) % Hkv == 0, "q [B, Hq, D], Hq a multiple of Hkv");
  for (int64_t b = 0; b < B; ++b) {
    const at::Tensor &kb = kbufs[b], &vb = vbufs[b];  // [1, Hkv, capacity, D], read through strides 1-3
    TORCH_CHECK(kb.dim() == 4 && kb.size(0) == 1 && vb.sizes() == kb.sizes() && lengths[b] >= 0 &&
                lengths[b] < kb.size(2) && kb.size(1) == Hkv && kb.size(3) == D && kb.stride(3) == 1 &&
                vb.stride(3) == 1 && kb.scalar_type() == q.scalar_type() && vb.scalar_type() == q.scalar_type(),
                "a cache buffer [1, Hkv, capacity, D] in q's dtype with room for its row");
    for (const auto& [dst, src] : {std::pair<const at::Tensor&, const at::Tensor&>(kb, k_new),
                                   std::pair<const at::Tensor&, const at::Tensor&>(vb, v_new)}) {
      char* d = static_cast<char*>(dst.data_ptr()) + lengths[b] * dst.stride(2) * es;
      const char* from = static_cast<const char*>(src.data_ptr()) + b * src.stride(0) * es;
      for (int64_t h = 0; h < Hkv; ++h)
        std::memcpy(d + h * dst.stride(1) * es, from + h * src.stride(1) * es, D * es);
    }
  }
#ifdef __AVX512BF16__
  if (q.scalar_type() == at::kBFloat16 && B > 0) {  // each cache's rows read through its strides: no views
    q = q.contiguous();
    const int64_t Hq = q.size(1);
    auto out = at::empty({B, Hq, D}, q.options().dtype(at::kFloat));
    std::vector<SeqView> seqs;
    seqs.reserve(B);
    for (int64_t b = 0; b < B; ++b) {
      const at::Tensor &kb = kbufs[b], &vb = vbufs[b];  // [1, Hkv, capacity, D]
      seqs.push_back({reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()) + b * Hq * D,
                      Rows<at::BFloat16>(kb.data_ptr<at::BFloat16>(), kb.stride(1), kb.stride(2), lengths[b] + 1),
                      Rows<at::BFloat16>(vb.data_ptr<at::BFloat16>(), vb.stride(1), vb.stride(2), lengths[b] + 1),
                      lengths[b] + 1, out.data_ptr<float>() + b * Hq * D});
    }
    if (decode_fast(seqs, Hq / Hkv, Hkv, D, scale)) return out;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (q.scalar_type() == at::kFloat && B > 0) {  // likewise
    q = q.contiguous();
    const int64_t Hq = q.size(1);
    auto out = at::empty({B, Hq, D}, q.options());
    std::vector<SeqF32> seqs;
    seqs.reserve(B);
    for (int64_t b = 0; b < B; ++b) {
      const at::Tensor &kb = kbufs[b], &vb = vbufs[b];
      seqs.push_back({q.data_ptr<float>() + b * Hq * D,
                      Rows<float>(kb.data_ptr<float>(), kb.stride(1), kb.stride(2), lengths[b] + 1),
                      Rows<float>(vb.data_ptr<float>(), vb.stride(1), vb.stride(2), lengths[b] + 1),
                      lengths[b] + 1, out.data_ptr<float>() + b * Hq * D});
    }
    if (decode_f32_fast(seqs, Hq / Hkv, Hkv, D, scale)) return out;
  }
#endif
  std::vector<at::Tensor> ks, vs;
  ks.reserve(B);
  vs.reserve(B);
  for (int64_t b = 0; b < B; ++b) {
    ks.push_back(kbufs[b].select(0, 0).narrow(1, 0, lengths[b] + 1));
    vs.push_back(vbufs[b].select(0, 0).narrow(1, 0, lengths[b] + 1));
  }
  return decode_attention_many(q, ks, vs, scale);
}

at::Tensor decode_attention2(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor k2, at::Tensor v2, double scale) {
  return attend(q, k, v, &k2, &v2, scale);
}

""" + PARTS_PATH + r"""
// the GIL is released while a kernel runs: the server's HTTP thread streams tokens meanwhile (holding it,
// these kernels starved the event loop: a first token reached the client ~0.2 s after it was sampled)
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, py::call_guard<py::gil_scoped_release>());
  m.def("decode_attention2", &decode_attention2, py::call_guard<py::gil_scoped_release>());
  m.def("decode_attention_many", &decode_attention_many, py::call_guard<py::gil_scoped_release>());
  m.def("append_attention_many", &append_attention_many, py::call_guard<py::gil_scoped_release>());
  m.def("parts_attention", &parts_attention, py::call_guard<py::gil_scoped_release>());
  define_amx_switch(m);
}
"""

_NAME = "ragkv_decode_attention_v28"
# the compiled module, or None (callers use their torch path); -ffast-math vectorizes the fp32 dot products' sums
kernel = LazyExtension(_NAME, _SOURCE, "decode-attention kernel", fast_math=True)


def decode_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         k2: torch.Tensor | None = None, v2: torch.Tensor | None = None) -> torch.Tensor | None:
    """q [1, Hq, 1, D]; k, v [1, Hkv, S, D] cache views -> [1, Hq, 1, D] in q's dtype, or None (no kernel).
    k2, v2: a second segment of the same cache after k, v (a shared prompt prefix, then a choice's own rows), read
    in place with the same arithmetic as if both were one buffer."""
    mod = kernel()
    if mod is None:
        return None
    B, Hq, T, D = q.shape
    with traced("ragkv::decode_attention"):  # visible to `bench decode`'s profile
        if k2 is None:
            out = mod.decode_attention(q.reshape(Hq, D), k[0], v[0], 1.0 / D ** 0.5)
        else:
            out = mod.decode_attention2(q.reshape(Hq, D), k[0], v[0], k2[0], v2[0], 1.0 / D ** 0.5)
    return out.to(q.dtype).reshape(B, Hq, T, D)


def decode_attention_many_cpu(q: torch.Tensor, keys: list[torch.Tensor],
                              values: list[torch.Tensor]) -> torch.Tensor | None:
    """q [B, Hq, 1, D]; keys[b], values[b] [1, Hkv, S_b, D] cache views -> [B, Hq, 1, D] in q's dtype, or None (no
    kernel). Sequence b's rows equal `decode_attention_cpu(q[b:b+1], keys[b], values[b])` bitwise; the bf16 path
    runs all of them in one parallel loop (one fork and join per layer, not one per sequence)."""
    mod = kernel()
    if mod is None:
        return None
    B, Hq, T, D = q.shape
    with traced("ragkv::decode_attention"):
        out = mod.decode_attention_many(q.reshape(B, Hq, D), [k[0] for k in keys], [v[0] for v in values],
                                        1.0 / D ** 0.5)
    return out.to(q.dtype).reshape(B, Hq, T, D)


def append_attention_many_cpu(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, key_buffers: list[torch.Tensor],
                              value_buffers: list[torch.Tensor], lengths: list[int]) -> torch.Tensor | None:
    """q [B, Hq, 1, D]; k_new, v_new [B, Hkv, 1, D] (this step's rows); key_buffers[b], value_buffers[b]: cache
    buffers [1, Hkv, capacity, D] holding lengths[b] rows, with room for one more -> [B, Hq, 1, D] in q's dtype, or
    None (no kernel). Writes each new row at lengths[b], then equals `decode_attention_many_cpu` over the first
    lengths[b] + 1 rows, bitwise."""
    mod = kernel()
    if mod is None:
        return None
    B, Hq, T, D = q.shape
    with traced("ragkv::decode_attention"):
        out = mod.append_attention_many(q.reshape(B, Hq, D), k_new[:, :, 0], v_new[:, :, 0], key_buffers,
                                        value_buffers, lengths, 1.0 / D ** 0.5)
    return out.to(q.dtype).reshape(B, Hq, T, D)


def parts_attention_cpu(q_rows: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                        row_part: torch.Tensor, row_scale: torch.Tensor, row_seq: torch.Tensor,
                        row_group: torch.Tensor, factor: torch.Tensor, sequences: int,
                        masks: list[torch.Tensor] | None = None) -> torch.Tensor | None:
    """One decode step's attention for several sequences over parts read in place (the kernel's `parts_impl`):
    q_rows [R, Hq, D], row r reading keys[row_part[r]] / values[...] ([Hkv, n, D] views) at score scale
    row_scale[r] for sequence row_seq[r]; rows of row_group 1 merge first and their joint LSE is scaled by
    factor[seq]; masks[r] (bool [n], or empty: none) hides keys from row r. -> [sequences, Hq, D] fp32, or None
    (no kernel)."""
    mod = kernel()
    if mod is None:
        return None
    with traced("ragkv::parts_attention"):
        if masks is None:
            masks = [torch.empty(0, dtype=torch.bool)] * q_rows.shape[0]
        return mod.parts_attention(q_rows, keys, values, row_part, row_scale, row_seq, row_group, factor, sequences,
                                   masks)
