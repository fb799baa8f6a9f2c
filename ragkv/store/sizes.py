"""Byte sizes as people write them: 2GiB, 512 MiB, 1.5GB, 4096."""

from __future__ import annotations

import re

from ragkv.store.errors import StoreSpecError

UNITS = {"": 1, "b": 1,
         "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")


def parse_size(text: str) -> int:
    """Bytes in `text`: a number with an optional unit B, KB/MB/GB/TB (powers of 1000) or KiB/MiB/GiB/TiB
    (powers of 1024), case-insensitive.

    Raises:
        StoreSpecError: unparsable text, unknown unit, or a size of zero.
    """
    m = _SIZE_RE.fullmatch(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in UNITS:
        raise StoreSpecError(f"cannot read size {text!r}: write a number and a unit, e.g. 512MiB, 2GiB or 20GB "
                             f"(units: {', '.join(u for u in UNITS if u)}, case-insensitive)")
    size = int(float(m.group(1)) * UNITS[unit])
    if size <= 0:
        raise StoreSpecError(f"size {text!r} is zero; give a positive size such as 512MiB")
    return size


def format_size(n: int) -> str:
    """Shortest exact binary form (2GiB, 1536MiB) or plain bytes."""
    for unit, mult in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return f"{n}B"


def human_size(n: float) -> str:
    """Approximate size for people (1.2 GiB)."""
    for unit, mult in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= mult:
            return f"{n / mult:.1f} {unit}"
    return f"{int(n)} B"
