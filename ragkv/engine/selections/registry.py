"""Selection name -> selection object (`blend`'s and `auto`'s `select`). A selection module registers its class with
`@register`; `ragkv.engine.selections` imports every module of the package, so adding one is adding a module."""

from __future__ import annotations

from ragkv.errors import OptionError

_SELECTIONS: dict = {}


def register(cls):
    if cls.name in _SELECTIONS:
        raise ValueError(f"two selections named {cls.name!r}")
    _SELECTIONS[cls.name] = cls()
    return cls


def selection_names() -> tuple[str, ...]:
    """Registered selection names, the default (CacheBlend's deviation) first."""
    return tuple(_SELECTIONS)


def get_selection(name: str):
    try:
        return _SELECTIONS[name]
    except KeyError:
        raise OptionError("select", f"unknown selection {name!r}; choose one of {', '.join(_SELECTIONS)}") from None
