"""Resumable JSONL results: interrupted writes, config mismatch, overwrite."""

import json

import pytest

from ragkv.errors import RagkvError
from ragkv.eval.results import ResultsConfigMismatchError, ResultsFile, ResultsFileError, read_results

CONFIG = {"dataset": "musique", "modes": ["full", "reuse"], "max_new_tokens": 32, "model": "smollm2"}


def _rec(i, mode="full"):
    return {"example_id": str(i), "mode_key": mode, "output": f"answer {i}", "f1": 0.5}


def test_resume_after_interrupted_write(tmp_path):
    path = tmp_path / "run" / "results.jsonl"
    rf = ResultsFile(path, CONFIG)
    for i in range(3):
        rf.append(_rec(i))
    assert rf.done_keys() == {("0", "full"), ("1", "full"), ("2", "full")}
    data = path.read_bytes()
    path.write_bytes(data[:-15])  # the last record's write was cut short

    config, records = read_results(path)
    assert config == CONFIG and [r["example_id"] for r in records] == ["0", "1"]
    resumed = ResultsFile(path, CONFIG)
    assert resumed.done_keys() == {("0", "full"), ("1", "full")}
    resumed.append(_rec(2))
    lines = path.read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[-1]) == _rec(2)  # the partial line was cut off, not glued to
    assert ResultsFile(path, CONFIG).done_keys() == {("0", "full"), ("1", "full"), ("2", "full")}


def test_line_without_newline_is_partial(tmp_path):
    path = tmp_path / "r.jsonl"
    ResultsFile(path, CONFIG).append(_rec(0))
    path.write_bytes(path.read_bytes()[:-1])  # complete JSON, newline missing: not yet committed
    assert ResultsFile(path, CONFIG).done_keys() == set()


def test_different_config_refused_unless_overwrite(tmp_path):
    path = tmp_path / "r.jsonl"
    ResultsFile(path, CONFIG).append(_rec(0))
    other = {**CONFIG, "max_new_tokens": 64}
    with pytest.raises(ResultsConfigMismatchError, match=r"max_new_tokens.*--overwrite.*--output"):
        ResultsFile(path, other)
    assert len(read_results(path)[1]) == 1  # untouched
    fresh = ResultsFile(path, other, overwrite=True)
    assert fresh.done_keys() == set() and read_results(path) == (other, [])


def test_config_compared_after_json_round_trip(tmp_path):
    path = tmp_path / "r.jsonl"
    ResultsFile(path, {"modes": ("full", "reuse"), "r": 0.15}).append(_rec(0))
    assert ResultsFile(path, {"r": 0.15, "modes": ["full", "reuse"]}).done_keys() == {("0", "full")}


def test_foreign_or_corrupt_files(tmp_path):
    foreign = tmp_path / "notes.jsonl"
    foreign.write_text('{"hello": 1}\n')
    with pytest.raises(ResultsFileError, match="not a ragkv results file.*--overwrite"):
        ResultsFile(foreign, CONFIG)
    path = tmp_path / "r.jsonl"
    rf = ResultsFile(path, CONFIG)
    rf.append(_rec(0))
    rf.append(_rec(1))
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + "garbage\n" + lines[2])
    with pytest.raises(ResultsFileError, match="line 2"):
        ResultsFile(path, CONFIG)
    with pytest.raises(RagkvError, match="not found"):
        read_results(tmp_path / "missing.jsonl")


def test_empty_or_cut_header_starts_afresh(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"ragkv_results": 1, "con')
    assert ResultsFile(path, CONFIG).done_keys() == set()
    assert read_results(path) == (CONFIG, [])


def test_append_validates_record(tmp_path):
    rf = ResultsFile(tmp_path / "r.jsonl", CONFIG)
    with pytest.raises(ValueError, match="mode_key"):
        rf.append({"example_id": "0"})
    with pytest.raises(TypeError):
        rf.append({"example_id": "0", "mode_key": "full", "bad": object()})
    assert read_results(tmp_path / "r.jsonl")[1] == []  # nothing half-written


def test_shards_of_one_run_merge_and_other_runs_stay_apart(tmp_path):
    from ragkv.eval.results import read_runs

    paths = []
    for k, threads in ((1, 1), (2, 2)):  # shards may run with different thread counts
        rf = ResultsFile(tmp_path / f"s{k}.jsonl", {**CONFIG, "shard": f"{k}/2", "threads": threads})
        for i in range(k - 1, 6, 2):
            rf.append(_rec(i))
        paths.append(rf.path)
    ResultsFile(paths[0], {**CONFIG, "shard": "1/2", "threads": 1}).append(_rec(0))  # a duplicate counts once
    other = ResultsFile(tmp_path / "other.jsonl", {**CONFIG, "max_new_tokens": 8})
    other.append(_rec(0))
    runs = read_runs([*paths, other.path])
    assert [files for files, _, _ in runs] == [paths, [other.path]]
    assert sorted(int(r["example_id"]) for r in runs[0][2]) == list(range(6))
    assert runs[0][1]["shard"] == "1/2" and len(runs[1][2]) == 1
