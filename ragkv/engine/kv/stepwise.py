"""Work in units: a generator that yields between units (a block encoded, a prefill chunk) and returns a result.

The server's scheduler advances a prefill one unit between two batched decode steps, which bounds the pause a
newcomer imposes on running answers; everyone else drains the generator at once. A unit that needs the model
yields its `Forward` (ragkv.models.loop.computed) so that a scheduler can run it in one pass with the decode
rows; `drain` runs each alone.
"""

from __future__ import annotations

from typing import Generator, TypeVar

from ragkv.models.loop import Forward, resume

T = TypeVar("T")
Steps = Generator["Forward | None", "object", T]


def drain(steps: Steps[T]) -> T:
    """Run every unit (each forward alone); return the generator's result."""
    out = None
    while True:
        try:
            item = resume(steps, out)
        except StopIteration as done:
            return done.value
        out = None
        if isinstance(item, Forward):
            try:
                out = item.run()
            except Exception as e:  # noqa: BLE001 - thrown into the generator, which may handle it (a store fault)
                out = e
