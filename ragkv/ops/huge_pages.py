"""Weight copies in 2 MB pages: a decode step streams ~1 GB of weights, and in 4 KB pages that is ~250,000 pages, each
a TLB miss (a two-level walk under a hypervisor) and the end of a hardware prefetch stream. On an AMX Xeon (2 vCPUs,
THP in `madvise` mode) the AMX product read a 17 MB gate/up at 19.0 GB/s from 4 KB pages and 20.5 GB/s from 2 MB
pages, and the small op after it (an RMSNorm of one row) took 42 us instead of 7; a decode step of the 0.5B took
62.5 ms instead of 65.6 with its packed weights moved.

Linux only, and only where the kernel grants them: the copy is mapped private and anonymous and advised before it is
touched (MADV_HUGEPAGE), so its pages fault in as 2 MB pages where memory allows and as 4 KB pages where it does not
(the same values either way). RAGKV_HUGE_PAGES=0 keeps every tensor where it was allocated.
"""

from __future__ import annotations

import logging
import mmap
import os

import torch

log = logging.getLogger(__name__)

PAGE = 2 << 20
MIN_BYTES = 2 * PAGE  # a smaller tensor spans at most one whole 2 MB page: not worth a mapping of its own


def enabled() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("RAGKV_HUGE_PAGES", "1") != "0"


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """`t.contiguous()`, written into memory advised for 2 MB pages where it is big enough (MIN_BYTES), on the CPU,
    and the mapping is granted (a strided view, such as a packing's permutation, is copied there directly). The
    tensor keeps its mapping alive; dropping the tensor unmaps it."""
    nbytes = t.numel() * t.element_size()
    if nbytes < MIN_BYTES or t.device.type != "cpu" or not enabled():
        return t.contiguous()
    try:
        # private and anonymous (a shared mapping is shmem, under THP's separate `shmem_enabled` setting); one page
        # more than needed, so the data can start on a 2 MB boundary
        area = mmap.mmap(-1, (nbytes + PAGE - 1) // PAGE * PAGE + PAGE,
                         flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        area.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError) as e:  # no memory for the mapping, or a kernel without THP
        log.debug("2 MB pages refused (%s): an ordinary copy", e)
        return t.contiguous()
    raw = torch.frombuffer(area, dtype=torch.uint8)
    start = -raw.data_ptr() % PAGE
    out = raw[start:start + nbytes].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out
