"""CPU kernels for bf16 products on the AMX matrix unit: y = x W^T (+ b). `product` takes a few to ~a hundred rows
(decode); `gemm` takes a prefill's many rows and writes its op as it goes (the residual add, or SwiGLU's silu(gate) *
up).

`product` reads the weights ragkv's gemv kernel packs ([N/64][K/2][64][2], ops/gemv_kernel.py), which is AMX's own B layout:
rows of K-pairs, each pair interleaved per output, so 16 consecutive pair-rows of 16 outputs are one B tile (a
strided tile load, 256 bytes apart), and the four tiles of a 64-output block cover one contiguous 4 KB run. A tile
of up to 16 rows of x is the A tile as it lies in memory. Each 64-output block keeps four 16 x 16 fp32 accumulator
tiles while K streams through, then adds the bias in fp32 and rounds to bf16 once. Rows go in groups of 16 (the
block stays in L2 between groups). `tdpbf16ps` multiplies bf16 pairs exactly and sums in fp32: results equal
F.linear's to bf16 rounding, not bitwise.

`gemm` reads a copy of its own (`pack_tiles`): pieces of 32 outputs whose B tiles lie contiguous, 1 KB each (in
gemv's layout a tile's rows are 256 B apart and a piece does not stay in L1: 0.80-0.88x the rate). It works on 32
rows x 32 outputs at a time (two A tiles, two B tiles, four accumulators: all eight tile registers): each thread
walks its share of the pieces, each piece's 256-k chunks held in L1 while a group of 32-row blocks passes (their x
from L2, their accumulators kept between chunks): 4 blocks, or up to 16 where the thread's share of the weights
outgrows 1 MB (each group streams that share once). The op is applied in fp32 to the accumulators before the one rounding
to bf16: the residual added (oneDNN's fused add does the same), or, in a paired copy of a joined gate/up (each
piece: 16 outputs of gate beside the same 16 of up), silu(gate) * up, so the [rows, 2I] product is never written.

Built where the compiler targets AMX-BF16 (-march=native on an AMX CPU) and the kernel grants this process the
tile state (arch_prctl ARCH_REQ_XCOMP_PERM); elsewhere `kernel()` is None and the chooser never offers it.
"""

from __future__ import annotations

import torch

from ragkv.config import cpu_has
from ragkv.ops.cpp_build import AMX_TILES, SILU_AVX512, LazyExtension
from ragkv.ops.trace import traced

MAX_ROWS = 128  # rows offered to the chooser: above, oneDNN's blocked GEMM reuses each weight tile better
GEMM_MIN_ROWS = 17  # `gemm` works on 32-row blocks: offered from the chooser's 17-128 row class on
_EMPTY = torch.empty(0, dtype=torch.bfloat16)  # `gemm`'s residual where there is none

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
""" + AMX_TILES + r"""
// tiles 0-3: C (rows x 16 fp32), 4: A (rows x 32 bf16), 5-6: B (16 pair-rows x 16 outputs x 2)
static void configure(int rows) {
  TileConfig cfg = palette_one();
  for (int t = 0; t < 5; ++t) { cfg.rows[t] = rows; cfg.colsb[t] = 64; }
  for (int t = 5; t < 7; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  _tile_loadconfig(&cfg);
}

// one group of R <= 16 rows against one 64-output block; acc: R x 64 fp32 scratch
static void block_group(const uint16_t* x, int64_t K, const uint16_t* w, int64_t Kp, float* acc) {
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t kp = 0; kp < Kp; kp += 16) {
    const uint16_t* b = w + kp * 128;
    const char* ahead = reinterpret_cast<const char*>(b) + 4096;  // the next step's 4 KB (~5% at 1-16 rows)
    for (int c = 0; c < 64; ++c) _mm_prefetch(ahead + 64 * c, _MM_HINT_T0);
    _tile_loadd(4, x + 2 * kp, K * 2);
    _tile_loadd(5, b, 256);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, b + 32, 256);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, b + 64, 256);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(6, b + 96, 256);
    _tile_dpbf16ps(3, 4, 6);
  }
  _tile_stored(0, acc, 256); _tile_stored(1, acc + 16, 256);
  _tile_stored(2, acc + 32, 256); _tile_stored(3, acc + 48, 256);
}
""" + SILU_AVX512 + r"""// -- many rows: 32 x 32 blocks, the op in the epilogue -------------------------------------------------------------
// C tiles 0 (rows 0-15, B0), 1 (rows 0-15, B1), 2 (rows 16-31, B0), 3 (rows 16-31, B1); A tiles 4-5, B tiles 6-7
// k-steps [k0, k1) of a 32-row block against one piece of the tile copy (two B tiles of 1 KB each per step of 32
// k), the accumulators read from / written to c (32 x 32 fp32, rows 128 B apart) unless it is the first chunk
static inline void block32(const uint16_t* a, int64_t lda, const uint16_t* piece, int64_t k0, int64_t k1, float* c,
                           bool first) {
  if (first) { _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); }
  else { _tile_loadd(0, c, 128); _tile_loadd(1, c + 16, 128); _tile_loadd(2, c + 512, 128); _tile_loadd(3, c + 528, 128); }
  for (int64_t kp = k0; kp < k1; kp += 16) {
    const uint16_t* b = piece + kp * 64;  // this step's two tiles, 1 KB apart
    _tile_loadd(4, a + 2 * kp, lda * 2);
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b + 512, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a + 16 * lda + 2 * kp, lda * 2);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, 128); _tile_stored(1, c + 16, 128); _tile_stored(2, c + 512, 128); _tile_stored(3, c + 528, 128);
}

