"""A mode sees a narrow context (ragkv/engine/modes/context.py), not the Engine: the members it reads, named."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ragkv.engine.modes.context import MEMBERS, ModeContext

MODES = Path(__file__).resolve().parent.parent / "ragkv" / "engine" / "modes"


def test_the_context_names_exactly_what_the_modes_read():
    read = {m for p in MODES.glob("*.py") for m in re.findall(r"\bctx\.([a-z_]+)", p.read_text())}
    assert read == set(MEMBERS), f"read but not named: {read - set(MEMBERS)}; named but unread: {set(MEMBERS) - read}"


def test_a_member_reads_through_and_anything_else_is_refused(tiny_engine):
    engine = tiny_engine()
    ctx = engine.mode_context
    assert isinstance(ctx, ModeContext) and ctx.forward_model is engine.forward_model
    engine.ape_temperature = 0.5  # a calibration reloaded on the engine is seen at once
    assert ctx.ape_temperature == 0.5
    with pytest.raises(AttributeError, match="a mode reads only"):
        ctx.tokenizer
    with pytest.raises(AttributeError, match="read-only"):
        ctx.num_layers = 3
