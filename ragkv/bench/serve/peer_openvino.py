"""Intel's own stack as a peer (`--peer openvino`): OpenVINO GenAI's continuous-batching pipeline (prefix caching
on) behind a small OpenAI server (openvino_server.py), run by its own virtualenv's python (bash
scripts/install_openvino_peer.sh: openvino-genai and optimum-intel into .venv-ov), on the model folder ragkv loads,
exported once to OpenVINO IR by optimum-intel (fp32 weights; the CPU plugin computes in --dtype). Never a runtime
dependency of ragkv."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from ragkv.bench.serve.servers import PeerServerProcess, default_threads, find_venv_python
from ragkv.errors import RagkvError

OPENVINO_PACKAGE = "openvino-genai==2026.4.1.0"
DEFAULT_OPENVINO_PYTHON = ".venv-ov/bin/python"
OPENVINO_INSTALL_HINT = (f"install it with `bash scripts/install_openvino_peer.sh` ({OPENVINO_PACKAGE} and "
                         "optimum-intel into .venv-ov, a few minutes), or pass --peer-python PATH to a python that "
                         "has them")
SERVER = Path(__file__).with_name("openvino_server.py")


def openvino_precision(dtype: str) -> str:
    """ragkv's --dtype as the CPU plugin's inference precision (`auto` as ragkv resolves it on this CPU)."""
    from ragkv.config import DTYPE_NAMES, cpu_has_fast_bf16

    name = ("bfloat16" if cpu_has_fast_bf16() else "float32") if dtype == "auto" else DTYPE_NAMES.get(dtype)
    if name not in ("float32", "bfloat16"):
        raise RagkvError(f"--dtype {dtype}: the OpenVINO peer runs float32 or bfloat16")
    return {"float32": "f32", "bfloat16": "bf16"}[name]


def find_openvino_python(path: str | None = None) -> Path:
    probe = "import importlib.metadata as m, openvino_genai; print(m.version('openvino-genai'))"
    return find_venv_python(path, DEFAULT_OPENVINO_PYTHON, probe, "openvino_genai", OPENVINO_INSTALL_HINT)


def exported_folder(model_folder: Path, python: Path, progress=print) -> Path:
    """The model exported to OpenVINO IR (with its tokenizer), next to ragkv's converted folder; made once."""
    out = model_folder.parent / f"{model_folder.name}-openvino"
    if (out / "openvino_model.xml").exists() and (out / "openvino_tokenizer.xml").exists():
        return out
    progress(f"[serve bench] exporting {model_folder} to OpenVINO IR in {out} (once; a few minutes)")
    cmd = [str(python.parent / "optimum-cli"), "export", "openvino", "--model", str(model_folder),
           "--task", "text-generation-with-past", "--weight-format", "fp32", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode != 0 or not (out / "openvino_model.xml").exists():
        raise RagkvError(f"optimum-cli export openvino failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return out


class OpenVinoServer(PeerServerProcess):
    """openvino_server.py on the exported model, on a free 127.0.0.1 port; a context manager.

    Settings, and why: inference and KV-cache precision = ragkv's dtype (the plugin would otherwise keep its KV
    cache in u8: not the exact computation ragkv's `full` is); prefix caching on (its answer to repeated passages);
    `threads` = ragkv's thread count; 2 GiB of KV cache; greedy with the model's end-of-sequence tokens."""

    name = "OpenVINO GenAI server"
    log_name = "openvino"
    ready_path = "/v1/models"

    def __init__(self, model: str = "smollm2", python: str | None = None, dtype: str = "float32",
                 threads: int | None = None, startup_s: float = 900.0, extra: tuple[str, ...] = ()):
        from ragkv.models.registry import resolve_model_path

        self.model, self.precision = model, openvino_precision(dtype)
        self.python = find_openvino_python(python)
        self.folder = exported_folder(resolve_model_path(model), self.python)
        self.threads = threads or default_threads()
        self.cmd = [str(self.python), str(SERVER), "--model-dir", str(self.folder), "--served-model-name", model,
                    "--precision", self.precision, "--threads", str(self.threads), *extra]
        self.startup_s = startup_s

    def version(self) -> str | None:
        return self._python_prints("import importlib.metadata as m; print(m.version('openvino-genai'))")

    def describe(self) -> dict:
        return {"model_folder": str(self.folder), "precision": self.precision}
