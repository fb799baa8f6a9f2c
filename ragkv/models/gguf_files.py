"""A GGUF file as a model: checked (magic, architecture), named by the sha256 of its bytes, and converted once
into `<models dir>/gguf-converted/<digest>/` (fp32 safetensors + config + tokenizer), atomically.

The same bytes at two paths share one conversion; changed bytes at one path convert again. The digest of a
file is remembered by (path, size, mtime, inode), so an unchanged 4 GB file is hashed once, not on every start."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ragkv.config import models_dir
from ragkv.errors import ModelNotFoundError, UnsupportedModelError

# general.architecture values we run; llama.cpp writes Mistral models as "llama", Qwen2 and Qwen2.5 as "qwen2".
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
GGUF_MAGIC = b"GGUF"
CONVERTED_DIR = "gguf-converted"
SOURCE_NOTE = "ragkv-gguf-source.json"  # inside each converted folder: where it came from
_DIGESTS = "digests.json"
_LARGE = 256 << 20  # files above this get a note on stderr while they are hashed
# Without these, transformers falls back to its config defaults (a 7B Llama: 27 GB of fp32 zeros).
_REQUIRED_KEYS = ("{arch}.block_count", "{arch}.embedding_length", "{arch}.feed_forward_length",
                  "{arch}.attention.head_count", "tokenizer.ggml.tokens")
_STALE_S = 3600  # a dead process's temporary folders older than this are removed before a new conversion


@dataclass(frozen=True)
class GgufHeader:
    architecture: str
    fp32_bytes: int  # size of the converted weights: every tensor's element count at 4 bytes


def converted_root() -> Path:
    return models_dir() / CONVERTED_DIR


def is_converted(path: Path) -> bool:
    """A complete converted folder: config, weights and tokenizer all present."""
    weights = (path / "model.safetensors").exists() or (path / "model.safetensors.index.json").exists()
    return (path / "config.json").exists() and weights and (path / "tokenizer.json").exists()


def check_magic(path: Path) -> None:
    """Raises unless `path` is a readable file that starts like a GGUF (4 bytes read: cheap on every start)."""
    if not path.is_file():  # a FIFO or device would block or stream forever
        raise ModelNotFoundError(f"model path {path} is not a regular file nor a folder")
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
    except OSError as e:
        raise ModelNotFoundError(f"cannot read model file {path} ({e.strerror})") from None
    if magic != GGUF_MAGIC:
        raise UnsupportedModelError(
            f"{path} is not a GGUF file (it starts with {magic!r}, a GGUF with {GGUF_MAGIC!r}); --model takes a "
            "known name, a Hugging Face folder or a .gguf file")


def read_header(path: Path) -> GgufHeader:
    """Architecture and converted size from the GGUF header (gguf package; tensor data stays on disk). Raises
    UnsupportedModelError for a corrupt header, an architecture ragkv does not run, or missing hyper-parameters."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        field = reader.get_field("general.architecture")
        arch = None if field is None else str(field.contents())
        fp32_bytes = 4 * sum(int(t.n_elements) for t in reader.tensors)
    except (ValueError, IndexError, KeyError, OSError) as e:  # truncated or corrupt headers land here
        raise UnsupportedModelError(f"{path} is not a readable GGUF file ({e}); download it again") from None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path} is a GGUF of architecture {arch!r}; ragkv runs {', '.join(SUPPORTED_ARCHITECTURES)} GGUFs "
            "(Llama, Mistral and Qwen2/Qwen2.5 models)")
    missing = [k.format(arch=arch) for k in _REQUIRED_KEYS if reader.get_field(k.format(arch=arch)) is None]
    if missing:
        raise UnsupportedModelError(f"{path}: the GGUF header lacks {', '.join(missing)}; it cannot be converted "
                                    "(export it again with llama.cpp's convert_hf_to_gguf.py)")
    return GgufHeader(arch, fp32_bytes)


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while piece := fh.read(chunk):
            h.update(piece)
    return h.hexdigest()


