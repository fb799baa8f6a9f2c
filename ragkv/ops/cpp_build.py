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
