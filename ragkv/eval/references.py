"""`full`'s reference answers kept beside a results file, so that adding modes to an old run does not re-run `full`.

Fidelity needs two things from `full` on an example: its first-token distribution and its greedy tokens. They are
saved exactly (fp32 logits, not a top-k) in `<results>.refs/`, one file per example with the results file's
config. A file that is missing, unreadable, from another config, or whose tokens differ from the `full` record in
the results file is not trusted: the harness re-runs `full` and rewrites it. A `full` prefill of a 1.5K-token
prompt takes 9-50 s on a 2-core CPU, about half of what adding one mode to an old run used to cost.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Reference:
    """What `fidelity` reads from `full`'s Answer."""
    first_logits: torch.Tensor  # [V] fp32, on the CPU
    token_ids: list[int]


class ReferenceStore:
    """`<results path>.refs/<hash of the example id>.pt`, each holding {config, example_id, token_ids, first_logits}."""

    def __init__(self, results_path: str | Path, config: dict):
        self.dir = Path(str(results_path) + ".refs")
        self.config = config

    def _path(self, example_id: str) -> Path:
        return self.dir / (hashlib.sha256(example_id.encode()).hexdigest()[:32] + ".pt")

    def load(self, example_id: str, full_record: dict | None = None) -> Reference | None:
        """The stored reference, or None where it cannot be trusted (see the module docstring)."""
        path = self._path(example_id)
        if not path.is_file():
            return None
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
            ref = Reference(data["first_logits"], [int(t) for t in data["token_ids"]])
            ok = (data["config"] == self.config and data["example_id"] == example_id
                  and ref.first_logits.ndim == 1 and ref.first_logits.dtype == torch.float32)
        except Exception:  # noqa: BLE001 (any unreadable file is recomputed, whatever broke it)
            return None
        if not ok or (full_record is not None and list(full_record.get("token_ids", ())) != ref.token_ids):
            return None
        return ref

    def save(self, example_id: str, answer) -> None:
        """Write `answer`'s reference atomically (a write cut short leaves no file); a failed write only costs a
        re-run later, so it is not an error."""
        path = self._path(example_id)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            torch.save({"config": self.config, "example_id": example_id, "token_ids": list(map(int, answer.token_ids)),
                        "first_logits": answer.first_logits.detach().float().cpu().clone()}, tmp)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)


# what a run and the exact run it is judged against must share: the same prompts of the same model in the same dtype
SAME_PROMPTS = ("harness", "dataset", "data_file", "format", "gold_position", "num_passages", "split",
                "passage_order", "truncate", "model", "dtype", "prompt_format", "stop")


class ExternalReferences:
    """`full`'s stored answers in other results files (`ragkv eval --reference-from`): the exact weights' run of
    the same prompts, against which every mode of an approximate-weights run (w8a8), `full` included, is judged."""

    def __init__(self, parts: list[tuple[ReferenceStore, dict]], names: list[str], max_new_tokens: int):
        self.parts, self.names, self.max_new_tokens = parts, names, max_new_tokens

    @classmethod
    def open(cls, paths: list[str], config: dict) -> "ExternalReferences":
        from ragkv.engine.modes import is_reference
        from ragkv.errors import RagkvError
        from ragkv.eval.results import read_results

        parts, names = [], []
        for name in [p.strip() for p in paths if p.strip()]:
            ref_config, records = read_results(name)
            differ = [k for k in SAME_PROMPTS if ref_config.get(k) != config.get(k)]
            if differ:
                raise RagkvError(f"--reference-from {name} is not a run of the same prompts: its {', '.join(differ)} "
                                 "differ from this run's")
            if ref_config.get("decode_weights") or str(config["fingerprint"]).split("-")[0] != ref_config["fingerprint"]:
                raise RagkvError(f"--reference-from {name} was not run on this model's exact weights")
            fulls = {r["example_id"]: r for r in records if is_reference(r["mode_key"])}
            parts.append((ReferenceStore(name, ref_config), fulls))
            names.append(Path(name).name)
        return cls(parts, names, int(config["max_new_tokens"]))

    def get(self, example_id: str) -> Reference | None:
        """The exact `full` answer of the example (its greedy tokens cut to this run's length), or None."""
        for store, fulls in self.parts:
            if example_id in fulls:
                ref = store.load(example_id, fulls[example_id])
                if ref is not None:
                    return Reference(ref.first_logits, ref.token_ids[:self.max_new_tokens])
        return None

    def missing(self, example_ids: list[str]) -> list[str]:
        return [i for i in example_ids if self.get(i) is None]
