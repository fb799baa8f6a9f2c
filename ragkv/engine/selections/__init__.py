"""Recompute selections, one module each (deviation, query, sinks, recent; base.py says what a selection provides):
which r of the block tokens `blend` and `auto` recompute over the reused blocks.

Importing this package registers every selection module in it: the built-in order first (the default first), then
any other module found here (a new selection needs no edit outside its own module)."""

from __future__ import annotations

import importlib
import pkgutil

from ragkv.engine.selections.registry import get_selection, selection_names

_BUILT_IN = ("deviation", "query", "sinks", "recent")
_SUPPORT = ("base", "registry")
for _name in _BUILT_IN + tuple(sorted(m.name for m in pkgutil.iter_modules(__path__)
                                      if m.name not in _BUILT_IN + _SUPPORT)):
    importlib.import_module(f"{__name__}.{_name}")

SELECTIONS = selection_names()  # every registered selection name; the first is the default

__all__ = ["SELECTIONS", "get_selection", "selection_names"]
