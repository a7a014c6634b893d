"""The copy streams of a GPU and the events that order them against the compute stream, shared by what moves tensors
between host and GPU memory (offload.py) and the sharding engine (parallel/shard.py); on a CPU, plain synchronous
copies, which is how CI runs the same bookkeeping.

Ordering: every copy waits for the compute stream's work so far, and compute waits for a copy's event before the
work that needs it. A GPU buffer is allocated on the compute stream; one read by a copy stream after compute has let
it go is marked with `record_stream`, so that the allocator does not hand it out before the copy is done.
"""

from __future__ import annotations

import torch


class Copier:
    """The host-to-device and device-to-host copy streams of a GPU; plain synchronous copies on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.h2d = torch.cuda.Stream(device) if self.cuda else None
        self.d2h = torch.cuda.Stream(device) if self.cuda else None

    def copy(self, stream, pairs: list[tuple[torch.Tensor, torch.Tensor]], after=None):
        """Copies each (destination, source) on `stream` once the compute stream's work so far and the event `after`
        are done; returns the event marking the copies' end (None on a CPU, where they are done already)."""
        if not self.cuda:
            for dst, src in pairs:
                dst.copy_(src)
            return None
        stream.wait_stream(torch.cuda.current_stream())
        if after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        return stream.record_event()

    def wait(self, event) -> None:
        """The compute stream waits for a copy."""
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def keep_until_copied(self, tensor: torch.Tensor, stream) -> None:
        """`tensor`, read by a copy on `stream`, is not handed out again before that copy is done."""
        if self.cuda:
            tensor.record_stream(stream)


class CopyDone:
    """A copy's end, to wait for as for a collective's work."""

    def __init__(self, copier: Copier, event):
        self.copier, self.event = copier, event

    def wait(self) -> None:
        self.copier.wait(self.event)
