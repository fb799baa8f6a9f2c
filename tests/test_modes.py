"""A mode is an object (ragkv/engine/modes) and an option is declared once (ragkv/engine/options.py): the engine,
the benchmarks and the eval harness ask the mode, and the CLI, the HTTP schema and the eval keys derive every
FusionOptions field from its declaration and refuse the same values."""

import argparse
import ast
from dataclasses import replace
from pathlib import Path

import pytest
from pydantic import ValidationError

import ragkv
from ragkv.cli.common import add_fusion_args, fusion_from_args
from ragkv.engine.modes import MODES, get_mode
from ragkv.engine.options import FusionOptions, fusion_option_specs, validate_fusion
from ragkv.errors import InvalidRequestError, OptionError
from ragkv.eval.modes import ModeKeyError, PARAMS, parse_mode_key
from ragkv.serve.schemas import RagkvExtras

ROOT = Path(ragkv.__file__).parent
SPECS = fusion_option_specs()


def _names_a_mode(node) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in MODES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_mode(e) for e in node.elts)
    return False


def _about_a_mode(node) -> bool:
    return "mode" in ast.unparse(node).lower()


def test_no_mode_name_is_compared_outside_the_mode_modules():
    """`mode == "blend"` and `mode in ("full", "prefix")` belong to the mode objects, nowhere else."""
    sites = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.parent.name == "modes" and path.parent.parent.name == "engine":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                if any(map(_names_a_mode, operands)) and any(_about_a_mode(o) for o in operands
                                                               if not _names_a_mode(o)):
                    sites.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {ast.unparse(node)}")
    assert not sites, "mode names compared outside ragkv/engine/modes:\n" + "\n".join(sites)


def test_the_registry_holds_every_mode_once_with_what_the_engine_needs():
    assert MODES[:5] == ("full", "prefix", "reuse", "ape", "blend")
    assert [m for m in MODES if get_mode(m).is_reference] == ["full"]
    for name in MODES:
        mode = get_mode(name)
        assert mode.name == name and mode.summary
        assert set(mode.option_fields) <= {s.name for s in SPECS}
    with pytest.raises(OptionError, match="unknown mode 'warp'; choose one of full, prefix"):
        get_mode("warp")


def _valid(spec):
    """A value other than the default that the declaration accepts."""
    if spec.choices:
        return next(c for c in spec.choices if c != spec.default)
    if spec.type is bool:
        return True
    if spec.type is tuple:
        return (2, 3)
    if spec.type is float:
        return 0.5
    return (spec.ge or 0) + 2


def _invalid(spec):
    """A value the declaration refuses (None for a field that takes any value of its type)."""
    if spec.choices:
        return "no-such-choice"
    if spec.type is tuple:
        return ((spec.ge or 0) - 1,)
    if spec.ge is not None:
        return spec.ge - 1
    if spec.gt is not None:
        return spec.gt
    return None


def _cli(argv: list[str], mode="reuse") -> FusionOptions:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_fusion_args(p, default_mode=mode)
    return fusion_from_args(p.parse_args(argv))


def _flag_argv(spec, value) -> list[str]:
    flag = "--" + spec.name.replace("_", "-")
    if spec.type is bool:
        return [flag] if value else []
    return [flag, ",".join(map(str, value)) if isinstance(value, tuple) else str(value)]


def _mode_for(spec) -> str:
    return next((m for m in MODES if spec.name in get_mode(m).option_fields), "blend")


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_every_option_is_reachable_from_the_cli_the_http_api_and_an_eval_key(spec):
    mode = _mode_for(spec)
    value = _valid(spec)
    expected = replace(FusionOptions(mode=mode), **{spec.name: value})
    # CLI flag, derived from the declaration
    assert _cli(_flag_argv(spec, value), mode) == expected
    # HTTP: the `ragkv` extras of a request, over the server's defaults
    extras = RagkvExtras(**{"mode": mode, spec.name: list(value) if isinstance(value, tuple) else value})
    assert replace(FusionOptions(), **extras.fusion_fields()) == expected
    # eval mode key: every field a mode reads has a short name there
    if spec.name in get_mode(mode).option_fields:
        key = next(k for k, (f, _) in PARAMS[mode].items() if f == spec.name)
        text = "+".join(map(str, value)) if isinstance(value, tuple) else str(int(value) if spec.type is bool
                                                                              else value)
        assert parse_mode_key(f"{mode}:{key}={text}") == replace(FusionOptions(mode="full"), mode=mode,
                                                                 **{spec.name: value})


@pytest.mark.parametrize("spec", [s for s in SPECS if _invalid(s) is not None],
                         ids=[s.name for s in SPECS if _invalid(s) is not None])
def test_every_option_refuses_the_same_values_everywhere(spec):
    mode, bad = _mode_for(spec), _invalid(spec)
    with pytest.raises(OptionError) as direct:
        validate_fusion(FusionOptions(**{"mode": mode, spec.name: bad}))
    assert direct.value.param == spec.name
    with pytest.raises((InvalidRequestError, argparse.ArgumentError, SystemExit)):
        _cli(_flag_argv(spec, bad), mode)
    with pytest.raises((ValidationError, InvalidRequestError)):  # the HTTP builder validates what it builds
        validate_fusion(FusionOptions(**{"mode": mode, **RagkvExtras(
            **{spec.name: list(bad) if isinstance(bad, tuple) else bad}).fusion_fields()}))
    if spec.name in get_mode(mode).option_fields:
        key = next(k for k, (f, _) in PARAMS[mode].items() if f == spec.name)
        text = "+".join(map(str, bad)) if isinstance(bad, tuple) else str(bad)
        with pytest.raises(ModeKeyError):
            parse_mode_key(f"{mode}:{key}={text}")


def test_ratio_auto_on_the_cli_sets_auto_ratio():
    assert _cli(["--ratio", "auto"], "blend") == FusionOptions(mode="blend", auto_ratio=True)
    with pytest.raises(InvalidRequestError, match="--ratio wants a number or 'auto'"):
        _cli(["--ratio", "lots"], "blend")
