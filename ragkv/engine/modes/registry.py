"""Mode name -> mode object. A mode module registers its class with `@register`; `ragkv.engine.modes` imports
every module of the package, so adding a mode is adding one module."""

from __future__ import annotations

from ragkv.engine.request.registry import Registry

_MODES = Registry("mode", "fusion modes", "mode")
register = _MODES.register


def mode_names() -> tuple[str, ...]:
    """Registered mode names, the exact baselines first (the order tables and plots use)."""
    return _MODES.names()


def is_reference(name: str) -> bool:
    """Whether `name` is the exact mode the others are compared with (False for names no mode has: a peer's)."""
    return name in _MODES.items and _MODES.items[name].is_reference


def get_mode(name: str):
    return _MODES.get(name)
