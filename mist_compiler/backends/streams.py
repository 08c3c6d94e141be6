"""Side streams for host<->device copies, degrading to synchronous copies on CPU.

On CUDA, ``Streams.copy_async`` runs a copy on a side stream (one for host-to-device, one for
device-to-host) after the current stream's pending work, and returns an event; ``wait`` makes
the current stream wait for it. Buffers used on a side stream are ``record_stream``-ed so the
caching allocator does not reuse them early. Host buffers are pinned when CUDA is available
(``pin_memory`` fails without an accelerator, TORCH-NOTES section 4).
On CPU the same calls copy synchronously and return ``None``; ``wait(None)`` is a no-op, so the
runtime has one code path for both.
Every host buffer comes from ``host_empty``; ``allocating_host_memory()`` is true while it runs, so
a memory probe on CPU (where host and device are the same RAM) can tell host buffers apart.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

HOST = torch.device("cpu")
_host_scope = threading.local()


def pinning_available() -> bool:
    return torch.cuda.is_available()


def host_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat host buffer, pinned when a CUDA device can use it for asynchronous copies."""
    _host_scope.depth = getattr(_host_scope, "depth", 0) + 1
    try:
        return torch.empty(numel, dtype=dtype, device=HOST, pin_memory=pinning_available())
    finally:
        _host_scope.depth -= 1


def allocating_host_memory() -> bool:
    """True (in this thread) while ``host_empty`` allocates: the new storage is host memory."""
    return getattr(_host_scope, "depth", 0) > 0


@dataclass
class Streams:
    """The side streams of one device (none on CPU)."""

    device: torch.device
    _side: dict[str, object] = field(default_factory=dict)

    @property
    def asynchronous(self) -> bool:
        return self.device.type == "cuda"

    def side(self, name: str):
        if name not in self._side:
            self._side[name] = torch.cuda.Stream(self.device)
        return self._side[name]

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: str):
        """``dst.copy_(src)`` on side stream ``stream``, ordered after the current stream's work."""
        if not self.asynchronous:
            dst.copy_(src)
            return None
        side = self.side(stream)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
            for tensor in (dst, src):
                if tensor.is_cuda:
                    tensor.record_stream(side)
            event = torch.cuda.Event()
            event.record(side)
        return event

    def wait(self, event) -> None:
        """Make the current stream wait for ``event`` (no-op for ``None``)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self, event) -> None:
        """Block the host until ``event`` completes (needed before the host reads a D2H copy)."""
        if event is not None:
            event.synchronize()
