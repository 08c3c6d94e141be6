"""Per-tensor keep / recompute / offload of a unit's saved activations, as its ``SavedPolicy`` says.

A ``saved_tensors_hooks`` pair around each forward of a unit with a policy (one *session* per
forward, i.e. per micro-batch). The unit's program carries markers (``ops.saved_tags``) naming
the node that runs, so every tensor autograd saves is attributed to the node that made it: the
node that produced its storage (registered when the node returns) or, for a tensor made inside the
running node (a norm's statistics, an op saving its own result), the running node itself. Then:

- **keep**: the tensor is returned as is (autograd keeps it);
- **recompute**: nothing is kept but a record (which node, which of its saves or which view of its
  output). The first record unpacked in the backward runs the unit's *replay* program once: the
  recomputed nodes, in order, from the values they read that were referenced in the forward
  (``held``; one whose storage autograd saves and the policy offloads is held as that host copy and
  comes back with it), with grad mode on and the same ``requires_grad`` as in the forward, so that every node
  saves the same tensors in the same order; those are captured per node and handed to autograd as
  their records are unpacked (each released after its last use). Collectives in recomputed nodes
  (sequence parallelism's all-gathers) run in the same order on every rank, as the backward does;
- **offload**: a fraction of the tensor's storage goes to host memory (the storage once, whatever
  views of it are saved: the first elements stay on the device, the rest is copied out on the d2h
  stream) and comes back one unit ahead in the backward (``prefetch``), like
  :class:`.offload.ActivationOffloader`;
- without a plan policy (a sequence-parallel stage recomputing its gathers), the other tensors follow
  the unit's plain ``acts`` fraction (the greedy rule of ``ActivationOffloader``).
Weights (tensors in the runtime's weight buffers) are never touched.
"""
from __future__ import annotations

import contextlib
import weakref
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
from torch import nn

from ..ir.stage import SavedPolicy, split_boundary
from ..ops import saved_tags
from .offload import HostMemory
from .streams import Streams, host_empty
from .unit_hooks import around_forward


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def _detached(value: Any) -> Any:
    """The value without autograd history, each tensor keeping its ``requires_grad``."""
    if isinstance(value, torch.Tensor):
        copy = value.detach()
        return copy.requires_grad_(value.requires_grad) if value.is_floating_point() else copy
    if isinstance(value, (tuple, list)):
        return type(value)(_detached(v) for v in value)
    return value


@dataclass
class _HostCopy:
    """One saved storage moved (partly) to the host."""

    head: torch.Tensor | None  # the first elements, kept on the device
    host: torch.Tensor  # the rest, in host memory
    numel: int
    dtype: torch.dtype
    device: torch.device
    d2h_event: Any = None
    restored: torch.Tensor | None = None  # the whole storage back on the device
    h2d_event: Any = None
    uses: int = 0
    storage: Any = None  # weak reference to the device storage it copies (a freed one's address is reused)


@dataclass(frozen=True)
class _Offloaded:
    copy: _HostCopy
    size: tuple
    stride: tuple
    offset: int


@dataclass(frozen=True)
class _HeldOffloaded:
    """A held value whose storage went to the host with a saved tensor: restored for the replay."""

    record: _Offloaded
    requires_grad: bool


@dataclass(frozen=True)
class _Recomputed:
    session: "_Session"
    key: tuple  # (node, "save", k) or (node, "out", index, size, stride, offset)


class _Capture:
    """Replay's listener: what each recomputed node saves, in order."""

    def __init__(self) -> None:
        self.current: str | None = None
        self.saved: dict[str, list[torch.Tensor]] = {}

    def enter(self, tag: str) -> None:
        self.current = tag
        self.saved.setdefault(tag, [])

    def leave(self, tag: str, value: Any) -> None:
        self.current = None

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        # detached: the replay's graph is never run backward, so a packed tensor that is an output of
        # the node saving it (a norm's statistics) would hold its own grad_fn: a reference cycle that
        # kept every layer's recomputed tensors alive until the garbage collector ran
        tensor = tensor.detach()
        if self.current is not None:
            self.saved[self.current].append(tensor)
        return tensor


