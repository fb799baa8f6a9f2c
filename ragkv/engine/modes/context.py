"""What a fusion mode reads of the engine, each member named: modes never see the Engine itself."""

from __future__ import annotations

MEMBERS = (
    "forward_model", "num_layers", "fingerprint", "check_length",           # the model and its window
    "store", "block_cache", "block_pool", "loading_planner", "layer_stream",  # where blocks' KV live and come from
    "expected_kl", "escalations", "auto_signal", "auto_max_risk", "auto_source",  # blend's and auto's calibrations
    "ape_temperature", "ape_scale",                                          # APE's calibrated defaults
)


class ModeContext:
    """A view of the engine holding only MEMBERS (read through, so a calibration the engine reloads is seen at once);
    any other name is an AttributeError saying what a mode may read."""

    __slots__ = ("_engine",)

    def __init__(self, engine):
        object.__setattr__(self, "_engine", engine)

    def __getattr__(self, name: str):
        if name in MEMBERS:
            return getattr(self._engine, name)
        raise AttributeError(f"a mode reads only {', '.join(MEMBERS)} of the engine, not {name!r}")

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError("a mode's context is read-only")
