"""Building the C++ CPU kernels (torch.utils.cpp_extension, for this machine's ISA, cached in
~/.cache/torch_extensions), with a build lock that a killed build cannot leave held."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Callable

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _build_lock(name: str):
    """Hold an flock on the extension's build folder; inside it, a `lock` file left by torch's builder is stale.

    torch's FileBaton is a plain file that a killed build never removes: every later build then spins on it for ever.
    An flock dies with its process, so whoever holds ours knows no live ragkv build owns that file."""
    try:
        import fcntl

        from torch.utils.cpp_extension import _get_build_directory
        folder = _get_build_directory(name, verbose=False)
    except Exception:  # noqa: BLE001 - no flock (Windows) or a moved private helper: build as torch does
        yield
        return
    with open(os.path.join(folder, "ragkv.build.lock"), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        stale = os.path.join(folder, "lock")
        if os.path.exists(stale):
            log.warning("removing %s, left by a build that was killed", stale)
            with contextlib.suppress(FileNotFoundError):
                os.remove(stale)
        yield


def build_extension(name: str, source: str, fast_math: bool = False):
    """Compile `source` (which declares its own PYBIND11_MODULE) for this CPU (-march=native) with OpenMP, once per
    `name`; raises where there is no compiler (callers keep a torch path)."""
    from torch.utils.cpp_extension import load_inline

    flags = ["-O3", "-march=native", "-fopenmp"] + (["-ffast-math"] if fast_math else [])
    with _build_lock(name):
        return load_inline(name=name, cpp_sources=[source], verbose=False, extra_cflags=flags,
                           extra_ldflags=["-fopenmp"])


class LazyExtension:
    """A C++ kernel module built on first call, once per process: the module, or None where it cannot be (no
    compiler, a CPU without what `needs` checks, the module's `available()` false, or RAGKV_NO_CPP_KERNELS=1); its
    callers then keep their torch path."""

    def __init__(self, name: str, source: str, what: str, fast_math: bool = False,
                 needs: Callable[[], bool] = lambda: True):
        self.name, self.source, self.what, self.fast_math, self.needs = name, source, what, fast_math, needs
        self._lock = threading.Lock()
        self._module, self._failed = None, False

    def __call__(self):
        if self._module is not None or self._failed:
            return self._module
        if os.environ.get("RAGKV_NO_CPP_KERNELS") == "1" or not self.needs():
            self._failed = True
            return None
        with self._lock:
            if self._module is None and not self._failed:
                try:
                    mod = build_extension(self.name, self.source, self.fast_math)
                    if getattr(mod, "available", lambda: True)():
                        self._module = mod
                    else:
                        self._failed = True
                except Exception as e:  # noqa: BLE001 - a missing compiler must not break inference
                    log.warning("the C++ %s could not be built (%s); using the torch path", self.what, e)
                    self._failed = True
        return self._module


# 2^x for x <= 0 on 16 fp32 lanes (AVX-512F), shared by the C++ kernels that need an exponential (prefill attention's
# softmax, w8a8's SwiGLU): spliced into their sources, inside their own AVX-512 guard.
EXP2_NEG_AVX512 = r"""// 2^x for x <= 0 (and -inf -> 0): x = n + f, f in [-0.5, 0.5], 2^f by its Taylor polynomial (error < 2e-7)
static inline __m512 exp2_neg(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5403530e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

"""


# silu(v) = v sigmoid(v) on 16 fp32 lanes, for the kernels that end in SwiGLU (the AMX product's epilogue, w8a8's
# rescale, the bf16 silu(gate) * up pass): the sigmoid from e^-|v| (no overflow), 1 / (1 + e) by rcp14 and one Newton
# step (relative error ~2^-28; 1 + e lies in [1, 2], well inside rcp14's range). Brings exp2_neg with it.
SILU_AVX512 = EXP2_NEG_AVX512 + r"""static inline __m512 silu16(__m512 v) {
  const __m512 e = exp2_neg(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(v)),
                                          _mm512_set1_ps(1.4426950409f)));
  const __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GE_OQ), e,
                                          _mm512_set1_ps(1.f));
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), e);
  __m512 r = _mm512_rcp14_ps(d);
  r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f)));
  return _mm512_mul_ps(v, _mm512_mul_ps(num, r));
}

"""

# 16 bf16 values widened to fp32 (exact: a 16-bit shift), for the bf16 passes' AVX-512 BF16 loops (RMSNorm, RoPE):
# spliced into their sources inside their own __AVX512BF16__ guard, after <immintrin.h>.
WIDEN_BF16_AVX512 = r"""static inline __m512 widen(const at::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
"""


# C++ for kernels that read and write bf16 or fp32 one value at a time (RoPE, RMSNorm): `load` widens to fp32, `store`
# rounds to nearest even as torch's cast does (NaN stays NaN). Spliced into their sources after the includes
# (<cstdint>, <cstring>, torch/extension.h).
SCALAR_IO = r"""
// one value of a bf16 or fp32 tensor read as fp32, and an fp32 written back rounded to nearest even (torch's cast)
static inline float load(const float* p) { return *p; }
static inline float load(const at::BFloat16* p) {
  uint32_t u = (uint32_t)(*reinterpret_cast<const uint16_t*>(p)) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline void store(float* p, float v) { *p = v; }
static inline void store(at::BFloat16* p, float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  *reinterpret_cast<uint16_t*>(p) = (v != v) ? (uint16_t)0x7FC0 : (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}
"""


# AMX's tile palette 1 and the tile state asked of the kernel once per process (ARCH_REQ_XCOMP_PERM, XTILEDATA), for
# the kernels that use the matrix unit: spliced into their sources inside their own __AMX_TILE__ / __AMX_BF16__ guard,
# after <immintrin.h>, <sys/syscall.h>, <unistd.h> and <cstring>. `configure_tiles(n)`: tiles 0..n-1 at 16 rows of
# 64 bytes (a 16 x 16 fp32 block, 16 x 32 bf16, or 16 pair-rows of 16 outputs); `palette_one()` for other shapes.
AMX_TILES = r"""struct TileConfig {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

static bool amx_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return granted;
}

static TileConfig palette_one() {  // every tile unused; a kernel sets the shapes it needs, then _tile_loadconfig
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  return cfg;
}

static void configure_tiles(int n) {
  TileConfig cfg = palette_one();
  for (int t = 0; t < n; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  _tile_loadconfig(&cfg);
}

"""