#endif

bool available() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return amx_granted();
#else
  return false;
#endif
}

// x [M, K] bf16 (K a multiple of 32, rows contiguous), packed [Np/64, K/2, 64, 2] bf16, bias fp32 [Np] or empty
// -> y [M, N] bf16
torch::Tensor product(torch::Tensor x, torch::Tensor packed, torch::Tensor bias, int64_t N) {
  TORCH_CHECK(available(), "built without AMX-BF16, or the tile state was refused");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1 &&
              (x.size(0) == 1 || x.stride(0) == x.size(1)), "x must be contiguous [M, K] bf16");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4, "packed weights must be bf16");
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0), Kp = packed.size(1);
  TORCH_CHECK(Kp * 2 == K && K % 32 == 0, "x has ", K, " columns, the weight ", Kp * 2, " (a multiple of 32)");
  auto y = torch::empty({M, N}, x.options());
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t block_elems = 128 * Kp;
  // blocks handed out two at a time (as the gemv kernel does: a preempted core must not hold up the other half)
  #pragma omp parallel num_threads(at::get_num_threads())
  {
    alignas(64) float acc[16 * 64];
    int configured = -1;
    #pragma omp for schedule(dynamic, 2)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t n0 = blk * 64, valid = N - n0 < 64 ? N - n0 : 64;
      for (int64_t r0 = 0; r0 < M; r0 += 16) {
        const int R = static_cast<int>(M - r0 < 16 ? M - r0 : 16);
        if (R != configured) { configure(R); configured = R; }
        block_group(xp + r0 * K, K, wp + blk * block_elems, Kp, acc);
        for (int r = 0; r < R; ++r) {
          for (int j = 0; j * 16 < valid; ++j) {
            __m512 v = _mm512_loadu_ps(acc + r * 64 + j * 16);
            if (bp) v = _mm512_add_ps(v, _mm512_loadu_ps(bp + n0 + j * 16));  // the bias is padded to the blocks
            const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);  // round to nearest even, as torch does
            const int64_t left = valid - j * 16;
            const __mmask16 keep = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
            _mm256_mask_storeu_epi16(yp + (r0 + r) * N + n0 + j * 16, keep, h);
          }
        }
      }
    }
    if (configured >= 0) _tile_release();
  }
#endif
  return y;
}

enum Op { PLAIN = 0, ADD = 1, SWIGLU = 2 };

