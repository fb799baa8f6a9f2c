"""A CPU kernel for bf16 products of a few rows (decode) at the memory bandwidth: y = x W^T (+ b).

A decode step reads every weight once for one row (or a few), so its time is the weights' bytes over the bandwidth
the kernel reaches. On a 2-core Zen 4 (AVX-512 BF16) torch's bf16 kernel read 14-19 GB/s and oneDNN's with a
prepacked weight 19-26 GB/s, where this one reads 29-34 GB/s (a bf16 sum reads ~35): W is packed once as
[N/64][K/2][64][2], so each thread streams one contiguous run of the weight, and each step of the inner loop is
one AVX-512 BF16 `vdpbf16ps` per 16 outputs, over a broadcast pair of x's values (no horizontal sums). Products
of the pairs are summed in fp32, bias added in fp32, rounded to bf16 once (as oneDNN does); the sum order differs
from oneDNN's, so results equal to bf16 rounding, not bitwise. From 2 rows on every row's sums run over the pairs in
one order, so a row's output is bitwise the same in a product of 2 or 16 rows. More than 4 rows (a batched decode
step) read each block a range of pairs at a time, every group of 4 rows computing over the range while it is in
L1 and asking memory for a share of the next: at 16 rows on a 2-core Zen 4 a step's products (Qwen 0.5B's shapes,
24 layers of weights from memory) took 0.81x the time of groups that each ran over the whole block (the first
streaming it, the others computing from L2, in turn), and a 16-sequence decode step over 2.4K-token prompts 104 ms
against 110 (the two kernels interleaved in one process).

The same kernel takes int8 weights (symmetric, one fp32 scale per output; `pack(..., int8=True)`): each 32 weights
are converted to bf16 in registers (exactly: |q| <= 127), multiplied as above, and the fp32 sums scaled once per
output. It reads half the bytes of bf16 and computes x_bf16 . (q * scale) exactly as the bf16 path would with the
dequantized weight (tested against that).

Built where the compiler targets AVX-512 BF16 (-march=native on AVX-512 BF16 or AMX CPUs); elsewhere, or with
RAGKV_NO_CPP_KERNELS=1, `kernel()` is None and callers keep oneDNN's path. Tested against F.linear.
"""

from __future__ import annotations

import torch

from ragkv.config import cpu_has
from ragkv.ops.cpp_build import LazyExtension
from ragkv.ops.huge_pages import on_huge_pages
from ragkv.ops.trace import traced

BLOCK = 64  # outputs per packed block: four 16-lane accumulators per row
MAX_ROWS = 16  # rows this kernel takes; more are compute-bound, where oneDNN's GEMM is at the CPU's peak

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <immintrin.h>
#include <cstring>

#ifdef __AVX512BF16__
static constexpr int64_t MAX_ROWS = 16;  // as the Python side's MAX_ROWS
// 32 weights of one pair-interleaved run as bf16: a bf16 weight is loaded, an int8 one converted (exact: |q| <= 127
// fits bf16's 8 significant bits), so the int8 copy reads half the bytes through the same products.
template <bool I8>
static inline __m512bh load_w(const void* w, int64_t at) {
  if (I8) {
    const int8_t* p = static_cast<const int8_t*>(w) + at;
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);
  }
  return (__m512bh)_mm512_loadu_si512(static_cast<const uint16_t*>(w) + at);
}

// The L lines of weights PREFETCH_BYTES ahead of element `at` asked into L2: on a 2-core AMX Xeon one row's products
// read 25 GB/s with the request (then into L1), 21.7 without (24 layers' weights, more than the cache holds); on a
// 2-core Zen 4 the request into L1 gained nothing (without any, the products took 0.97x its time), into L2 they took
// 0.90-0.94x at 1 and 4 rows, 0.97x at 16 (L1's few miss buffers held the stream back). A prefetch never faults, so
// the lines past the end of the weights cost nothing but the request.
static constexpr int64_t PREFETCH_BYTES = 2048;
template <bool I8, int L>
static inline void prefetch_ahead(const void* w, int64_t at) {
  const char* p = static_cast<const char*>(w) + at * (I8 ? 1 : 2) + PREFETCH_BYTES;
  for (int c = 0; c < L; ++c) _mm_prefetch(p + 64 * c, _MM_HINT_T1);
}

