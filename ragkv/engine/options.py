"""Per-request options: the fusion mode and its parameters (FusionOptions, a plain record in
engine/request/fusion.py), checked against the registered modes and selections here (`validate_fusion`, where
options enter), and decoding (GenerationOptions, engine/request/generation.py). Each field is declared once
(engine/request/option_spec.py)."""

from __future__ import annotations

from dataclasses import fields, replace

from ragkv.engine.modes import get_mode, mode_names
from ragkv.engine.recompute import SELECTIONS
from ragkv.engine.request.fusion import FusionOptions
from ragkv.engine.request.generation import GenerationOptions
from ragkv.engine.request.option_spec import OptionSpec, check_option, option, option_specs
from ragkv.errors import OptionError

_DEFAULTS = {f.name: f.default for f in fields(FusionOptions)}


def validate_fusion(fusion: FusionOptions) -> FusionOptions:
    """What the record cannot check alone: a registered mode and selection, and no field set away from its default
    for a mode that ignores it. Returns `fusion`; raises OptionError naming the field."""
    get_mode(fusion.mode)  # unknown names: an error listing the registered modes
    if fusion.select not in SELECTIONS:
        raise OptionError("select", f"select must be one of {', '.join(map(repr, SELECTIONS))}, got "
                          f"{fusion.select!r}")
    for name in ("positions", "conditioning"):
        value = getattr(fusion, name)
        if value != _DEFAULTS[name] and name not in get_mode(fusion.mode).option_fields:
            users = [m for m in mode_names() if name in get_mode(m).option_fields]
            raise OptionError(name, f"{name}={value!r} applies to mode {' or '.join(map(repr, users))} only, "
                              f"not {fusion.mode!r}")
    return fusion


def fusion_option_specs() -> tuple[OptionSpec, ...]:
    """FusionOptions' declared fields, `mode` and `select` with the registered names as their choices."""
    specs = option_specs(FusionOptions)
    return tuple(replace(s, choices=mode_names()) if s.name == "mode" else
                 replace(s, choices=tuple(SELECTIONS)) if s.name == "select" else s for s in specs)


__all__ = ["FusionOptions", "GenerationOptions", "OptionSpec", "check_option", "fusion_option_specs", "option",
           "option_specs", "validate_fusion"]