// x [M, K] bf16 (rows contiguous), tiles [P, K/32, 2, 16, 16, 2] (`pack_tiles`) -> [M, N]: PLAIN + bias, ADD +
// residual [M, N] bf16, or (a paired copy, gate beside up in each piece) SWIGLU silu(gate) * up with N = I
torch::Tensor gemm(torch::Tensor x, torch::Tensor tiles, torch::Tensor bias, torch::Tensor residual, int64_t N,
                   int64_t op, bool paired) {
  TORCH_CHECK(available(), "built without AMX-BF16, or the tile state was refused");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x must be contiguous [M, K] bf16");
  TORCH_CHECK(tiles.dim() == 6 && tiles.scalar_type() == at::kBFloat16 && tiles.is_contiguous(), "tiles from pack_tiles");
  const int64_t M = x.size(0), K = x.size(1), P = tiles.size(0), Kp = K / 2;
  TORCH_CHECK(K % 32 == 0 && tiles.size(1) * 32 == K, "x has ", K, " columns, the weight ", tiles.size(1) * 32);
  TORCH_CHECK(op != SWIGLU || (paired && P * 16 == N), "SwiGLU needs a paired copy of gate and up, I = ", P * 16);
  const int64_t I = paired ? P * 16 : 0;  // a paired copy's plain product: gate's columns, then up's
  const int64_t cols = op == SWIGLU ? N : paired ? 2 * I : N;
  TORCH_CHECK(op != ADD || (residual.scalar_type() == at::kBFloat16 && residual.is_contiguous() &&
                            residual.numel() == M * cols), "the residual must be contiguous bf16 [M, N]");
  auto y = torch::empty({M, cols}, x.options());
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(tiles.data_ptr<at::BFloat16>());
  const uint16_t* rp = op == ADD ? reinterpret_cast<const uint16_t*>(residual.data_ptr<at::BFloat16>()) : nullptr;
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t row_blocks = (M + 31) / 32, whole = M / 32;
  std::vector<uint16_t> tail(M % 32 ? 32 * K : 0, 0);  // the last rows, zero-padded to a block
  if (M % 32) std::memcpy(tail.data(), xp + whole * 32 * K, (M - whole * 32) * K * 2);
  // a piece's 256-k chunk (16 KB) stays in L1 while a group of row blocks (their x from L2) passes it, their
  // accumulators kept in a buffer between chunks (AMX Xeon: 1.13-1.25x the rate of whole-K blocks over a strided
  // copy). Each group streams the thread's whole share of the weights: 4 blocks where that share stays in L2 (2 MB)
  // anyway, else as many (up to 16) as keep the group's x within ~1.25 MB of L2 (gate/up, 896 -> 9728: 1.15-1.3x the
  // rate of groups of 4 at 420-1,024 rows; down, K = 4864: 4)
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), P)));
  const int64_t share = (P + threads - 1) / threads * Kp * 128;  // bytes of weights a thread streams
  const int64_t chunk = share <= (1 << 20) ? 4 : std::max<int64_t>(4, std::min<int64_t>(16, (1280 << 10) / (64 * K)));
  const int64_t k_chunk = 128;  // in pair-rows: 256 k
  #pragma omp parallel num_threads(threads)
  {
    configure_tiles(8);
    alignas(64) float acc[16 * 32 * 32];
    const int t = omp_get_thread_num();
    const int64_t p0 = P * t / threads, p1 = P * (t + 1) / threads;
    for (int64_t c = 0; c < row_blocks; c += chunk) {
      const int64_t c1 = std::min(row_blocks, c + chunk);
      for (int64_t p = p0; p < p1; ++p) {
        const uint16_t* piece = wp + p * Kp * 64;
        for (int64_t k0 = 0; k0 < Kp; k0 += k_chunk)
          for (int64_t rb = c; rb < c1; ++rb)
            block32(rb == whole ? tail.data() : xp + rb * 32 * K, K, piece, k0, std::min(Kp, k0 + k_chunk),
                    acc + (rb - c) * 1024, k0 == 0);
        // the piece's two 16-column halves land at columns c0 and c1 (a paired copy: gate's and up's)
        const int64_t col0 = paired ? p * 16 : p * 32, col1 = paired ? I + p * 16 : p * 32 + 16;
        for (int64_t rb = c; rb < c1; ++rb) {
          const float* a = acc + (rb - c) * 1024;
          const int64_t rows = rb == whole ? M - rb * 32 : 32;
          if (op == SWIGLU) {
            const __m512 bg = bp ? _mm512_loadu_ps(bp + col0) : _mm512_setzero_ps();
            const __m512 bu = bp ? _mm512_loadu_ps(bp + col1) : _mm512_setzero_ps();
            for (int64_t r = 0; r < rows; ++r) {
              const __m512 g = _mm512_add_ps(_mm512_load_ps(a + r * 32), bg);
              const __m512 u = _mm512_add_ps(_mm512_load_ps(a + r * 32 + 16), bu);
              _mm256_storeu_si256((__m256i*)(yp + (rb * 32 + r) * cols + col0),
                                  (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(silu16(g), u)));
            }
            continue;
          }
          for (int h = 0; h < 2; ++h) {  // each half: bias, residual, one rounding; the last may end early
            const int64_t c0 = h ? col1 : col0, valid = std::min<int64_t>(16, cols - c0);
            if (valid <= 0) continue;
            const __mmask16 keep = valid == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1);
            const __m512 bv = bp ? _mm512_loadu_ps(bp + c0) : _mm512_setzero_ps();  // the bias is padded
            for (int64_t r = 0; r < rows; ++r) {
              __m512 v = _mm512_add_ps(_mm512_load_ps(a + r * 32 + 16 * h), bv);
              const int64_t at = (rb * 32 + r) * cols + c0;
              if (op == ADD)
                v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, rp + at)), 16)));
              _mm256_mask_storeu_epi16(yp + at, keep, (__m256i)_mm512_cvtneps_pbh(v));
            }
          }
        }
      }
    }
    _tile_release();
  }