// R rows' fp32 sums of one block ([R][64]) out as bf16: the int8 copy's scale and the bias applied in fp32, then
// one rounding (to nearest even, as torch does); a block past N stores only its valid outputs.
template <bool I8>
static inline void finish_rows(const float* sums, int R, const float* scale, const float* bias, uint16_t* y,
                               int64_t ystride, int64_t n0, int64_t N) {
  int64_t valid = N - n0 < 64 ? N - n0 : 64;
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) {
      int64_t lo = j * 16;
      if (lo >= valid) break;
      __m512 v = _mm512_load_ps(sums + r * 64 + lo);
      if (I8) v = _mm512_mul_ps(v, _mm512_loadu_ps(scale + n0 + lo));  // scales are padded to the blocks
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n0 + lo));  // so is the bias
      __m256i b = (__m256i)_mm512_cvtneps_pbh(v);
      uint16_t* out = y + r * ystride + n0 + lo;
      if (valid - lo >= 16) {
        _mm256_storeu_si256((__m256i*)out, b);
      } else {
        uint16_t tmp[16];
        _mm256_storeu_si256((__m256i*)tmp, b);
        std::memcpy(out, tmp, (valid - lo) * sizeof(uint16_t));
      }
    }
  }
}

// R rows over pairs kp0..kp1 of one block, their fp32 sums carried in `sums` ([R][64]) from one range of pairs to
// the next (a range or the whole block: the same additions in the same order); `prefetch` asks for the lines just
// ahead into L1, and `lines` lines a pair from `next` on into L2 (none: 0).
template <int R, bool I8>
static inline void accumulate(const uint32_t* x, int64_t xstride, const void* w, int64_t kp0, int64_t kp1,
                              bool prefetch, const char* next, int lines, float* sums) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_load_ps(sums + r * 64 + 16 * j);
  for (int64_t kp = kp0; kp < kp1; ++kp) {
    int64_t t = kp * 128;
    if (prefetch) prefetch_ahead<I8, 4>(w, t);
    for (int c = 0; c < lines; ++c) _mm_prefetch(next + 64 * (lines * (kp - kp0) + c), _MM_HINT_T1);
    __m512bh w0 = load_w<I8>(w, t), w1 = load_w<I8>(w, t + 32), w2 = load_w<I8>(w, t + 64), w3 = load_w<I8>(w, t + 96);
    for (int r = 0; r < R; ++r) {
      __m512bh xv = (__m512bh)_mm512_set1_epi32(x[r * xstride + kp]);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xv, w2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xv, w3);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_store_ps(sums + r * 64 + 16 * j, acc[r][j]);
}

// R rows of x against one packed block of 64 outputs: R x 4 accumulators of 16 fp32 lanes. `w` is the block's
// first weight; `scale` (int8 only) is the per-output scale, applied once to the fp32 sums.
template <int R, bool I8>
static inline void block_rows(const uint32_t* x, int64_t xstride, const void* w, int64_t Kp, const float* scale,
                              const float* bias, uint16_t* y, int64_t ystride, int64_t n0, int64_t N) {
  alignas(64) float sums[R * 64];
  int64_t kp = 0;
  if (R == 1) {  // one row: a second set of accumulators over odd pairs, or vdpbf16ps waits on its own latency
    __m512 even[4], odd[4];
    for (int j = 0; j < 4; ++j) even[j] = odd[j] = _mm512_setzero_ps();
    for (; kp + 2 <= Kp; kp += 2) {
      int64_t t = kp * 128;
      prefetch_ahead<I8, 8>(w, t);
      __m512bh xe = (__m512bh)_mm512_set1_epi32(x[kp]), xo = (__m512bh)_mm512_set1_epi32(x[kp + 1]);
      for (int j = 0; j < 4; ++j) {
        even[j] = _mm512_dpbf16_ps(even[j], xe, load_w<I8>(w, t + 32 * j));
        odd[j] = _mm512_dpbf16_ps(odd[j], xo, load_w<I8>(w, t + 128 + 32 * j));
      }
    }
    for (int j = 0; j < 4; ++j) _mm512_store_ps(sums + 16 * j, _mm512_add_ps(even[j], odd[j]));
  } else {
    std::memset(sums, 0, sizeof(sums));
  }
  accumulate<R, I8>(x, xstride, w, kp, Kp, R > 1, nullptr, 0, sums);  // R > 1: every pair; one row: an odd last
  finish_rows<I8>(sums, R, scale, bias, y, ystride, n0, N);
}

