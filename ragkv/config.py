"""Process-wide settings (paths, device, dtype) resolved from environment variables and defaults."""

from __future__ import annotations

import functools
import logging
import os
import platform
from pathlib import Path

from typing import TYPE_CHECKING

from ragkv.errors import RagkvError

if TYPE_CHECKING:  # torch loads in seconds: not for `ragkv --help` or a settings check
    import torch

DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16"}


def torch_dtype(name: str) -> "torch.dtype":
    import torch

    if name not in DTYPE_NAMES:
        raise RagkvError(f"unknown dtype {name!r}; use auto, float32 or bfloat16")
    return getattr(torch, DTYPE_NAMES[name])


def cache_dir() -> Path:
    """Root for converted models, KV stores and calibration files (RAGKV_CACHE_DIR, default ~/.cache/ragkv)."""
    return Path(os.environ.get("RAGKV_CACHE_DIR", "~/.cache/ragkv")).expanduser()


def models_dir() -> Path:
    return Path(os.environ.get("RAGKV_MODELS_DIR", cache_dir() / "models")).expanduser()


def data_dir() -> Path:
    """Shared benchmark data (RAGKV_DATA_DIR, default ../shared/data beside the checkout)."""
    default = Path(__file__).resolve().parents[1].parent / "shared" / "data"
    return Path(os.environ.get("RAGKV_DATA_DIR", default)).expanduser()


@functools.cache
def _cpuinfo() -> tuple[str | None, frozenset[str]]:
    """The first CPU's model name and flags from /proc/cpuinfo, read once per process ((None, {}) elsewhere)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None, frozenset()
    # reversed, so the first processor's entry is the one kept
    field = {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in reversed(lines))}
    return field.get("model name"), frozenset(field.get("flags", "").split())


EMULATED_ISA = "RAGKV_ISA_EMULATED"  # set by scripts/as_avx2.sh: the code paths of an older CPU, on this one


def _flags() -> frozenset[str]:
    """The ISA flags the code paths may use: /proc/cpuinfo's, less everything past AVX2 under scripts/as_avx2.sh."""
    flags = _cpuinfo()[1]
    if os.environ.get(EMULATED_ISA) == "avx2":
        flags = frozenset(f for f in flags if not f.startswith(("avx512", "amx")))
    return flags


def cpu_has(flag: str) -> bool:
    """Whether ragkv's kernels may use an ISA extension (a /proc/cpuinfo flag: "avx512_bf16", "amx_tile")."""
    return flag in _flags()


def _isa_label(flags: frozenset[str]) -> str | None:
    return next((label for flag, label in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX-512 BF16"),
                                           ("avx512f", "AVX-512"), ("avx2", "AVX2")) if flag in flags), None)


def cpu_name() -> str:
    """The CPU's model name and its widest vector extension: VMs often report only "AMD EPYC", and the extension
    is what separates these machines' speeds (bf16 is fast only with AMX or AVX512-BF16). Under scripts/as_avx2.sh
    it names both: the paths taken and the CPU that took them."""
    name, flags = _cpuinfo()
    name = name or platform.processor() or platform.machine()
    isa, used = _isa_label(flags), _isa_label(_flags())
    if used != isa:
        return f"{name} ({used} paths, emulated on {isa})"
    return f"{name} ({isa})" if isa else name


def machine() -> dict:
    """What a timing depends on, saved with every benchmark and evaluation record: the CPU differs between these
    machines (AMX on one, AVX-512 BF16 on another, AVX2 only on a third)."""
    import torch

    out = {"cpu": cpu_name(), "cpus": os.cpu_count(), "fast_bf16": cpu_has_fast_bf16()}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
    return out


def cpu_has_fast_bf16() -> bool:
    return cpu_has("amx_bf16") or cpu_has("avx512_bf16")


def _half_is_emulated(device: "torch.device") -> bool:
    return device.type == "cpu" and not cpu_has_fast_bf16()


def resolve_device(name: str = "auto") -> "torch.device":
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RagkvError(f"device {name!r} requested but CUDA is not available; use --device cpu")
    if not (name == "cpu" or name.startswith("cuda")):
        raise RagkvError(f"unknown device {name!r}; use auto, cpu or cuda[:N]")
    return torch.device(name)


def resolve_dtype(name: str, device: "torch.device") -> "torch.dtype":
    """`auto` means bf16 where the hardware runs it fast (CUDA with bf16, CPU with AMX/AVX512-BF16), else fp32."""
    import torch

    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    dtype = torch_dtype(name)
    if dtype in (torch.bfloat16, torch.float16) and _half_is_emulated(device):
        warn_slow_half(dtype_name(dtype), "use --dtype auto (float32 here)")
    return dtype


def resolve_autocast(bf16: bool | None, device: "torch.device") -> bool:
    """bf16 autocast for training: None means where the hardware runs bf16 fast (as `auto` for --dtype)."""
    import torch

    if bf16 is None:
        return resolve_dtype("auto", device) == torch.bfloat16
    if bf16 and _half_is_emulated(device):
        warn_slow_half("bf16 autocast", "pass --no-bf16 (fp32 here)")
    return bf16


def warn_slow_half(what: str, instead: str) -> None:
    """Say so when half precision is asked for on a CPU that emulates it (an AVX2-only EPYC took 99-121 s in bf16
    for Qwen 0.5B's 1.5K-token prefill, 20 s in fp32): the run still works, only slowly."""
    logging.getLogger("ragkv").warning(
        "%s on a CPU without AMX or AVX512-BF16 is emulated and several times slower than float32; %s unless you "
        "need %s's numerics", what, instead, what)


def dtype_name(dtype: "torch.dtype") -> str:
    return str(dtype).removeprefix("torch.")
