"""Benchmark flags derived from their config dataclasses (ragkv/cli/config_args.py): a default is declared once."""

from dataclasses import dataclass, fields

import argparse
import pytest

from ragkv.bench.ceiling import CeilingBenchConfig
from ragkv.bench.chat import ChatBenchConfig
from ragkv.bench.invariance import InvarianceBenchConfig
from ragkv.bench.shared_blocks import SharedBenchConfig
from ragkv.bench.structured import StructuredBenchConfig
from ragkv.bench.decode import DecodeBenchConfig
from ragkv.bench.engine_vs_hf import EngineBenchConfig
from ragkv.bench.lookahead import LookaheadBenchConfig
from ragkv.bench.prefill_profile import ProfileBenchConfig
from ragkv.bench.store import StoreBenchConfig
from ragkv.bench.ttft import TtftBenchConfig
from ragkv.cli.config_args import add_config_args, config_from_args
from ragkv.cli.main import build_parser
from ragkv.errors import InvalidRequestError

DERIVED = [("ttft", TtftBenchConfig, ("fusion",)), ("engine", EngineBenchConfig, ()),
           ("decode", DecodeBenchConfig, ()), ("store", StoreBenchConfig, ("model", "dtype", "device", "fusion")),
           ("lookahead", LookaheadBenchConfig, ()), ("ceiling", CeilingBenchConfig, ()),
           ("profile", ProfileBenchConfig, ()), ("shared", SharedBenchConfig, ()),
           ("invariance", InvarianceBenchConfig, ("fusion",)), ("structured", StructuredBenchConfig, ()),
           ("chat", ChatBenchConfig, ("paths", "system"))]


@pytest.mark.parametrize("bench,cls,skip", DERIVED, ids=[d[0] for d in DERIVED])
def test_a_bench_without_flags_runs_its_configs_own_defaults(bench, cls, skip, tmp_path, monkeypatch):
    monkeypatch.setenv("RAGKV_SETTINGS", str(tmp_path / "none.toml"))  # no settings file: the declared defaults
    args = build_parser().parse_args(["bench", bench])
    got = config_from_args(cls, args, skip=skip)
    assert all(getattr(got, f.name) == f.default for f in fields(cls) if f.name not in skip), (got, cls())


def test_flags_reach_the_config_as_typed_values():
    args = build_parser().parse_args(["bench", "engine", "--lengths", "256,512", "--dtypes", "bfloat16",
                                      "--repeats", "2", "--weights", "auto,w8a8"])
    assert config_from_args(EngineBenchConfig, args) == EngineBenchConfig(
        model=args.model, lengths=(256, 512), dtypes=("bfloat16",), repeats=2, weights=("auto", "w8a8"))
    args = build_parser().parse_args(["bench", "decode", "--configs", "bfloat16:auto,float32:exact"])
    assert config_from_args(DecodeBenchConfig, args).configs == (("bfloat16", "auto"), ("float32", "exact"))
    with pytest.raises(InvalidRequestError, match="--configs"):
        config_from_args(DecodeBenchConfig, build_parser().parse_args(["bench", "decode", "--configs", "bfloat16"]))
    with pytest.raises(InvalidRequestError, match="--lengths"):
        config_from_args(EngineBenchConfig, build_parser().parse_args(["bench", "engine", "--lengths", "1k"]))


def test_every_derived_flag_needs_its_help():
    @dataclass(frozen=True)
    class Cfg:
        rounds: int = 3
        fast: bool = False

    p = argparse.ArgumentParser()
    with pytest.raises(KeyError, match="Cfg.fast"):
        add_config_args(p, Cfg, help={"rounds": "rounds"})
    p = argparse.ArgumentParser()
    add_config_args(p, Cfg, help={"rounds": "rounds", "fast": "go fast"})
    assert config_from_args(Cfg, p.parse_args(["--fast", "--rounds", "5"])) == Cfg(rounds=5, fast=True)


def test_the_chat_benchs_mode_keys_default_to_its_configs(tmp_path, monkeypatch):
    from ragkv.eval.modes import split_mode_list

    monkeypatch.setenv("RAGKV_SETTINGS", str(tmp_path / "none.toml"))
    args = build_parser().parse_args(["bench", "chat"])
    assert tuple(split_mode_list(args.paths)) == ChatBenchConfig().paths
