"""Name -> object, for the engine's pluggable kinds (fusion modes, recompute selections): a module registers its
class with `@registry.register`; the kind's package imports every module in it, so adding one is adding a
module. An unknown name is an OptionError naming the option field and every registered name."""

from __future__ import annotations

from ragkv.errors import OptionError


class Registry:
    def __init__(self, kind: str, plural: str, field: str):
        self.kind, self.plural, self.field = kind, plural, field
        self.items: dict = {}

    def register(self, cls):
        if cls.name in self.items:
            raise ValueError(f"two {self.plural} named {cls.name!r}")
        self.items[cls.name] = cls()
        return cls

    def names(self) -> tuple[str, ...]:
        return tuple(self.items)

    def get(self, name: str):
        try:
            return self.items[name]
        except KeyError:
            raise OptionError(self.field, f"unknown {self.kind} {name!r}; choose one of "
                                          f"{', '.join(self.items)}") from None