// More than 4 rows against one block: the weights are read KC pairs at a time, every group of 4 rows runs over them
// while they are in L1, and each group asks L2 for its share of the next range's lines, so memory streams while the
// rows compute (without those requests the stream waited on the arithmetic: no faster than whole-block groups).
static constexpr int64_t KC = 64;  // 64 pairs x 256 bytes of bf16 weights: 16 KB, half of L1
template <bool I8>
static void block_many_rows(const uint32_t* x, int64_t xstride, int64_t M, const void* w, int64_t Kp,
                            const float* scale, const float* bias, uint16_t* y, int64_t ystride, int64_t n0, int64_t N) {
  alignas(64) float sums[MAX_ROWS * 64];
  std::memset(sums, 0, sizeof(float) * M * 64);
  const int64_t groups = (M + 3) / 4;
  const int lines = (int)((4 + groups - 1) / groups);  // lines a pair asks for: the groups cover the next range
  for (int64_t k0 = 0; k0 < Kp; k0 += KC) {
    int64_t k1 = Kp - k0 < KC ? Kp : k0 + KC;
    for (int64_t r = 0; r < M; r += 4) {
      int64_t R = M - r < 4 ? M - r : 4;
      const uint32_t* xr = x + r * xstride;
      float* sr = sums + r * 64;
      // each group asks for its share of the next range's lines, so memory works while the rows compute
      const char* next = static_cast<const char*>(w) + k1 * 128 * (I8 ? 1 : 2) + (r / 4) * KC * 64 * lines;
      if (R == 4) accumulate<4, I8>(xr, xstride, w, k0, k1, r == 0, next, lines, sr);
      else if (R == 3) accumulate<3, I8>(xr, xstride, w, k0, k1, r == 0, next, lines, sr);
      else if (R == 2) accumulate<2, I8>(xr, xstride, w, k0, k1, r == 0, next, lines, sr);
      else accumulate<1, I8>(xr, xstride, w, k0, k1, r == 0, next, lines, sr);
    }
  }
  for (int64_t r = 0; r < M; r += 4)
    finish_rows<I8>(sums + r * 64, M - r < 4 ? (int)(M - r) : 4, scale, bias, y + r * ystride, ystride, n0, N);
}

template <bool I8>
static void product(const uint32_t* xp, int64_t xs, int64_t M, const char* wp, int64_t blocks, int64_t Kp,
                    const float* sp, const float* bp, uint16_t* yp, int64_t N) {
  int64_t block_bytes = 128 * Kp * (I8 ? 1 : 2);
  // Blocks handed out in shrinking runs (`guided`), not split in halves: on a 2-core machine the client or the HTTP
  // thread takes a core now and then, and a static split would make the whole product wait for the preempted half.
  // Runs of consecutive blocks keep each thread's stream (and its prefetch) contiguous, and the last small runs even
  // out products of few blocks (14 for Qwen 0.5B's down projection: pairs of blocks split them 8 / 6). Against pairs
  // of blocks, a 2-core Zen 4 took 0.94x the time for a step's products at 16 rows (the down projection 0.88x,
  // q/k/v 0.89x), 0.98x at one row (random weights of the 0.5B's shapes, 9 rounds interleaved).
  #pragma omp parallel for schedule(guided) num_threads(at::get_num_threads())
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const void* w = wp + blk * block_bytes;
    if (M == 4) block_rows<4, I8>(xp, xs, w, Kp, sp, bp, yp, N, blk * 64, N);
    else if (M == 3) block_rows<3, I8>(xp, xs, w, Kp, sp, bp, yp, N, blk * 64, N);
    else if (M == 2) block_rows<2, I8>(xp, xs, w, Kp, sp, bp, yp, N, blk * 64, N);
    else if (M == 1) block_rows<1, I8>(xp, xs, w, Kp, sp, bp, yp, N, blk * 64, N);
    else
      for (int64_t r = 0; r < M; r += MAX_ROWS)  // rows past MAX_ROWS (not this kernel's use) in slabs of it
        block_many_rows<I8>(xp + r * xs, xs, M - r < MAX_ROWS ? M - r : MAX_ROWS, w, Kp, sp, bp, yp + r * N, N,
                            blk * 64, N);
  }
}
#endif