@dataclass
class _Session:
    """One forward of the unit: its saved tensors' records, held values and host copies."""

    owner: "SavedActivations"
    weights: set[int]
    current: str | None = None
    counts: Counter = field(default_factory=Counter)  # node -> saves seen while it ran
    producers: dict[int, tuple[str, int, weakref.ref]] = field(default_factory=dict)  # storage -> (node, output index)
    held: dict[str, Any] = field(default_factory=dict)
    host: dict[int, _HostCopy] = field(default_factory=dict)
    uses: Counter = field(default_factory=Counter)
    cache: dict[tuple, torch.Tensor] | None = None  # after the replay: record key -> tensor
    budget: dict[str, int] = field(default_factory=lambda: {"saved": 0, "offloaded": 0})
    greedy: dict[int, tuple[bool, weakref.ref]] = field(default_factory=dict)  # storage -> offloaded by the fraction

    # ---- markers ------------------------------------------------------------------------------
    def enter(self, tag: str) -> None:
        self.current = tag

    def leave(self, tag: str, value: Any) -> None:
        self.current = None
        self.produced(tag, value)

    def produced(self, tag: str, value: Any) -> None:
        for index, tensor in enumerate(_tensors(value)):
            storage = tensor.untyped_storage()
            entry = self.producers.get(storage.data_ptr())
            if entry is None or entry[2]() is not storage:  # new, or an address freed and given out again
                self.producers[storage.data_ptr()] = (tag, index, weakref.ref(storage))
        if tag in self.owner.policy.held:
            self.held[tag] = _detached(value)

    # ---- hooks --------------------------------------------------------------------------------
    def pack(self, tensor: torch.Tensor) -> Any:
        running = self.current
        position = self.counts[running] if running is not None else -1
        if running is not None:
            self.counts[running] += 1
        storage = tensor.untyped_storage()
        if storage.data_ptr() in self.weights:
            return tensor
        entry = self.producers.get(storage.data_ptr())
        if entry is not None and entry[2]() is storage:
            node, key = entry[0], (entry[0], "out", entry[1], tuple(tensor.shape), tuple(tensor.stride()),
                                   tensor.storage_offset())
        elif running is not None:
            node, key = running, (running, "save", position)
        else:
            return tensor
        policy = self.owner.policy
        if node in policy.recompute:
            self.uses[key] += 1
            return _Recomputed(self, key)
        fraction = policy.offload.get(node, 0.0)
        if fraction <= 0.0 and not self._greedy(tensor, storage):
            return tensor
        record = self._offload(tensor, storage, fraction if fraction > 0.0 else 1.0)
        if isinstance(record, _Offloaded):
            self._hold_on_host(storage)
        return record

    def _hold_on_host(self, storage) -> None:
        """A held value on the storage just offloaded: hold the host copy instead (the device storage
        would otherwise stay alive until the replay, and the offload would free nothing)."""
        for name, value in self.held.items():
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() == storage.data_ptr():
                record = self._offload(value, storage, 1.0)  # the copy exists: its split is reused
                self.held[name] = _HeldOffloaded(record, value.requires_grad)

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Recomputed):
            return packed.session._recomputed(packed.key)
        if isinstance(packed, _Offloaded):
            return self._restored(packed)
        return packed

    # ---- recompute ----------------------------------------------------------------------------
    def _recomputed(self, key: tuple) -> torch.Tensor:
        if self.cache is None:
            self._replay()
        tensor = self.cache[key]
        self.uses[key] -= 1
        if self.uses[key] == 0:
            del self.cache[key]
        return tensor

    def _replay(self) -> None:
        policy, module = self.owner.policy, self.owner.replay
        capture = _Capture()
        args = [self._held_value(self.held[name]) for name in policy.held]
        with saved_tags.listening(capture), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(capture.pack, lambda tensor: tensor):
            outputs = module(*args)
        values = dict(zip(policy.replayed, outputs))
        self.cache = {}
        for key in self.uses:
            node = key[0]
            if key[1] == "save":
                tensor = capture.saved[node][key[2]]
            else:
                _, _, index, size, stride, offset = key
                tensor = torch.as_strided(_tensors(values[node])[index], size, stride, offset)
            self.cache[key] = tensor.detach()
        self.held.clear()

    def _held_value(self, value: Any) -> Any:
        if not isinstance(value, _HeldOffloaded):
            return value
        return self._restored(value.record).detach().requires_grad_(value.requires_grad)

    # ---- offload ------------------------------------------------------------------------------
    def _greedy(self, tensor: torch.Tensor, storage) -> bool:
        """The plain ``acts`` fraction's rule: a storage goes to the host if, in save order, the bytes
        moved stay within the fraction of the bytes saved so far (decided once per storage)."""
        fraction = self.owner.fraction
        if fraction <= 0.0:
            return False
        ptr = storage.data_ptr()
        known = self.greedy.get(ptr)
        if known is None or known[1]() is not storage:
            self.budget["saved"] += storage.nbytes()
            fits = self.budget["offloaded"] + storage.nbytes() <= fraction * self.budget["saved"]
            known = self.greedy[ptr] = (fits and tensor.is_contiguous(), weakref.ref(storage))
            self.budget["offloaded"] += storage.nbytes() if known[0] else 0
        return known[0]

    def _offload(self, tensor: torch.Tensor, storage, fraction: float) -> Any:
        streams = self.owner.streams
        if tensor.device.type == "cpu" and streams.asynchronous:
            return tensor
        copy = self.host.get(storage.data_ptr())
        if copy is None or copy.storage() is not storage:
            numel = storage.nbytes() // tensor.element_size()
            flat = torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(storage, 0, (numel,), (1,))
            keep = split_boundary(numel, fraction)
            host = self.owner.host_memory.register(host_empty(numel - keep, tensor.dtype), "acts")
            event = streams.copy_async(host, flat.detach()[keep:], "d2h") if numel > keep else None
            copy = _HostCopy(flat.detach()[:keep].clone() if keep else None, host, numel, tensor.dtype, tensor.device,
                             event, storage=weakref.ref(storage))
            self.host[storage.data_ptr()] = copy
            self.owner.offloaded_bytes += (numel - keep) * tensor.element_size()
        copy.uses += 1
        return _Offloaded(copy, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())

    def prefetch(self) -> None:
        for copy in self.host.values():
            self._bring_back(copy)

    def _bring_back(self, copy: _HostCopy) -> None:
        if copy.restored is not None:
            return
        restored = torch.empty(copy.numel, dtype=copy.dtype, device=copy.device)
        keep = copy.numel - copy.host.numel()
        if copy.head is not None:
            restored[:keep].copy_(copy.head)
        if copy.host.numel():
            copy.h2d_event = self.owner.streams.copy_async(restored[keep:], copy.host, "h2d", after=copy.d2h_event)
        copy.restored, copy.head = restored, None

    def _restored(self, packed: _Offloaded) -> torch.Tensor:
        copy = packed.copy
        self._bring_back(copy)
        self.owner.streams.wait(copy.h2d_event)
        tensor = torch.as_strided(copy.restored, packed.size, packed.stride, packed.offset)
        copy.uses -= 1
        if copy.uses == 0:
            copy.restored = None
        return tensor


