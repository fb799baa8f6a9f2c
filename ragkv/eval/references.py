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
