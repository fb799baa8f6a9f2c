"""Work in units: a generator that yields between units (a block encoded, a prefill chunk) and returns a result.

The server's scheduler advances a prefill one unit between two batched decode steps, which bounds the pause a
newcomer imposes on running answers; everyone else drains the generator at once.
"""

from __future__ import annotations

from typing import Generator, TypeVar

T = TypeVar("T")
Steps = Generator[None, None, T]


def drain(steps: Steps[T]) -> T:
    """Run every unit; return the generator's result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
