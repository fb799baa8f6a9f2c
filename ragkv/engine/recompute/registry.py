"""Selection name -> selection object (`blend`'s and `auto`'s `select`). A selection module registers its class with
`@register`; `ragkv.engine.recompute` imports every module of the package, so adding one is adding a module."""

from __future__ import annotations

from ragkv.engine.request.registry import Registry

_SELECTIONS = Registry("selection", "selections", "select")
register = _SELECTIONS.register


def selection_names() -> tuple[str, ...]:
    """Registered selection names, the default (CacheBlend's deviation) first."""
    return _SELECTIONS.names()


def get_selection(name: str):
    return _SELECTIONS.get(name)
