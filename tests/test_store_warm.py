"""`ragkv store warm`: documents encoded once into a persistent store are hits for a later `ragkv ask` process."""

import json
import os
import subprocess
import sys

import pytest

from ragkv.cli import main
from ragkv.models.registry import converted_path
from ragkv.settings import default_store_spec
from tiny import default_model_available

DOCS = {"alpine_lakes.txt": "Lake Geneva is the largest lake of the Alps, shared by France and Switzerland.",
        "rivers.md": "The Rhone flows out of Lake Geneva at Geneva and reaches the Mediterranean near Arles."}


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    """A private RAGKV_CACHE_DIR (bandwidth profiles, default store) that still finds the converted model."""
    env = {"RAGKV_CACHE_DIR": str(tmp_path / "cache"), "RAGKV_MODELS_DIR": str(converted_path("smollm2").parent)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return dict(os.environ, **env)


@pytest.fixture
def docs_dir(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    for name, text in DOCS.items():
        (folder / name).write_text(text)
    return folder


@pytest.mark.skipif(not default_model_available(), reason="default model not converted (run `ragkv models "
                                                            "--prepare` or the README set-up)")
def test_warm_then_another_process_hits_every_block(tmp_path, docs_dir, cache_env, capsys):
    store = f"disk:{tmp_path / 'kv'}:1GiB"
    warm = ["store", "warm", "--docs-dir", str(docs_dir), "--store", store, "--dtype", "float32", "--device", "cpu"]
    assert main(warm) == 0
    assert "2 documents" in (out := capsys.readouterr().out) and "2 computed, 0 already present" in out
    assert main(warm + ["--doc", str(docs_dir / "rivers.md")]) == 0  # the same passages again (one twice)
    assert "0 computed, 3 already present (0 blocks encoded)" in capsys.readouterr().out

    ask = [sys.executable, "-m", "ragkv.cli", "ask", "Where does the Rhone leave Lake Geneva?", "--docs-dir",
           str(docs_dir), "--store", store, "--dtype", "float32", "--device", "cpu", "--json", "--max-new-tokens", "2"]
    done = subprocess.run(ask, env=cache_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout)
    assert stats["blocks"] == 2 and stats["cache_misses"] == 0 and stats["cache_hits"] == 3  # prefix + 2 passages


def test_warm_refuses_bad_input_before_loading_the_model(tmp_path, docs_dir, cache_env, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["store", "warm", "--docs-dir", str(empty)]) == 2
    assert "holds no .txt or .md files" in capsys.readouterr().err
    assert main(["store", "warm"]) == 2
    assert "--docs-dir DIR or --doc FILE" in capsys.readouterr().err
    assert main(["store", "warm", "--docs-dir", str(docs_dir), "--namespace", "../x"]) == 2
    assert "invalid namespace" in capsys.readouterr().err
    assert main(["store", "warm", "--docs-dir", str(docs_dir), "--store", "tape:/dev/st0"]) == 2
    assert "unknown store tier 'tape'" in capsys.readouterr().err


def test_default_store_follows_the_cache_dir(tmp_path, cache_env):
    """One default store for every command and the server: memory in front of the shared disk tier."""
    assert default_store_spec() == f"memory:2GiB,disk:{tmp_path / 'cache' / 'kv'}:20GiB"


def test_store_bench_ratios_and_verdicts():
    """`ragkv bench store` arithmetic on made-up timings (the benchmark itself is run by hand, never timed here)."""
    from types import SimpleNamespace

    from ragkv.bench.store import Config, render_markdown, summarize

    def config(mode, tier, pipelined, runs):
        return Config(mode, tier, pipelined, SimpleNamespace(), runs=runs, waits=[1.0] * len(runs))

    rows = summarize([config("full", "memory", None, [1000, 900, 1100]), config("reuse", "memory", None, [100, 90]),
                      config("reuse", "disk", True, [110, 120]), config("reuse", "disk (cold)", True, [120, 130]),
                      config("reuse", "disk", False, [200, 300])])
    warm, cold, off = rows[2:]
    assert warm["vs_memory"] == pytest.approx(115 / 95, abs=1e-3) and warm["meets_disk_target"]
    assert warm["best_vs_memory"] == pytest.approx(110 / 90, abs=1e-3) and warm["vs_full"] == 0.115
    assert cold["vs_memory"] == pytest.approx(125 / 95, abs=1e-3) and not cold["meets_disk_target"]
    assert "meets_disk_target" not in off  # the target is for pipelined loading
    text = render_markdown({"model": "m", "dtype": "float32", "device": "cpu", "threads": 2, "prompt_tokens": 99,
                            "context_tokens": 64, "blocks": 2, "kv_bytes": 10 ** 6, "repeats": 2, "ratio": 0.15,
                            "redis": "skipped", "loads": [{"tier": "disk", "ms": 1.0, "GBps": 1.0}], "ttft": rows})
    assert "- reuse from disk: 1.21x memory with pipelining (meets the <= 1.3x target; fastest runs: 1.22x)" in text
    assert "- reuse from disk (cold): 1.32x memory with pipelining (misses the <= 1.3x target" in text