#endif
  return y;
}

// the GIL is released while the kernel runs (the server's HTTP thread streams tokens meanwhile)
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available);
  m.def("product", &product, py::call_guard<py::gil_scoped_release>());
  m.def("gemm", &gemm, py::call_guard<py::gil_scoped_release>());
}
"""

_NAME = "ragkv_bf16_amx_product_v7"
# the compiled module where this CPU has AMX-BF16, else None (the chooser offers only the other kernels)
kernel = LazyExtension(_NAME, _SOURCE, "AMX bf16 product kernel", needs=lambda: cpu_has("amx_tile"))


def takes(rows: int, in_features: int) -> bool:
    """Whether the kernel can take this many rows of this width: built here, at most MAX_ROWS, K a multiple of 32."""
    return in_features % 32 == 0 and rows <= MAX_ROWS and kernel() is not None


def product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [..., K] bf16 -> [..., out_features] bf16 over gemv_kernel.pack's weights (its scales unused: bf16 only)."""
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    with traced("ragkv::amx_product"):
        y = kernel().product(x2, packed, bias, out_features)
    return y.reshape(*x.shape[:-1], out_features)


def gemm_takes(rows: int, in_features: int) -> bool:
    """Whether `gemm` can take this product: built here, at least GEMM_MIN_ROWS rows, K a multiple of 32."""
    return in_features % 32 == 0 and rows >= GEMM_MIN_ROWS and kernel() is not None


def pack_tiles(w: torch.Tensor, bias: torch.Tensor | None, paired: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] bf16 -> `gemm`'s copy: pieces of 32 outputs as [P, K/32, 2, 16, 16, 2] (each step's two B tiles of
    16 pair-rows x 16 outputs, 1 KB each, contiguous), zero outputs padding N; and the bias as fp32 [P * 32] (or an
    empty tensor). `paired` (a joined gate/up, N = 2I, I a multiple of 16): piece j holds gate's outputs 16j.. beside
    up's, so SwiGLU multiplies them in the epilogue."""
    N, K = w.shape
    w = w.detach().to(torch.bfloat16)
    b = None if bias is None else bias.detach().float()
    if paired:
        half = N // 2
        w = torch.stack([w[:half].view(half // 16, 16, K), w[half:].view(half // 16, 16, K)], dim=1)
    else:
        pad = -N % 32
        w = torch.nn.functional.pad(w, (0, 0, 0, pad)).view((N + pad) // 32, 2, 16, K)
        b = None if b is None else torch.nn.functional.pad(b, (0, pad))
    pieces = w.shape[0]  # [P, 2 halves, 16 outputs, K] -> [P, K/32 steps, 2, 16 pair-rows, 16 outputs, 2]
    tiles = w.view(pieces, 2, 16, K // 32, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous()
    return tiles, (torch.empty(0) if b is None else b)


def gemm(x: torch.Tensor, tiles: torch.Tensor, bias: torch.Tensor, out_features: int,
         residual: torch.Tensor | None = None, swiglu: bool = False, paired: bool = False) -> torch.Tensor:
    """x [..., K] bf16 -> x W^T + b [..., out_features] over `pack_tiles`' copy, many rows at a time; with `residual`
    ([..., out_features]) added before the rounding; `swiglu` (a paired copy): silu(gate) * up [..., I] with
    out_features = I."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    op, res = 0, _EMPTY
    if swiglu:
        op = 2
    elif residual is not None:
        op, res = 1, residual.reshape(x2.shape[0], out_features).contiguous()
    with traced("ragkv::amx_gemm"):
        y = kernel().gemm(x2, tiles, bias, res, out_features, op, paired or swiglu)
    return y.reshape(*x.shape[:-1], y.shape[-1])
