"""Weight copies in 2 MB pages: a decode step streams ~1 GB of weights, and in 4 KB pages that is ~250,000 pages, each
a TLB miss (a two-level walk under a hypervisor) and the end of a hardware prefetch stream. On an AMX Xeon (2 vCPUs,
THP in `madvise` mode) the AMX product read a 17 MB gate/up at 19.0 GB/s from 4 KB pages and 20.5 GB/s from 2 MB
pages (a sum over 1 GiB: 21 GB/s from 4 KB pages, 28 from 2 MB), and the small op after it (an RMSNorm of one
row) took 42 us instead of 7; a decode step of the 0.5B took 59.9 ms instead of 63.0 with its packed weights moved.

The gain depends on the host: in another hour on the same machine 4 KB pages read at 28.7 GB/s too, and the two
decode steps were level (57.0 and 57.3 ms). Its cost does not: faulting in ~1 GB of 2 MB pages added ~5.4 s to the
0.5B's load (6 s -> 11.4 s, each load; the hypervisor backs freed memory anew). So a server (`ragkv serve`) uses them
and one-shot commands do not: RAGKV_HUGE_PAGES=1 turns them on, 0 off (the server's default is 1, everything
else's 0).

Linux only, and only where the kernel grants them: the copy is mapped private and anonymous and advised before it is
touched (MADV_HUGEPAGE), so its pages fault in as 2 MB pages where memory allows and as 4 KB pages where it does not
(the same values either way).
"""

from __future__ import annotations

import logging
import mmap
import os

import torch

log = logging.getLogger(__name__)

PAGE = 2 << 20
# a tensor of 1 MB or more gets 2 MB pages: the 0.5B's QKV (2.1 MB) and output (1.6 MB) projections are 9% of a
# decode step's bytes; the last page's unused part (under 2 MB a tensor) is the price
MIN_BYTES = 1 << 20


def enabled() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("RAGKV_HUGE_PAGES", "0") == "1"


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