class SavedActivations:
    """A unit's per-tensor policy over its forwards: one session per forward, oldest first (the
    interface of :class:`.offload.ActivationOffloader`: ``context``, ``prefetch``, ``backward_done``)."""

    def __init__(self, policy: SavedPolicy, replay: fx.GraphModule | None, fraction: float, streams: Streams,
                 host_memory: HostMemory, weight_storage_ptrs: Callable[[], set[int]]) -> None:
        self.policy, self.replay, self.fraction = policy, replay, fraction
        self.streams, self.host_memory, self.weight_storage_ptrs = streams, host_memory, weight_storage_ptrs
        self.pending: deque[_Session] = deque()
        self.offloaded_bytes = 0

    @contextlib.contextmanager
    def context(self, unit: str, args: tuple = ()) -> Iterator[None]:
        session = _Session(self, set(self.weight_storage_ptrs()))
        for name, value in zip(self.policy.inputs, args):
            session.produced(name, value)
        self.pending.append(session)
        with saved_tags.listening(session), torch.autograd.graph.saved_tensors_hooks(session.pack, session.unpack):
            yield

    def prefetch(self, unit: str) -> None:
        if self.pending:
            self.pending[0].prefetch()

    def backward_done(self, unit: str) -> None:
        if self.pending:
            self.pending.popleft()

    def clear(self) -> None:
        self.pending.clear()


def install_saved_activations(runtime: Any, units: list[tuple[str, nn.Module]],
                              policies: dict[str, tuple[SavedPolicy, fx.GraphModule | None]]) -> list[Any]:
    """Run each unit with a policy under its hooks (in place of the plain activation offloader, whose
    ``acts`` fraction still applies to the nodes the policy does not name); returns the hook handles."""
    handles = []
    for name, module in units:
        if name not in policies:
            continue
        policy, replay = policies[name]
        fraction = runtime.activations[name].fraction if policy.plain_offload else 0.0
        saved = SavedActivations(policy, replay, fraction, runtime.streams, runtime.host_memory,
                                 runtime._weight_storage_ptrs)
        runtime.activations[name] = saved
        handles += around_forward(module, lambda args, saved=saved, name=name: saved.context(name, args))
    return handles


__all__ = ["SavedActivations", "install_saved_activations"]