bool available() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

// x [M, K] bf16 (K even, rows contiguous), packed [Np/64, K/2, 64, 2] bf16 or int8, scales fp32 [Np] (int8) or
// empty, bias fp32 [Np] or empty -> y [M, N] bf16
torch::Tensor gemv(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor bias, int64_t N) {
  TORCH_CHECK(available(), "built without AVX-512 BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x must be [M, K] bf16");
  bool i8 = packed.scalar_type() == at::kChar;
  TORCH_CHECK(i8 || packed.scalar_type() == at::kBFloat16, "packed weights must be bf16 or int8");
  TORCH_CHECK(!i8 || scales.numel() == packed.size(0) * 64, "int8 weights need one fp32 scale per padded output");
  int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0), Kp = packed.size(1);
  TORCH_CHECK(Kp * 2 == K, "x has ", K, " columns, the weight ", Kp * 2);
  auto y = torch::empty({M, N}, x.options());
#ifdef __AVX512BF16__
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
  const char* wp = static_cast<const char*>(packed.data_ptr());
  const float* sp = i8 ? scales.data_ptr<float>() : nullptr;
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  if (i8) product<true>(xp, x.stride(0) / 2, M, wp, blocks, Kp, sp, bp, yp, N);
  else product<false>(xp, x.stride(0) / 2, M, wp, blocks, Kp, sp, bp, yp, N);
#endif
  return y;
}

// the GIL is released while a kernel runs: the server's HTTP thread streams tokens meanwhile (holding it,
// these kernels starved the event loop: a first token reached the client ~0.2 s after it was sampled)
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available);
  m.def("gemv", &gemv, py::call_guard<py::gil_scoped_release>());
}
"""

_NAME = "ragkv_bf16_gemv_v10"
# the compiled module where this CPU has AVX-512 BF16, else None (callers use oneDNN)
kernel = LazyExtension(_NAME, _SOURCE, "bf16 product kernel", needs=lambda: cpu_has("avx512_bf16"))


def pack(w: torch.Tensor, bias: torch.Tensor | None, int8: bool = False
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [N, K] (K even) -> (W as [ceil(N/64), K/2, 64, 2], zero rows padding N; fp32 scales [padded N] or an empty
    tensor; bias as fp32 [padded N], or an empty tensor). bf16 W as it is; `int8`: each output's weights as
    round(w / scale) with scale = max |w| / 127 (symmetric, per output channel), computed from W in fp32. The packed
    copy lies in 2 MB pages under RAGKV_HUGE_PAGES=1, `ragkv serve`'s default (ops/huge_pages: a decode step streams
    it whole)."""
    N, K = w.shape
    pad = -N % BLOCK
    w = torch.nn.functional.pad(w.detach(), (0, 0, 0, pad))
    scales = torch.empty(0)
    if int8:
        w = w.float()
        scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
        w = (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    else:
        w = w.to(torch.bfloat16)
    packed = on_huge_pages(w.view((N + pad) // BLOCK, BLOCK, K // 2, 2).permute(0, 2, 1, 3))
    b = torch.empty(0) if bias is None else torch.nn.functional.pad(bias.detach().float(), (0, pad))
    return packed, scales, b


def unpack(packed: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
    """The [N, K] weight a packed one stands for, in fp32 (int8: times its scales): what the kernel multiplies by."""
    blocks, kp = packed.shape[:2]
    w = packed.permute(0, 2, 1, 3).reshape(blocks * BLOCK, kp * 2).float()
    return (w * scales[:, None] if scales.numel() else w)[:out_features]


def packable(w: torch.Tensor) -> bool:
    return kernel() is not None and w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.shape[1] % 2 == 0


def gemv(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor,
         out_features: int) -> torch.Tensor:
    """x [..., K] bf16 with at most MAX_ROWS rows -> [..., out_features] bf16 (`pack`'s three tensors)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) != x2.shape[1]):
        x2 = x2.contiguous()
    with traced("ragkv::gemv"):  # visible to `bench decode`'s profile
        y = kernel().gemv(x2, packed, scales, bias, out_features)
    return y.reshape(*x.shape[:-1], out_features)
