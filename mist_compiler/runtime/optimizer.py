"""AdamW on flat fp32 master shards, the optimizer-offloaded part updated in host memory.

``FlatAdamW`` owns, per unit, the fp32 master copy of this rank's shard and the two Adam moments,
each a ``SplitBuffer`` with the plan's ``opt`` fraction on the host. A step is one fused update per
part (device part on the device, host part on the host): no per-parameter Python work. The math is
exactly ``torch.optim.AdamW`` (decoupled weight decay, bias corrections from the step count).

One step overlaps the device and the host, as the cost model's optimizer phase assumes:

1. the gradients of every unit's host part start for pinned host buffers (the d2h side stream);
2. the host parts' updates go to the ``HostWorkers`` threads (each chunk waits for its unit's copy,
   then runs the same flat AdamW; torch's CPU kernels release the GIL, so chunks use several cores);
3. meanwhile the main thread queues every device part's update on the device;
4. units are then finished in order (``on_unit_done(i)``, the runtime's write-back and its
   collective, which must come in the same order on every rank): a unit whose host part is still
   being updated is waited for while the later units' host updates go on.

Without workers (``HostMemory`` built without them) the host parts are updated inline, in order.
A compiled stage (``compiled``) updates device parts on a CPU device with :mod:`.fused_adamw`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from . import fused_adamw, kernels
from .offload import HostMemory, SplitBuffer
from .streams import HostWorkers, Streams, host_empty


@dataclass(frozen=True)
class AdamWConfig:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if not self.lr >= 0.0:
            raise ValueError(f"AdamWConfig.lr must be >= 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"AdamWConfig.betas must be two numbers in [0, 1), got {self.betas}")
        if not self.eps > 0.0:
            raise ValueError(f"AdamWConfig.eps must be > 0, got {self.eps}")
        if not self.weight_decay >= 0.0:
            raise ValueError(f"AdamWConfig.weight_decay must be >= 0, got {self.weight_decay}")


class GradSource(Protocol):
    """Where a unit's reduced fp32 gradients are (``zero.UnitBucket`` implements it)."""

    def reduced_grad_views(self, start: int, end: int) -> list[tuple[slice, torch.Tensor]]:
        """Views (no copies) covering ``[start, end)``: (window relative to ``start``, tensor);
        empty when the unit got no gradient this step (zeros)."""
        ...


class FlatGrads:
    """A :class:`GradSource` over one flat tensor (tests, callers without buckets)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def reduced_grad_views(self, start: int, end: int) -> list[tuple[slice, torch.Tensor]]:
        return [(slice(0, end - start), self.tensor[start:end])]


class ShardState:
    """Master weights and Adam moments of one unit's local shard (fp32, split device/host)."""

    def __init__(self, master: SplitBuffer, host_memory: HostMemory, opt_fraction: float) -> None:
        self.master = master
        make = lambda kind: SplitBuffer(master.numel, torch.float32, master.device, opt_fraction, host_memory, kind)
        self.exp_avg = make("opt")
        self.exp_avg_sq = make("opt")
        if self.exp_avg.boundary != master.boundary:
            raise ValueError("ShardState: master and moments must split at the same element")


@dataclass
class _Part:
    """One part (device or host) of one unit's shard, with its gradient on the way."""

    param: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad: torch.Tensor
    event: object  # the copy that brings ``grad`` (None: already there)


class FlatAdamW:
    """AdamW over the units' flat shards; ``step`` is called once per training step."""

    def __init__(self, config: AdamWConfig, streams: Streams | None = None, workers: HostWorkers | None = None,
                 timeout_s: float = 300.0) -> None:
        self.config = config
        self.streams = streams
        self.workers = workers
        self.timeout_s = timeout_s
        self.step_count = 0
        self.compiled = False  # device parts on a CPU device: one inductor-compiled loop (fused_adamw)

    def step(self, states: list[ShardState], grads: list[GradSource],
             on_unit_done: Callable[[int], None] | None = None) -> None:
        """Update every shard (see the module docstring for the order of work)."""
        self.step_count += 1
        host_parts = [self._host_part(state, source) for state, source in zip(states, grads)]
        host_work = [self._launch(part) if part is not None else [] for part in host_parts]
        with torch.profiler.record_function("mist.device_adamw"):
            for state, source in zip(states, grads):
                if state.master.boundary:
                    self._update(self._device_part(state, source))
        for index, futures in enumerate(host_work):
            HostWorkers.wait(futures, self.timeout_s, f"AdamW on the offloaded optimizer state of unit {index}")
            if on_unit_done is not None:
                on_unit_done(index)

    # ---- the parts ---------------------------------------------------------------------------
    def _device_part(self, state: ShardState, source: GradSource) -> _Part:
        end = state.master.boundary
        grad, event = self._gather(source, 0, end, state.master.device_part)
        self._streams(state).wait(event)
        return _Part(state.master.device_part, state.exp_avg.device_part, state.exp_avg_sq.device_part, grad, None)

    def _host_part(self, state: ShardState, source: GradSource) -> _Part | None:
        if not state.master.offloaded:
            return None
        start, end = state.master.boundary, state.master.numel
        grad, event = self._gather(source, start, end, state.master.host_part)
        for buffer in (state.master, state.exp_avg, state.exp_avg_sq):
            buffer.sync_host()
        return _Part(state.master.host_part, state.exp_avg.host_part, state.exp_avg_sq.host_part, grad, event)

    def _streams(self, state: ShardState) -> Streams:
        return self.streams or Streams(state.master.device)

    def _gather(self, source: GradSource, start: int, end: int, like: torch.Tensor):
        """The gradient of ``[start, end)`` on ``like``'s device: a view when it already lives there,
        else a buffer filled by asynchronous copies; returns (tensor, the last copy's event)."""
        views = source.reduced_grad_views(start, end)
        if len(views) == 1 and views[0][1].device == like.device and views[0][1].numel() == end - start:
            return views[0][1], None
        host_target = like.device.type == "cpu"
        out = (host_empty(end - start, torch.float32) if host_target
               else torch.empty(end - start, dtype=torch.float32, device=like.device))
        if not views:
            return out.zero_(), None
        event = None
        streams = self.streams or Streams(like.device)
        for window, view in views:
            if view.device == out.device:
                out[window].copy_(view)
            else:
                event = streams.copy_async(out[window], view, "d2h" if host_target else "h2d", after=event)
        return out, event

    # ---- the update ----------------------------------------------------------------------------
    def _update(self, part: _Part, lo: int = 0, hi: int | None = None, host: bool = False) -> None:
        """The fused update (Triton on a GPU) of a device part, torch's flat AdamW on a host part."""
        cfg = self.config
        window = slice(lo, part.param.numel() if hi is None else hi)
        update = kernels.adamw_torch if host else kernels.adamw
        if not host and self.compiled and part.param.device.type == "cpu":
            update = fused_adamw.adamw
        update(part.param[window], part.grad[window], part.exp_avg[window], part.exp_avg_sq[window],
               step=self.step_count, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)

    def _launch(self, part: _Part) -> list:
        """The host part's update: on the workers (chunked) when there are some, else now."""
        def run(lo: int, hi: int) -> None:
            if part.event is not None:
                part.event.synchronize()  # the gradient's copy to the host (only this thread waits)
            with torch.profiler.record_function("mist.host_adamw"):
                self._update(part, lo, hi, host=True)

        if self.workers is None:
            run(0, part.param.numel())
            return []
        return self.workers.chunks(part.param.numel(), run)
