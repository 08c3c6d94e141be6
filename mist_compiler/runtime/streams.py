"""Where asynchronous work runs: side streams for host<->device copies, threads for host work.

On CUDA, ``Streams.copy_async`` runs a copy on a side stream (one for host-to-device, one for
device-to-host) after the current stream's pending work, and returns an event; ``wait`` makes
the current stream wait for it. Buffers used on a side stream are ``record_stream``-ed so the
caching allocator does not reuse them early. Host buffers are pinned when CUDA is available
(``pin_memory`` fails without an accelerator, TORCH-NOTES section 4).
On CPU the same calls copy synchronously and return ``None``; ``wait(None)`` is a no-op, so the
runtime has one code path for both.
``HostWorkers`` is a small thread pool for the host side of offloading (AdamW on offloaded optimizer
states; on a CPU device also adding offloaded gradients): torch's CPU kernels release the GIL, so
chunks of one flat update run on several cores while the main thread keeps the device busy. Its size
is the cores this rank may use (its CPU affinity divided by the ranks on the node), less two on a GPU
machine for the threads that launch kernels, or ``MIST_HOST_THREADS``. Copy events block rather than
spin, so a thread waiting on one leaves its core to them; ``add_to_host_async`` adds into pinned host
memory on the device.
Every host buffer comes from ``host_empty``; ``allocating_host_memory()`` is true while it runs, so
a memory probe on CPU (where host and device are the same RAM) can tell host buffers apart.
"""
from __future__ import annotations

import concurrent.futures
import os
import threading
from dataclasses import dataclass, field
from typing import Callable

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

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: str, after=None):
        """``dst.copy_(src)`` on side stream ``stream``, ordered after the current stream's work (and
        after ``after``, an event of another side stream: no host wait)."""
        if not self.asynchronous:
            dst.copy_(src)
            return None
        side = self.side(stream)
        side.wait_stream(torch.cuda.current_stream(self.device))
        if after is not None:
            side.wait_event(after)
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
            for tensor in (dst, src):
                if tensor.is_cuda:
                    tensor.record_stream(side)
            event = torch.cuda.Event(blocking=True)  # a host wait sleeps: spinning threads starve the launches
            event.record(side)
        return event

    ADD_PIECE_ELEMENTS = 1 << 24  # the device buffer of ``add_to_host_async``: 64 MB of fp32 at most

    def add_to_host_async(self, dst: torch.Tensor, src: torch.Tensor, stream: str):
        """``dst += src`` for flat tensors, a pinned host ``dst`` and a device ``src``, all on side stream
        ``stream`` (after the current stream's work): piece by piece, ``dst`` comes to the device, the add
        runs there and the sum goes back. No host thread touches the data; returns the last copy's event."""
        side = self.side(stream)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            add_through(dst, src, self.ADD_PIECE_ELEMENTS)  # its buffer is used and freed in this stream's order
            src.record_stream(side)
            event = torch.cuda.Event(blocking=True)
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


def add_through(dst: torch.Tensor, src: torch.Tensor, piece_elements: int) -> None:
    """``dst += src`` (flat) computed on ``src``'s device through one buffer of at most
    ``piece_elements``: each piece of ``dst`` is copied there, added to and copied back, in order."""
    piece = max(1, min(dst.numel(), piece_elements))
    buffer = torch.empty(piece, dtype=dst.dtype, device=src.device)
    for lo in range(0, dst.numel(), piece):
        hi = min(lo + piece, dst.numel())
        part = buffer[:hi - lo]
        part.copy_(dst[lo:hi], non_blocking=True)
        part.add_(src[lo:hi])
        dst[lo:hi].copy_(part, non_blocking=True)


LAUNCHING_THREADS = 2  # the main thread and autograd's device thread, which keep a GPU fed


def host_threads() -> int:
    """Threads for host-side work: ``MIST_HOST_THREADS``, else this rank's share of its cores, less
    the cores that launch its GPU work (on an H200 with every core adding offloaded gradients, the
    launching threads were descheduled and the GPU sat idle for two thirds of the backward)."""
    if os.environ.get("MIST_HOST_THREADS"):
        return max(1, int(os.environ["MIST_HOST_THREADS"]))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    share = cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    return max(1, share - (LAUNCHING_THREADS if torch.cuda.is_available() else 0))


class HostWorkTimeout(RuntimeError):
    """Host-side work (offload accumulation, host AdamW) did not finish within the timeout."""


class HostWorkers:
    """A thread pool for host-side work, with chunked submission of flat updates."""

    MIN_CHUNK = 1 << 16  # elements: smaller pieces cost more in scheduling than they gain

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads or host_threads()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="mist-host")
        return self._pool.submit(fn, *args)

    def chunks(self, numel: int, fn: Callable[[int, int], None]) -> list[concurrent.futures.Future]:
        """Run ``fn(lo, hi)`` over ``[0, numel)`` in up to ``threads`` pieces, asynchronously."""
        pieces = max(1, min(self.threads, numel // self.MIN_CHUNK))
        bounds = [numel * i // pieces for i in range(pieces + 1)]
        return [self.submit(fn, lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]

    @staticmethod
    def wait(futures: list[concurrent.futures.Future], timeout_s: float, what: str) -> None:
        for future in futures:
            try:
                future.result(timeout=timeout_s)
            except concurrent.futures.TimeoutError:
                raise HostWorkTimeout(f"{what} did not finish within {timeout_s:.0f} s") from None

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