def _stamp(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _read_digests() -> dict:
    try:
        data = json.loads((converted_root() / _DIGESTS).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # no memory yet, or a damaged one: files are simply hashed again
    return data if isinstance(data, dict) else {}


def _write_digests(digests: dict) -> None:
    """Atomic replace, entries of files that are gone dropped; a concurrent writer may win (costs a re-hash)."""
    root = converted_root()
    root.mkdir(parents=True, exist_ok=True)
    kept = {p: e for p, e in digests.items() if Path(p).exists()}
    fd, tmp = tempfile.mkstemp(prefix=f".{_DIGESTS}.", dir=root)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(kept, fh, indent=1)
    os.chmod(tmp, 0o644)
    os.replace(tmp, root / _DIGESTS)


def remembered_digest(path: Path) -> str | None:
    """The digest hashed earlier for this file if it is unchanged since (same size, mtime and inode), else None."""
    entry = _read_digests().get(str(path.resolve()))
    if isinstance(entry, dict) and entry.get("stamp") == _stamp(path.stat()):
        return entry.get("sha256")
    return None


def file_digest(path: Path) -> str:
    """sha256 of the file's bytes, streamed; remembered per (path, size, mtime, inode)."""
    digest = remembered_digest(path)
    if digest:
        return digest
    before = path.stat()
    if before.st_size > _LARGE:
        print(f"ragkv: hashing {path.name} ({before.st_size / 1e9:.1f} GB, once per version of the file)",
              file=sys.stderr, flush=True)
    digest = sha256_file(path)
    if _stamp(path.stat()) == _stamp(before):  # a file rewritten while hashed is not remembered
        digests = _read_digests()
        digests[str(path.resolve())] = {"stamp": _stamp(before), "sha256": digest}
        _write_digests(digests)
    return digest


def converted_dir(digest: str) -> Path:
    return converted_root() / digest[:32]


@contextmanager
def one_parse_per_file():
    """transformers parses a GGUF's header afresh for the config, the tokenizer and the weights (each parse ~6 s for
    a 49K-token vocabulary, most of a small model's conversion): inside this, one reader per file serves them all
    (its tensors are read-only memory maps, so sharing it changes nothing it returns)."""
    import gguf as gguf_pkg

    original, readers = gguf_pkg.GGUFReader, {}

    def reader(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original(path, *args, **kwargs)
        return readers[key]

    gguf_pkg.GGUFReader = reader
    try:
        yield
    finally:
        gguf_pkg.GGUFReader = original


def convert_file(gguf: Path, target: Path, note: dict | None = None) -> None:
    """Dequantize one GGUF to fp32 safetensors + config + tokenizer (chat template included) in a private
    temporary folder beside `target`, renamed into place only when complete: an interrupted conversion leaves
    no `target`. `note` is saved as SOURCE_NOTE inside it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-{os.getpid()}-", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the model folder is as readable as one made by mkdir
    try:
        with one_parse_per_file():
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # save_pretrained refuses a GGUF-loaded model until its quantization marks are removed.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.is_quantized = False
        model.save_pretrained(str(tmp))
        del model
        tokenizer.save_pretrained(str(tmp))
        if note is not None:
            (tmp / SOURCE_NOTE).write_text(json.dumps(note, indent=1), encoding="utf-8")
        if is_converted(target):
            return  # another process finished the same conversion first; ours is dropped in `finally`
        shutil.rmtree(target, ignore_errors=True)  # an incomplete folder from an older, non-atomic conversion
        try:
            tmp.rename(target)
        except OSError:
            if not is_converted(target):  # else a concurrent conversion renamed its copy in first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def remove_stale_temporaries(root: Path) -> None:
    """Temporary folders of conversions killed outright (SIGKILL, power loss) never became entries; they are
    removed once their process is gone and they are an hour old (a shared models folder may have other hosts)."""
    for d in root.glob(".*-*"):
        pid = d.name.rsplit("-", 2)[-2] if ".partial-" in d.name or d.name.startswith(".link-") else ""
        if pid.isdigit() and not _alive(int(pid)) and time.time() - d.stat().st_mtime > _STALE_S:
            shutil.rmtree(d, ignore_errors=True)


def _convert_user_file(path: Path, header: GgufHeader, digest: str, target: Path) -> None:
    """Convert through a private symlink, so files lying beside the user's GGUF (a stray config.json or
    tokenizer_config.json) cannot leak into the conversion."""
    size = path.stat().st_size
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(target.parent)
    free = shutil.disk_usage(target.parent).free
    if free < header.fp32_bytes * 1.1:
        raise ModelNotFoundError(f"converting {path.name} needs {header.fp32_bytes / 1e9:.1f} GB of fp32 weights "
                                 f"in {target.parent}, which has {free / 1e9:.1f} GB free; free space or set "
                                 "RAGKV_MODELS_DIR to a larger disk")
    print(f"ragkv: converting {path.name} ({header.architecture}, {size / 1e6:.0f} MB) to "
          f"{header.fp32_bytes / 1e9:.2f} GB of fp32 safetensors in {target} (once per file content; ~30 s per "
          "100 MB of GGUF, about as much memory as the result)", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix=f".link-{os.getpid()}-", dir=target.parent) as tmpdir:
        link = Path(tmpdir) / "model.gguf"
        link.symlink_to(path.resolve())
        note = {"file_name": path.name, "path": str(path.resolve()), "sha256": digest,
                "architecture": header.architecture, "size": size}
        try:
            convert_file(link, target, note)
        except (ValueError, NotImplementedError, KeyError) as e:  # e.g. a quantization type transformers lacks
            raise UnsupportedModelError(f"{path}: transformers could not convert this GGUF ({e})") from None
    print(f"ragkv: model ready at {target}", file=sys.stderr, flush=True)


def resolve_gguf_file(path: Path) -> Path:
    """The converted folder of a GGUF file, converting it on the first sight of its content.

    Raises ModelNotFoundError for an unreadable file, UnsupportedModelError for a file that is not a GGUF or is
    a GGUF of an architecture ragkv does not run."""
    check_magic(path)
    digest = remembered_digest(path)
    if digest and is_converted(converted_dir(digest)):
        return converted_dir(digest)  # the usual start: a stat and a small JSON read, no hashing, no parsing
    header = read_header(path)  # before hashing: a wrong file is refused without reading all of it
    digest = file_digest(path)
    target = converted_dir(digest)
    if not is_converted(target):
        _convert_user_file(path, header, digest, target)
    return target


def converted_gguf_models() -> list[tuple[Path, dict]]:
    """(folder, source note) of every completed conversion of a GGUF file, for `ragkv models`."""
    root = converted_root()
    if not root.is_dir():
        return []
    found = []
    for folder in sorted(root.iterdir()):
        if folder.name.startswith(".") or not is_converted(folder):
            continue
        try:
            note = json.loads((folder / SOURCE_NOTE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            note = {}
        found.append((folder, note if isinstance(note, dict) else {}))
    return found
