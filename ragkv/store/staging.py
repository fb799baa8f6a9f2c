"""Getting loaded KV onto the compute device ahead of its use (CacheBlend sec. 5: loading layer i+1 overlaps
computing layer i, all the way to the GPU).

On CUDA, the prefetch thread copies each layer from pinned host memory with non-blocking copies on a side stream
and records an event; the compute stream waits for that event only when it takes the layer, so the copy of
layer i+1 runs while layer i computes. On CPU the layers pass through unchanged: the same code path, no copies.
"""

from __future__ import annotations

import torch


class Stager:
    def __init__(self, device: torch.device | str | None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None

    def stage(self, layer: list[tuple[torch.Tensor, torch.Tensor]]):
        """In the prefetch thread: start the layer's copy to the device; returns (tensors, ready event)."""
        if not self.cuda or all(k.device == self.device for k, _ in layer):
            return layer, None
        with torch.cuda.stream(self.stream):
            out = [(self._copy(k), self._copy(v)) for k, v in layer]
            event = torch.cuda.Event()
            event.record(self.stream)
        return out, event

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        if t.device == self.device:
            return t
        host = t if t.is_pinned() else t.pin_memory()  # page-locked: the copy can run asynchronously
        out = host.to(self.device, non_blocking=True)
        out.record_stream(torch.cuda.current_stream(self.device))  # freed only after the compute stream used it
        return out

    def ready(self, staged) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """In the computing thread: the layer, once its copy finished (the compute stream waits, the host not)."""
        layer, event = staged
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        return layer
