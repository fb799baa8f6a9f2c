"""Mode name -> mode object. A mode module registers its class with `@register`; `ragkv.engine.modes` imports
every module of the package, so adding a mode is adding one module."""

from __future__ import annotations

from ragkv.errors import OptionError

_MODES: dict = {}


def register(cls):
    if cls.name in _MODES:
        raise ValueError(f"two fusion modes named {cls.name!r}")
    _MODES[cls.name] = cls()
    return cls


def mode_names() -> tuple[str, ...]:
    """Registered mode names, the exact baselines first (the order tables and plots use)."""
    return tuple(_MODES)


def is_reference(name: str) -> bool:
    """Whether `name` is the exact mode the others are compared with (False for names no mode has: a peer's)."""
    return name in _MODES and _MODES[name].is_reference


def get_mode(name: str):
    try:
        return _MODES[name]
    except KeyError:
        raise OptionError("mode", f"unknown mode {name!r}; choose one of {', '.join(_MODES)}") from None
