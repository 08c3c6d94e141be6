"""Fractional offload: flat state split between device and host, and activation offload hooks.

``SplitBuffer`` holds one flat tensor of ``numel`` elements whose first ``boundary`` elements
live on the device and the rest (the offloaded fraction, rounded to whole elements) in host
memory. Every host tensor the runtime allocates is entered in a ``HostMemory`` registry, so the
bytes kept on the host can be measured even on CPU, where "host" and "device" are the same memory.

Host-side writes never stall the caller, and on a GPU they leave the host's cores alone. A write
into the (pinned) host part from a CUDA tensor runs on the d2h side stream: a copy is cast on the
device and copied straight into the host part; an accumulating write brings that slice of the host
part to the device, adds there and copies the sum back (as DeepSpeed's ZeRO-Offload accumulates).
On an H200 the earlier path (a pinned staging copy, then the copy, cast or add by host threads) made
50% weight and gradient offload 0.17 s and 0.25 s slower per step than the plan without them: the
host work was slow, and the threads doing it starved the ones launching kernels. On a CPU device an
accumulating write is a memcpy into a staging buffer and the add runs on the ``HostWorkers``
threads. Every later access to the host part (``parts``, ``overlapping``, reads, writes) first waits
for those copies and tasks, so callers see the same values as with synchronous writes. Without
workers (``HostMemory()`` alone) CPU writes are synchronous.

``ActivationOffloader`` is a ``saved_tensors_hooks`` pair per unit: during forward it moves a
fraction of the unit's saved activations to host memory, and during backward the runtime
prefetches them back one unit ahead. Rule (documented for the cost model): tensors are offloaded
in the order they are saved while the offloaded bytes stay within ``fraction`` of the bytes the
unit has saved so far (each storage counted once; a view saved again reuses its first decision),
so the offloaded share ends within one tensor of ``fraction``; parameters (tensors whose storage
is a weight buffer) are neither counted nor offloaded; non-contiguous tensors count but stay, and
so do tensors already on the host.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from ..ir.stage import split_boundary
from .streams import HostWorkers, Streams, host_empty

HOST_WORK_TIMEOUT_S = 300.0


@dataclass
class HostMemory:
    """Registry of the host tensors the runtime keeps (for offload accounting and tests), and the
    streams and threads that move data into them (None: synchronous writes)."""

    streams: Streams | None = None
    workers: HostWorkers | None = None
    timeout_s: float = HOST_WORK_TIMEOUT_S
    _tensors: list = field(default_factory=list)

    def register(self, tensor: torch.Tensor, kind: str) -> torch.Tensor:
        self._tensors.append((weakref.ref(tensor), kind))
        return tensor

    def bytes_by_kind(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        alive = []
        for ref, kind in self._tensors:
            tensor = ref()
            if tensor is None:
                continue
            alive.append((ref, kind))
            totals[kind] = totals.get(kind, 0) + tensor.numel() * tensor.element_size()
        self._tensors = alive
        return totals


class SplitBuffer:
    """A flat tensor split into a device part ``[0, boundary)`` and a host part ``[boundary, numel)``."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, host_fraction: float,
                 host_memory: HostMemory, kind: str, device_part: torch.Tensor | None = None) -> None:
        self.numel = numel
        self.dtype = dtype
        self.device = device
        self.boundary = split_boundary(numel, host_fraction)
        if device_part is not None and device_part.numel() != self.boundary:
            raise ValueError(f"SplitBuffer({kind}): device part has {device_part.numel()} elements, "
                             f"expected {self.boundary}")
        self.device_part = device_part if device_part is not None else torch.zeros(self.boundary, dtype=dtype, device=device)
        host = host_empty(numel - self.boundary, dtype).zero_() if numel > self.boundary else torch.empty(0, dtype=dtype)
        self.host_part = host_memory.register(host, kind) if host.numel() else host
        self.kind = kind
        self.host_memory = host_memory
        self._host_tasks: list[concurrent.futures.Future] = []
        self._host_copies: list = []  # events of direct device -> host copies into the host part

    @property
    def offloaded(self) -> bool:
        return self.host_part.numel() > 0

    def sync_host(self) -> None:
        """Wait for the deferred writes into the host part."""
        if self._host_copies:
            events, self._host_copies = self._host_copies, []
            for event in events:
                event.synchronize()
        if self._host_tasks:
            tasks, self._host_tasks = self._host_tasks, []
            HostWorkers.wait(tasks, self.host_memory.timeout_s, f"writing offloaded {self.kind} to host memory")

    def parts(self) -> list[tuple[int, torch.Tensor]]:
        """``(start offset, tensor)`` of the non-empty parts (the host part's pending writes done)."""
        self.sync_host()
        return [(start, part) for start, part in ((0, self.device_part), (self.boundary, self.host_part)) if part.numel()]

    def overlapping(self, start: int, end: int):
        """For each part meeting ``[start, end)``: (that slice of the part, the same range relative to ``start``)."""
        for offset, part in self.parts():
            lo, hi = max(start, offset), min(end, offset + part.numel())
            if lo < hi:
                yield part[lo - offset:hi - offset], slice(lo - start, hi - start)

    def zero_(self) -> None:
        self.sync_host()
        self.device_part.zero_()
        self.host_part.zero_()

    def read_into(self, dst: torch.Tensor, streams: Streams, start: int = 0):
        """Copy elements ``[start, start + dst.numel())`` into ``dst``; returns the last copy's event."""
        event = None
        for src, window in self.overlapping(start, start + dst.numel()):
            out = dst[window]
            if src.device == out.device:
                out.copy_(src)
            else:
                event = streams.copy_async(out, src, "h2d" if out.device.type != "cpu" else "d2h")
        return event

    def read(self, start: int, end: int, device: torch.device, streams: Streams) -> torch.Tensor:
        """Elements ``[start, end)`` as one tensor on ``device`` (a view when no copy is needed)."""
        for offset, part in self.parts():
            if offset <= start and end <= offset + part.numel() and part.device == device:
                return part[start - offset:end - offset]
        out = torch.empty(end - start, dtype=self.dtype, device=device)
        streams.synchronize(self.read_into(out, streams, start))
        return out

    def write(self, start: int, values: torch.Tensor, accumulate: bool = False) -> None:
        """``self[start:start+n] = values`` (or ``+=``), copying across devices as needed; writes into the
        host part run on the d2h stream from a GPU, on the host workers (if any) on a CPU (see the module
        docstring)."""
        for dst, window in self.overlapping(start, start + values.numel()):
            src = values[window]
            if self._is_host(dst) and dst.numel() and self._from_device(src):
                self._copy_to_host_async(dst, src, accumulate)
            elif self._is_host(dst) and dst.numel() and accumulate and self.host_memory.workers is not None:
                self._add_on_host_later(dst, src)  # (a plain CPU -> CPU copy is as cheap as staging it)
            elif accumulate:
                dst.add_(src.to(dst.device))
            else:
                dst.copy_(src)

    def _is_host(self, part: torch.Tensor) -> bool:
        return self.offloaded and part.untyped_storage().data_ptr() == self.host_part.untyped_storage().data_ptr()

    def _from_device(self, src: torch.Tensor) -> bool:
        """Whether ``src`` lives on a GPU whose side streams can write the (pinned) host part."""
        streams = self.host_memory.streams
        return src.is_cuda and streams is not None and streams.asynchronous

    def _copy_to_host_async(self, dst: torch.Tensor, src: torch.Tensor, accumulate: bool) -> None:
        streams = self.host_memory.streams
        flat = src.detach().reshape(-1)
        if accumulate:
            self._host_copies.append(streams.add_to_host_async(dst, flat, "d2h"))
        else:  # the cast runs on the device; copy_async keeps ``flat`` alive (record_stream) until the copy ends
            self._host_copies.append(streams.copy_async(dst, flat.to(dst.dtype), "d2h"))

    def _add_on_host_later(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        staging = host_empty(src.numel(), src.dtype)
        staging.copy_(src.detach().reshape(-1))  # the caller may free ``src`` right after this call

        def work(lo: int, hi: int) -> None:
            with torch.profiler.record_function("mist.host_grad_accumulate"):
                part = dst[lo:hi]
                part.add_(staging[lo:hi].to(part.dtype))

        self._host_tasks.extend(self.host_memory.workers.chunks(dst.numel(), work))


class ActivationOffloader:
    """Saved-tensor hooks moving a fraction of each unit's saved activations to host memory."""

    @dataclass
    class Saved:
        host: torch.Tensor
        device: torch.device
        shape: torch.Size
        d2h_event: object = None
        prefetched: torch.Tensor | None = None
        h2d_event: object = None
        uses: int = 1  # saved-tensor slots holding this record (a view saved twice shares one host copy)

    def __init__(self, fraction: float, streams: Streams, host_memory: HostMemory,
                 weight_storage_ptrs: Callable[[], set[int]]) -> None:
        self.fraction = fraction
        self.streams = streams
        self.host_memory = host_memory
        self.weight_storage_ptrs = weight_storage_ptrs  # current storages of weight buffers: never offloaded
        self.pending: dict[str, deque[list["ActivationOffloader.Saved"]]] = {}
        self.offloaded_bytes = 0
        self.kept_bytes = 0

    @contextlib.contextmanager
    def context(self, unit: str) -> Iterator[None]:
        if self.fraction <= 0.0:
            yield
            return
        records: list[ActivationOffloader.Saved] = []
        self.pending.setdefault(unit, deque()).append(records)
        budget = {"saved": 0, "offloaded": 0}
        # a view saved again reuses its decision; storages count once in the budget. Entries hold a
        # weak reference to their storage: memory freed and reused by a new tensor is not the same view
        decided: dict[tuple, tuple[weakref.ref, ActivationOffloader.Saved | None]] = {}
        counted: dict[int, weakref.ref] = {}

        def alive(entry_ref: weakref.ref | None, storage: torch.UntypedStorage) -> bool:
            return entry_ref is not None and entry_ref() is storage

        def pack(tensor: torch.Tensor):
            if self._is_weight(tensor):  # parameters are neither activations nor offloaded
                return tensor
            storage = tensor.untyped_storage()
            view = (storage.data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
            entry = decided.get(view)
            if entry is not None and alive(entry[0], storage):
                record = entry[1]
                if record is None:
                    return tensor
                record.uses += 1
                return record
            first = not alive(counted.get(view[0]), storage)
            counted[view[0]] = weakref.ref(storage)
            nbytes = tensor.numel() * tensor.element_size()
            if first:
                budget["saved"] += storage.nbytes()
            if not first or not self._offloadable(tensor) or budget["offloaded"] + nbytes > self.fraction * budget["saved"]:
                # (another view of a storage seen before stays: moving it would keep the storage twice)
                self.kept_bytes += nbytes if first else 0
                decided[view] = (weakref.ref(storage), None)
                return tensor
            budget["offloaded"] += nbytes
            self.offloaded_bytes += nbytes
            host = self.host_memory.register(host_empty(tensor.numel(), tensor.dtype), "acts")
            event = self.streams.copy_async(host, tensor.detach().view(-1), "d2h")
            record = ActivationOffloader.Saved(host, tensor.device, tensor.shape, event)
            records.append(record)
            decided[view] = (weakref.ref(storage), record)
            return record

        def unpack(packed):
            if not isinstance(packed, ActivationOffloader.Saved):
                return packed
            if packed.prefetched is None:
                self._prefetch_one(packed)
            self.streams.wait(packed.h2d_event)
            tensor = packed.prefetched
            packed.uses -= 1
            if packed.uses == 0:  # the last reader: autograd owns the device copy from here
                packed.prefetched, packed.h2d_event = None, None
            return tensor.view(packed.shape)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def _offloadable(self, tensor: torch.Tensor) -> bool:
        """Contiguous, non-weight tensors with data (host tensors too when host == device, i.e. CPU)."""
        if not tensor.is_contiguous() or tensor.numel() == 0 or tensor.is_sparse:
            return False
        if tensor.device.type == "cpu" and self.streams.asynchronous:
            return False
        return True

    def _is_weight(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self.weight_storage_ptrs()

    def _prefetch_one(self, record: "ActivationOffloader.Saved") -> None:
        device_copy = torch.empty(record.host.numel(), dtype=record.host.dtype, device=record.device)
        # the copy back waits for the copy out on the device side: no host stall
        record.h2d_event = self.streams.copy_async(device_copy, record.host, "h2d", after=record.d2h_event)
        record.d2h_event = None
        record.prefetched = device_copy

    def prefetch(self, unit: str) -> None:
        """Start copying back the oldest un-consumed forward's offloaded activations of ``unit``."""
        queue = self.pending.get(unit)
        if not queue:
            return
        for record in queue[0]:
            if record.prefetched is None:
                self._prefetch_one(record)

    def backward_done(self, unit: str) -> None:
        """The oldest forward of ``unit`` has been consumed by its backward: drop its records."""
        queue = self.pending.get(unit)
        if queue:
            queue.popleft()

    def clear(self) -> None:
        self.pending.clear()
