"""One set of defaults: every command and the server share the store, dtype and index; the optional
settings file changes them for all, flags override it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ragkv.cli import build_parser, main
from ragkv.models.registry import converted_path
from ragkv.settings import SettingsError, default_index_dir, default_store_spec
from tiny import default_model_available

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "docs"


@pytest.fixture
def fresh_env(tmp_path, monkeypatch):
    """A fresh cache directory and no settings file; the converted model is found where it is."""
    env = {"RAGKV_CACHE_DIR": str(tmp_path / "cache"), "RAGKV_MODELS_DIR": str(converted_path("smollm2").parent),
           "RAGKV_SETTINGS": str(tmp_path / "settings.toml")}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return dict(os.environ, **env)


def _ragkv(env, *argv, timeout=600):
    done = subprocess.run([sys.executable, "-m", "ragkv.cli", *argv], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.skipif(not default_model_available(), reason="default model not converted")
def test_ingest_then_ask_with_default_flags_hits_every_block(fresh_env):
    """The README's own flow, `ragkv ingest DIR` then `ragkv ask "..."`, each in its own process, flags left out."""
    ingested = json.loads(_ragkv(fresh_env, "ingest", str(EXAMPLES), "--json"))
    assert ingested["documents"] == 3 and ingested["chunks_added"] >= 3
    answer = json.loads(_ragkv(fresh_env, "ask", "Which method recomputes a fraction of tokens?", "--json",
                               "--max-new-tokens", "2"))
    assert answer["cache_misses"] == 0 and answer["cache_hits"] == answer["blocks"] + 1  # passages + prefix
    assert answer["sources"]
    stats = json.loads(_ragkv(fresh_env, "store", "stats", "--json"))
    disk = [t for t in stats["tiers"] if t["tier"] == "disk"]
    assert disk and disk[0]["entries"] == ingested["chunks_added"] + 1  # every chunk + the system prompt


def test_every_command_shares_the_default_store_dtype_and_index(fresh_env):
    parser = build_parser()
    for argv in (["ask", "q"], ["ingest", "x"], ["serve"], ["store", "warm"], ["store", "stats"],
                 ["store", "clear"], ["store", "profile"]):
        args = parser.parse_args(argv)
        assert args.store == default_store_spec(), argv
        assert getattr(args, "dtype", "auto") == "auto", argv
        assert str(getattr(args, "index", default_index_dir())) == str(default_index_dir()), argv
    for argv in (["eval", "--dataset", "hotpotqa"], ["bench", "ttft"], ["bench", "store"]):
        assert parser.parse_args(argv).dtype == "auto", argv
    assert default_store_spec().startswith("memory:") and str(Path(os.environ["RAGKV_CACHE_DIR"]) / "kv") in \
        default_store_spec()


def test_settings_file_sets_defaults_and_flags_override_it(fresh_env, tmp_path):
    Path(fresh_env["RAGKV_SETTINGS"]).write_text('dtype = "float32"\nstore = "memory:1GiB"\n\n[serve]\nport = 9123\n'
                                                 'max-batch = 4\n\n[bench.ttft]\nrepeats = 7\n')
    parser = build_parser()
    ask = parser.parse_args(["ask", "q"])
    assert ask.dtype == "float32" and ask.store == "memory:1GiB"
    serve = parser.parse_args(["serve", "--port", "9000"])
    assert serve.port == 9000 and serve.max_batch == 4 and serve.store == "memory:1GiB"
    assert parser.parse_args(["bench", "ttft"]).repeats == 7 and parser.parse_args(["bench", "store"]).repeats == 3
    assert parser.parse_args(["ask", "q", "--dtype", "bfloat16"]).dtype == "bfloat16"


@pytest.mark.parametrize("text,needle", [
    ('dtpye = "float32"\n', "dtpye"),
    ('[serve]\nprot = 1\n', "serve.prot"),
    ('[serv]\nport = 1\n', "[serv] (no such command)"),
    ('dtype = \n', "not valid TOML"),
])
def test_bad_settings_file_is_one_line_exit_2(fresh_env, capsys, text, needle):
    Path(fresh_env["RAGKV_SETTINGS"]).write_text(text)
    with pytest.raises(SettingsError, match="settings"):
        build_parser()
    assert main(["models"]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


@pytest.mark.parametrize("fast", [True, False])
def test_half_precision_follows_the_cpu_and_warns_where_it_is_emulated(monkeypatch, caplog, fast):
    """`auto` picks bf16 only on a CPU with AMX / AVX512-BF16; asking for bf16 elsewhere works but says it is slow
    (an AVX2-only EPYC took 5x fp32's time for Qwen 0.5B's prefill in bf16). Fine-tuning's autocast alike."""
    import torch

    from ragkv import config

    monkeypatch.setattr(config, "cpu_has_fast_bf16", lambda: fast)
    cpu = torch.device("cpu")
    with caplog.at_level("WARNING", logger="ragkv"):
        assert config.resolve_dtype("auto", cpu) == (torch.bfloat16 if fast else torch.float32)
        assert config.resolve_autocast(None, cpu) is fast
        assert not caplog.records
        assert config.resolve_dtype("bfloat16", cpu) == torch.bfloat16
        assert config.resolve_autocast(True, cpu) is True
        assert config.resolve_dtype("float32", cpu) == torch.float32
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == (0 if fast else 2)
    assert all("emulated" in w and "(float32 here)" in w or "(fp32 here)" in w for w in warned)
