"""How an option field is declared once (`option`): its default, help, bounds or choices; the CLI flags, the HTTP
schema and the eval mode keys are derived from the declarations (`option_specs`), and `check_option` is the one
check of a value. Below every mode: the options of decoding and of fusion both build on it."""

from __future__ import annotations

import functools
import typing
from dataclasses import dataclass, field, fields

from ragkv.errors import OptionError


def option(default, help: str, *, choices: tuple | None = None, ge=None, le=None, gt=None, key: str | None = None,
           max_items: int | None = None, word: tuple[str, str] | None = None):
    """A field declared once: its default, help, and bounds or choices. The CLI flags, the HTTP schema and the eval
    mode keys are derived from these declarations (`option_specs`), and `__post_init__` checks them for all three.
    `key`: its short name in an eval mode key (blend:r=0.3); `word`: a word the CLI takes in place of a value,
    setting a boolean field instead (--ratio auto)."""
    return field(default=default, metadata={"help": help, "choices": choices, "ge": ge, "le": le, "gt": gt,
                                            "key": key, "max_items": max_items, "word": word})


@dataclass(frozen=True)
class OptionSpec:
    name: str
    type: type             # int, float, str, bool, or tuple (of ints)
    optional: bool         # None allowed (means: the engine's calibrated or configured value)
    default: object
    help: str
    choices: tuple | None
    ge: float | None
    le: float | None
    gt: float | None
    key: str | None
    max_items: int | None
    word: tuple[str, str] | None


@functools.cache  # read once per class: options are built on every request
def option_specs(cls) -> tuple[OptionSpec, ...]:
    """Every declared field of an options dataclass, with its type read from the annotation."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in fields(cls):
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = type(None) in typing.get_args(hint)
        base = typing.get_origin(hint) or hint
        if optional:
            base = typing.get_origin(args[0]) or args[0]
        out.append(OptionSpec(f.name, base, optional, f.default, f.metadata.get("help", ""),
                              *(f.metadata.get(k) for k in ("choices", "ge", "le", "gt", "key", "max_items",
                                                            "word"))))
    return tuple(out)


def check_option(spec: OptionSpec, value) -> None:
    """The one check of a declared field's value, whatever it came from (flag, HTTP body, eval key)."""
    name = spec.name
    if value is None:
        if not spec.optional:
            raise OptionError(name, f"{name} must be set")
        return
    items = value if spec.type is tuple else (value,)
    if spec.max_items is not None and len(items) > spec.max_items:
        raise OptionError(name, f"{name} takes at most {spec.max_items} values, got {len(items)}")
    for v in items:
        if spec.choices is not None and v not in spec.choices:
            raise OptionError(name, f"{name} must be one of {', '.join(map(repr, spec.choices))}, got {v!r}")
        if spec.gt is not None and not v > spec.gt:
            raise OptionError(name, f"{name} must be > {spec.gt}, got {v}")
        if spec.ge is not None and not v >= spec.ge:
            raise OptionError(name, f"{name} must be >= {spec.ge}, got {v}")
        if spec.le is not None and not v <= spec.le:
            raise OptionError(name, f"{name} must be <= {spec.le}, got {v}")
