"""Append-only JSONL results of an evaluation run, so an interrupted run resumes where it stopped.

Line 1 is a header `{"ragkv_results": 1, "config": {...}}`; every further line is one record holding at least
`example_id` and `mode_key`. A record counts once its newline is on disk: a partial trailing line (a write cut
short) is ignored on read and cut off before the next append.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from ragkv.errors import RagkvError

FORMAT_VERSION = 1
# config keys in which the shards of one run (`ragkv eval --shard K/N`) may differ: they merge into one run
SHARD_KEYS = ("shard", "threads")


class ResultsFileError(RagkvError):
    """A results file cannot be reused as asked; the message says what to pass instead."""


class ResultsConfigMismatchError(ResultsFileError):
    pass


def _canonical(config: Mapping[str, Any]) -> dict:
    try:
        return json.loads(json.dumps(dict(config), sort_keys=True))
    except (TypeError, ValueError) as e:
        raise ValueError(f"results config must be JSON-serializable: {e}") from None


def read_results(path: str | Path) -> tuple[dict, list[dict]]:
    """The header config and the complete records of a results file (ignoring a partial trailing line).

    Raises:
        ResultsFileError: missing file, no header, or a corrupt line that is not the last one.
    """
    path = Path(path)
    if not path.is_file():
        raise ResultsFileError(f"results file {path} not found")
    config, records, _ = _scan(path)
    if config is None:
        raise ResultsFileError(f"{path} is not a ragkv results file (no header line)")
    return config, records


def run_identity(config: Mapping[str, Any]) -> str:
    """The part of a results config that says which run it belongs to (its shard and thread count left out)."""
    return json.dumps({k: v for k, v in config.items() if k not in SHARD_KEYS}, sort_keys=True)


def read_runs(paths: list[str | Path]) -> list[tuple[list[Path], dict, list[dict]]]:
    """Results files grouped by run: (paths, the first file's config, records), in the order first seen.

    Files whose configs differ only in `SHARD_KEYS` are shards of one run and merge; an (example, mode) pair
    that two of them hold counts once (the first file's record).
    """
    runs: dict[str, tuple[list[Path], dict, list[dict], set]] = {}
    for path in map(Path, paths):
        config, records = read_results(path)
        files, _, merged, seen = runs.setdefault(run_identity(config), ([], config, [], set()))
        files.append(path)
        for r in records:
            if (r["example_id"], r["mode_key"]) not in seen:
                seen.add((r["example_id"], r["mode_key"]))
                merged.append(r)
    return [(files, config, records) for files, config, records, _ in runs.values()]


def _scan(path: Path) -> tuple[dict | None, list[dict], int]:
    """(config or None if no complete header, records, byte length of the complete lines)."""
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1  # everything after the last newline is a partial write
    lines = data[:end].split(b"\n")[:-1]
    if not lines:
        return None, [], 0
    try:
        header = json.loads(lines[0])
        if not (isinstance(header, dict) and header.get("ragkv_results") == FORMAT_VERSION
                and isinstance(header.get("config"), dict)):
            raise ValueError
    except ValueError:
        raise ResultsFileError(f"{path} is not a ragkv results file (line 1 is not its header); "
                               "pass --overwrite to replace it or choose another --output") from None
    records = []
    for no, line in enumerate(lines[1:], start=2):
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if not isinstance(rec, dict):
            raise ResultsFileError(f"{path}: line {no} is not a JSON object record; fix or delete that line, "
                                   "or pass --overwrite to start over")
        records.append(rec)
    return header["config"], records, end


class ResultsFile:
    """Results of one run configuration, appended record by record (flushed and fsynced).

    Opening an existing file with the same config resumes it; a different config raises
    `ResultsConfigMismatchError` unless `overwrite=True`, which starts the file afresh.
    """

    def __init__(self, path: str | Path, config: Mapping[str, Any], overwrite: bool = False):
        self.path = Path(path)
        self.config = _canonical(config)
        self._records: list[dict] = []
        if self.path.exists() and not overwrite:
            old_config, self._records, end = _scan(self.path)
            if old_config is None:  # empty, or the header itself was cut short
                self._start()
            elif old_config != self.config:
                raise ResultsConfigMismatchError(
                    f"{self.path} holds results of a different run configuration "
                    f"(differs in: {', '.join(_diff(old_config, self.config))}); "
                    "pass --overwrite to replace it or another --output to keep it")
            elif end < self.path.stat().st_size:
                os.truncate(self.path, end)  # drop the partial trailing line before appending
        else:
            self._start()

    def _start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._records = []
        self._write({"ragkv_results": FORMAT_VERSION, "config": self.config}, mode="w")

    def _write(self, obj: dict, mode: str = "a") -> None:
        line = json.dumps(obj, ensure_ascii=False) + "\n"
        with open(self.path, mode, encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def append(self, record: Mapping[str, Any]) -> None:
        """Write one record (needs `example_id` and `mode_key`) as one line, flushed and fsynced."""
        if "example_id" not in record or "mode_key" not in record:
            raise ValueError(f"a results record needs 'example_id' and 'mode_key', got keys {sorted(record)}")
        rec = json.loads(json.dumps(dict(record), ensure_ascii=False))  # fail before writing, store as read back
        self._write(rec)
        self._records.append(rec)

    def records(self) -> list[dict]:
        return list(self._records)

    def done_keys(self) -> set[tuple[Any, Any]]:
        """The (example_id, mode_key) pairs already written."""
        return {(r.get("example_id"), r.get("mode_key")) for r in self._records}


def _diff(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k, object()) != b.get(k, object())) or ["?"]
