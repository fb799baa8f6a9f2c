"""Fusion modes, one module each (full, prefix, reuse, ape, blend, auto; base.py says what a mode provides).

Importing this package registers every mode module in it: the built-in order first, then any other module
found here (a new mode needs no edit outside its own module)."""

from __future__ import annotations

import importlib
import pkgutil

from ragkv.engine.modes.registry import get_mode, is_reference, mode_names

_BUILT_IN = ("full", "prefix", "reuse", "ape", "blend", "auto")
_SUPPORT = ("base", "registry")
for _name in _BUILT_IN + tuple(sorted(m.name for m in pkgutil.iter_modules(__path__)
                                      if m.name not in _BUILT_IN + _SUPPORT)):
    importlib.import_module(f"{__name__}.{_name}")

MODES = mode_names()  # every registered mode name, in table order

__all__ = ["MODES", "get_mode", "is_reference", "mode_names"]
