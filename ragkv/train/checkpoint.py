"""Output folders of a fine-tuning run: Hugging Face model folders (final and per checkpoint) plus the training
state needed to resume exactly (optimizer, scheduler, RNG, step, data order).

    OUTPUT/                      the final model (config.json, model.safetensors, tokenizer, generation_config.json)
    OUTPUT/finetune.json         the training configuration and data summary
    OUTPUT/train_log.jsonl       one line per optimizer step: step, loss, lr, seconds
    OUTPUT/checkpoints/step-N/   a model folder at step N (+ trainer_state.pt for the latest --keep-states)
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ragkv.errors import RagkvError

STATE_FILE = "trainer_state.pt"
MARKER = "finetune.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
WEIGHT_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


class OutputFolderError(RagkvError):
    pass


def prepare_output(output: Path, resume: bool, overwrite: bool) -> Path | None:
    """Apply the output-folder policy; returns the checkpoint to resume from, or None to start fresh.

    New folder: created. Existing: refused unless --resume (continue from its last checkpoint; a run stopped
    before its first checkpoint starts over) or --overwrite (deleted first, only if it is empty or a ragkv
    fine-tuning output).
    """
    ckpt = check_output(output, resume, overwrite)
    if ckpt is not None:
        return ckpt
    if output.exists() and any(output.iterdir()):
        shutil.rmtree(output)
    output.mkdir(parents=True, exist_ok=True)
    return None


def check_output(output: Path, resume: bool, overwrite: bool) -> Path | None:
    """The checks of `prepare_output` without touching anything (run before the slow set-up)."""
    if resume and overwrite:
        raise OutputFolderError("pass either --resume or --overwrite, not both")
    if output.exists() and not output.is_dir():
        raise OutputFolderError(f"{output} exists and is not a folder; choose another --output")
    if output.exists() and resume:
        ckpt = latest_checkpoint(output)
        if ckpt is not None:
            return ckpt
        if any(output.iterdir()) and not (output / MARKER).exists():
            raise OutputFolderError(f"{output} is not a ragkv fine-tuning output (no {MARKER}); "
                                    "choose another --output")
        return None  # stopped before its first checkpoint: start over in the same folder
    if output.exists() and any(output.iterdir()):
        if not overwrite:
            raise OutputFolderError(f"output folder {output} exists; pass --resume to continue its run "
                                    "or --overwrite to replace it")
        if not (output / MARKER).exists():
            raise OutputFolderError(f"refusing to delete {output}: it is not a ragkv fine-tuning output "
                                    f"(no {MARKER}); choose another --output")
    return None


def checkpoint_dir(output: Path, step: int) -> Path:
    return output / "checkpoints" / f"step-{step:06d}"


def list_checkpoints(output: Path) -> list[tuple[int, Path]]:
    root = output / "checkpoints"
    out = []
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith("step-") and p.name[5:].isdigit() and (p / "model.safetensors").exists():
                out.append((int(p.name[5:]), p))
    return sorted(out)


def latest_checkpoint(output: Path) -> Path | None:
    with_state = [p for _, p in list_checkpoints(output) if (p / STATE_FILE).exists()]
    return with_state[-1] if with_state else None


def save_model_folder(model, source: Path, target: Path, meta: dict | None = None) -> None:
    """An ordinary HF folder: the source folder's non-weight files + our weights (tied lm_head left out)."""
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in source.iterdir():
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and f.name not in WEIGHT_NAMES + (MARKER,):
            shutil.copy2(f, tmp / f.name)
    # a weight that views a joined buffer (oneDNN's path, models/onednn.py) is saved as its own tensor
    state = {k: v.detach().clone() if v.untyped_storage().nbytes() > v.numel() * v.element_size()
             else v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.args.tie_embeddings:  # one tensor under two names: keep the embedding, the loader re-ties
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if meta is not None:
        (tmp / MARKER).write_text(json.dumps(meta, indent=2) + "\n")
    _replace(tmp, target)


def _replace(tmp: Path, target: Path) -> None:
    """Move `tmp` to `target` (merging into an existing folder such as the run's OUTPUT root)."""
    if not target.exists():
        tmp.rename(target)
        return
    for f in tmp.iterdir():
        os.replace(f, target / f.name)
    tmp.rmdir()


def load_weights(model, folder: Path) -> None:
    state = load_file(str(folder / "model.safetensors"))
    if model.args.tie_embeddings:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    with torch.no_grad():
        for name, p in model.state_dict().items():
            p.copy_(state[name])


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def save_state(folder: Path, state: dict) -> None:
    tmp = folder / (STATE_FILE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, folder / STATE_FILE)


def load_state(folder: Path) -> dict:
    try:
        return torch.load(folder / STATE_FILE, weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise OutputFolderError(f"cannot read the training state of {folder}: {e}; delete that checkpoint "
                                "folder to resume from an earlier one") from None


def prune_states(output: Path, keep: int) -> None:
    """Drop optimizer states of all but the latest `keep` checkpoints (their model weights stay)."""
    with_state = [p for _, p in list_checkpoints(output) if (p / STATE_FILE).exists()]
    for p in with_state[:-keep]:
        (p / STATE_FILE).unlink()
