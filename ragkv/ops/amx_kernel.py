"""A CPU kernel for bf16 products of a few to ~a hundred rows on the AMX matrix unit: y = x W^T (+ b).

It reads the weights ragkv's gemv kernel packs ([N/64][K/2][64][2], ops/gemv_kernel.py), which is AMX's own B layout:
rows of K-pairs, each pair interleaved per output, so 16 consecutive pair-rows of 16 outputs are one B tile (a
strided tile load, 256 bytes apart), and the four tiles of a 64-output block cover one contiguous 4 KB run. A tile
of up to 16 rows of x is the A tile as it lies in memory. Each 64-output block keeps four 16 x 16 fp32 accumulator
tiles while K streams through, then adds the bias in fp32 and rounds to bf16 once. Rows go in groups of 16 (the
block stays in L2 between groups). `tdpbf16ps` multiplies bf16 pairs exactly and sums in fp32: results equal
F.linear's to bf16 rounding, not bitwise.

Built where the compiler targets AMX-BF16 (-march=native on an AMX CPU) and the kernel grants this process the
tile state (arch_prctl ARCH_REQ_XCOMP_PERM); elsewhere `kernel()` is None and the chooser never offers it.
"""

from __future__ import annotations

import torch

from ragkv.ops.cpp_build import LazyExtension
from ragkv.ops.trace import traced

MAX_ROWS = 128  # rows offered to the chooser: above, oneDNN's blocked GEMM reuses each weight tile better

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstring>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// tiles 0-3: C (rows x 16 fp32), 4: A (rows x 32 bf16), 5-6: B (16 pair-rows x 16 outputs x 2)
struct TileConfig {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

static void configure(int rows) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
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
#endif

bool available() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return granted;
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

// the GIL is released while the kernel runs (the server's HTTP thread streams tokens meanwhile)
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available);
  m.def("product", &product, py::call_guard<py::gil_scoped_release>());
}
"""

_NAME = "ragkv_bf16_amx_product_v3"
# the compiled module where this CPU has AMX-BF16, else None (the chooser offers only the other kernels)
kernel = LazyExtension(_NAME, _SOURCE, "AMX bf16 product kernel", needs=torch.cpu._is_amx_tile_supported)


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
