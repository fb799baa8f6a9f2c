"""Mode keys: one string per fusion configuration under evaluation, e.g. `full`, `ape:T=0.8,S=0.9`,
`blend:r=0.15,dev=k,check=1+4,gradual=1,sink=4`. A bare key takes its parameters from the CLI defaults
(blend ratio, APE T and S: the calibrated values when there are any)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ragkv.engine.modes import MODES, get_mode
from ragkv.engine.options import FusionOptions, OptionSpec, fusion_option_specs, validate_fusion
from ragkv.errors import InvalidRequestError, RagkvError


class ModeKeyError(RagkvError):
    """A mode key cannot be parsed; the message lists what is accepted."""


def _bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {s!r}")


def _layers(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.replace("/", "+").split("+") if x)


def _parser(spec: OptionSpec):
    return {bool: _bool, tuple: _layers}.get(spec.type, spec.type)


_SPECS = {spec.name: spec for spec in fusion_option_specs()}
# per mode: the FusionOptions fields it depends on (what a record stores and what must match on resume), and the
# short key parameter of each (blend:r=0.3), both from the mode object and the options' declarations
MODE_FIELDS = {name: get_mode(name).option_fields for name in MODES}
PARAMS = {name: {_SPECS[f].key: (f, _parser(_SPECS[f])) for f in fields if _SPECS[f].key}
          for name, fields in MODE_FIELDS.items()}
# fields added later: stored only when not at their default, so results files written before them still resume
LATER_FIELDS = {"check_rows": "selected", "select_per_block": False, "positions": "reencoded",
                "select": "deviation", "kv_layout": "copied", "conditioning": "none",
                "draft_tokens": 0, "score_layers": (), "score_from": 0.0,
                "whole_blocks": 0}


def without_later_defaults(params: dict | None) -> dict | None:
    """A record's params as they are stored now: records written while a later field was stored at its default
    (kv_layout, for a while) compare equal to those that omit it."""
    if params is None:
        return None
    return {k: v for k, v in params.items() if not (k in LATER_FIELDS and v == LATER_FIELDS[k])}


@dataclass(frozen=True)
class ModeSpec:
    key: str                 # as the user wrote it: the results' mode_key
    fusion: FusionOptions    # fully resolved (APE T and S filled in)

    @property
    def mode(self) -> str:
        return self.fusion.mode

    @property
    def params(self) -> dict:
        """The options this mode depends on, JSON-ready (stored in every record)."""
        out = {}
        for name in MODE_FIELDS[self.mode]:
            val = getattr(self.fusion, name)
            if name in LATER_FIELDS and val == LATER_FIELDS[name]:
                continue
            out[name] = list(val) if isinstance(val, tuple) else val
        return out


def split_mode_list(text: str) -> list[str]:
    """'full,ape:T=0.8,S=0.9,blend' -> ['full', 'ape:T=0.8,S=0.9', 'blend']: a comma-separated item holding
    '=' but no ':' continues the previous key's parameters."""
    keys: list[str] = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        if "=" in item and ":" not in item and keys and ":" in keys[-1]:
            keys[-1] += "," + item
        else:
            keys.append(item)
    if not keys:
        raise ModeKeyError(f"no modes given; pass e.g. --modes {','.join(MODES)}")
    return list(dict.fromkeys(keys))  # drop repeats, keep order


def parse_mode_key(key: str, base: FusionOptions = FusionOptions(mode="full")) -> FusionOptions:
    """FusionOptions for `key`; parameters missing from the key come from `base` (the CLI flags)."""
    name, _, rest = key.partition(":")
    if name not in MODES:
        raise ModeKeyError(f"unknown mode {name!r} in {key!r}; choose from {', '.join(MODES)} "
                           "(with parameters e.g. ape:T=0.8,S=0.9 or blend:r=0.15)")
    allowed = PARAMS.get(name, {})
    changes = {"mode": name}
    for item in filter(None, rest.split(",")):
        pname, eq, val = item.partition("=")
        if not eq or pname not in allowed:
            hint = ", ".join(allowed) if allowed else "none"
            raise ModeKeyError(f"bad parameter {item!r} in mode key {key!r}; {name} takes: {hint}")
        field, conv = allowed[pname]
        try:
            changes[field] = conv(val)
        except ValueError as e:
            raise ModeKeyError(f"bad value in mode key {key!r}: {pname}={val!r} ({e})") from None
    try:
        return validate_fusion(replace(base, **changes))
    except InvalidRequestError as e:
        raise ModeKeyError(f"mode key {key!r}: {e}") from None


def request_fields(key: str) -> dict:
    """The HTTP `ragkv` fields of a mode key ("reuse:kv=shared" -> {"mode": "reuse", "kv_layout": "shared"}): its
    mode and the parameters it sets away from their defaults."""
    opts = parse_mode_key(key)
    plain = FusionOptions(mode=opts.mode)
    out = {"mode": opts.mode}
    for spec in fusion_option_specs():
        value = getattr(opts, spec.name)
        if spec.name != "mode" and value != getattr(plain, spec.name):
            out[spec.name] = list(value) if isinstance(value, tuple) else value
    return out


def resolve_modes(keys: list[str], base: FusionOptions, defaults: dict) -> list[ModeSpec]:
    """Mode specs with every optional field a mode reads and the key left unset filled from `defaults` (the
    engine's calibrated values: APE's T and S, auto's signal and threshold), so that the record says what ran."""
    out = []
    for key in keys:
        f = parse_mode_key(key, base)
        fill = {k: v for k, v in defaults.items() if k in MODE_FIELDS[f.mode] and getattr(f, k) is None}
        out.append(ModeSpec(key, replace(f, **fill) if fill else f))
    return out


def engine_defaults(engine, ape_temperature: float | None = None, ape_scale: float | None = None) -> dict:
    """The engine's calibrated values for the optional fields (APE's T and S may be given per task instead)."""
    return {"ape_temperature": engine.ape_temperature if ape_temperature is None else ape_temperature,
            "ape_scale": engine.ape_scale if ape_scale is None else ape_scale,
            "signal": engine.auto_signal, "max_risk": engine.auto_max_risk}


def ape_key(t: float, s: float) -> str:
    return f"ape:T={t:g},S={s:g}"


def blend_key(r: float) -> str:
    return f"blend:r={r:g}"
