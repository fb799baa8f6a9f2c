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
from ragkv.bench.controller.config import ControllerBenchConfig
from ragkv.bench.fairness import FairnessConfig
from ragkv.bench.fuzz import FuzzConfig
from ragkv.bench.shadow_cost import ShadowBenchConfig
from ragkv.bench.soak.config import SoakConfig
from ragkv.bench.engine_vs_hf import EngineBenchConfig
from ragkv.bench.lookahead import LookaheadBenchConfig
from ragkv.bench.prefill_profile import ProfileBenchConfig
from ragkv.bench.store import StoreBenchConfig
from ragkv.bench.train_step import TrainStepBenchConfig
from ragkv.bench.weights import WeightsBenchConfig
from ragkv.bench.ttft import TtftBenchConfig
from ragkv.cli.config_args import add_config_args, config_from_args
from ragkv.cli.main import build_parser
from ragkv.errors import InvalidRequestError

DERIVED = [("ttft", TtftBenchConfig, ("fusion",)), ("engine", EngineBenchConfig, ()),
           ("decode", DecodeBenchConfig, ()), ("store", StoreBenchConfig, ("model", "dtype", "device", "fusion")),
           ("lookahead", LookaheadBenchConfig, ()), ("ceiling", CeilingBenchConfig, ()),
           ("profile", ProfileBenchConfig, ()), ("shared", SharedBenchConfig, ()),
           ("invariance", InvarianceBenchConfig, ("fusion",)), ("structured", StructuredBenchConfig, ()),
           ("chat", ChatBenchConfig, ("paths", "system")), ("fuzz", FuzzConfig, ("seed",)),
           ("shadow", ShadowBenchConfig, ()), ("fairness", FairnessConfig, ("server_args",)),
           ("train-step", TrainStepBenchConfig, ("bf16", "device")), ("weights", WeightsBenchConfig, ("modes",)),
           ("controller", ControllerBenchConfig, ("model", "dtype", "device", "r_min", "refresh_profile", "fusion"))]


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


def test_the_soak_benchs_flags_keep_their_names_and_reach_its_config(tmp_path, monkeypatch):
    """`bench soak` declares its flags from SoakConfig in three groups, some under names without the field's unit
    (`--fault-interval` for fault_interval_s); without flags it runs the config's defaults."""
    from ragkv.cli.bench_soak import soak_config

    monkeypatch.setenv("RAGKV_SETTINGS", str(tmp_path / "none.toml"))
    args = build_parser().parse_args(["bench", "soak"])
    want = SoakConfig(model=args.model, dtype=args.dtype, device=args.device)
    assert soak_config(args) == want
    args = build_parser().parse_args(["bench", "soak", "--fault-interval", "5", "--abuse-seconds", "9", "--calm", "0",
                                      "--kv-memory", "default", "--modes", "reuse,full", "--abuse-only",
                                      "--long-ape-every", "30"])
    got = soak_config(args)
    assert (got.fault_interval_s, got.abuse_max_s, got.calm_s, got.kv_memory, got.modes, got.abuse_only,
            got.long_ape_every_s) == (5.0, 9.0, 0.0, None, ("reuse", "full"), True, 30.0)
    with pytest.raises(InvalidRequestError, match="mode"):
        soak_config(build_parser().parse_args(["bench", "soak", "--modes", "reuse,nope"]))


def test_the_serve_and_replica_benchs_flags_reach_their_configs(tmp_path, monkeypatch):
    """`bench serve` derives its workload flags from ServeBenchConfig (mode keys and the peer built by hand) and its
    replica group from ReplicaBenchConfig, under the flag names they had (`--request-rates`, `--router`)."""
    from ragkv.bench.replicas import ReplicaBenchConfig
    from ragkv.bench.serve.config import ServeBenchConfig
    from ragkv.cli.bench_replicas import REPLICA_OWN
    from ragkv.cli.bench_serving import SERVE_BUILT, SERVE_FLAG_NAMES

    monkeypatch.setenv("RAGKV_SETTINGS", str(tmp_path / "none.toml"))
    args = build_parser().parse_args(["bench", "serve"])
    assert config_from_args(ServeBenchConfig, args, skip=SERVE_BUILT, flags=SERVE_FLAG_NAMES) == ServeBenchConfig()
    assert args.modes == ",".join(ServeBenchConfig.modes)
    assert all(getattr(args, f) == (",".join(v) if isinstance(v, tuple) else v)
               for f, v in ((f, getattr(ReplicaBenchConfig, f)) for f in REPLICA_OWN))
    args = build_parser().parse_args(["bench", "serve", "--request-rates", "0.5,1", "--slo-ttft", "3", "--no-warmup",
                                      "--router", "affinity,home:1", "--passage-sets", "5", "--no-single"])
    cfg = config_from_args(ServeBenchConfig, args, skip=SERVE_BUILT, flags=SERVE_FLAG_NAMES)
    assert (cfg.rates, cfg.slo_ttft_s, cfg.warmup) == ((0.5, 1.0), 3.0, False)
    assert (args.routers, args.sets, args.single) == ("affinity,home:1", 5, False)
