"""A benchmark's flags derived from its config dataclass (ragkv.bench.*): one flag per field, its type and default the
field's own, so a default is declared once (the config) and the flag cannot drift from it; the CLI adds only the help.
Tuples are comma-separated (`--lengths 1024,2048`; pairs as `a:b`), booleans `--x` / `--no-x`."""

from __future__ import annotations

import argparse
import typing
from dataclasses import MISSING, fields

from ragkv.cli.common import _flag, floats, ints
from ragkv.errors import InvalidRequestError


def _kind(hint) -> tuple[object, bool]:
    """(the field's type with None taken out, whether None is allowed)."""
    args = typing.get_args(hint)
    if type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return hint, False


def _item(hint):
    """A tuple's item type (tuple[int, ...] -> int; tuple[tuple[str, str], ...] -> tuple[str, str]), else None."""
    if typing.get_origin(hint) is tuple:
        return typing.get_args(hint)[0]
    return None


def _text(value) -> str:
    """A tuple default as its flag's text: 1024,2048 or float32:exact,bfloat16:auto."""
    return ",".join(":".join(map(str, v)) if isinstance(v, tuple) else str(v) for v in value)


def _flag_of(name: str, flags: dict[str, str] | None) -> str:
    """The flag of field `name`: its own name, or the one `flags` gives it."""
    return _flag((flags or {}).get(name, name))


def add_config_args(p, cls, help: dict[str, str], skip: tuple[str, ...] = (), only: tuple[str, ...] | None = None,
                    flags: dict[str, str] | None = None) -> None:
    """A flag for every field of `cls` but `skip` (or only those in `only`: a group's share), with `help[field]`
    (every derived flag needs one). `flags` names a field's flag where it is not the field's name (a unit suffix
    the flag leaves out: `fault_interval_s` -> `--fault-interval`); `p` is a parser or an argument group."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if f.name in skip or (only is not None and f.name not in only):
            continue
        if f.name not in help:
            raise KeyError(f"{cls.__name__}.{f.name} has no help for its flag")
        kind, _ = _kind(hints[f.name])
        default = f.default if f.default is not MISSING else None
        flag = _flag_of(f.name, flags)
        if kind is bool:
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                           help=help[f.name])
        elif _item(kind) is not None:
            text = _text(default or ())
            p.add_argument(flag, dest=f.name, default=text, metavar="A,B",
                           help=f"{help[f.name]} (comma-separated; default: {text or 'none'})")
        else:
            shown = "" if default is None else f" (default: {default})"
            p.add_argument(flag, dest=f.name, type=kind, default=default, metavar=flag[2:].replace("-", "_").upper(),
                           help=help[f.name] + shown)


def _parse(flag: str, item, raw: str) -> tuple:
    if item is int:
        return ints(raw, flag)
    if item is float:
        return floats(raw, flag)
    parts = [s for s in str(raw).split(",") if s]
    if typing.get_origin(item) is tuple:  # pairs a:b
        width = len(typing.get_args(item))
        pairs = tuple(tuple(s.split(":")) for s in parts)
        if any(len(pr) != width for pr in pairs):
            raise InvalidRequestError(f"{flag} wants {width}-part items like a:b, got {raw!r}")
        return pairs
    return tuple(parts)


def config_from_args(cls, args, skip: tuple[str, ...] = (), flags: dict[str, str] | None = None, **given):
    """`cls` from the flags `add_config_args` declared; `given` sets the fields the CLI builds itself (the skipped
    ones), and a skipped field not given keeps its default."""
    hints = typing.get_type_hints(cls)
    values = dict(given)
    for f in fields(cls):
        if f.name in values or f.name in skip:
            continue
        raw = getattr(args, f.name)
        kind, _ = _kind(hints[f.name])
        item = _item(kind)
        values[f.name] = _parse(_flag_of(f.name, flags), item, raw) if item is not None and raw is not None else raw
    return cls(**values)
