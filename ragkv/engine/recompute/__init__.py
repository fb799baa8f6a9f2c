"""Selective recompute, one room: which block tokens `blend` and `auto` recompute over the reused blocks, and how.

One module per selection owns its algorithm (deviation: CacheBlend; query: ProphetKV with its draft; sinks: EPIC;
recent); rows.py holds what they share (the r -> count rule, the window check, the recomputed rows' attention);
base.py says what a selection provides; record.py is what a recompute reports (RequestStats.recompute).

Importing this package registers every selection module in it: the built-in order first (the default first), then
any other module found here (a new selection needs no edit outside its own module)."""

from __future__ import annotations

import importlib
import pkgutil

from ragkv.engine.recompute.record import Recompute
from ragkv.engine.recompute.registry import get_selection, selection_names

_BUILT_IN = ("deviation", "query", "sinks", "recent")
_SUPPORT = ("base", "record", "registry", "rows")
for _name in _BUILT_IN + tuple(sorted(m.name for m in pkgutil.iter_modules(__path__)
                                      if m.name not in _BUILT_IN + _SUPPORT)):
    importlib.import_module(f"{__name__}.{_name}")

SELECTIONS = selection_names()  # every registered selection name; the first is the default

__all__ = ["SELECTIONS", "Recompute", "get_selection", "selection_names"]
