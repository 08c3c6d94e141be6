"""One unit's flat bucket under ZeRO 0-3: where its weights, gradients and optimizer state live.

Per unit (``UnitBucket``), with N = the padded flat size and S = N / dp the local shard:

| state | ZeRO-0 | ZeRO-1 | ZeRO-2 | ZeRO-3 |
| --- | --- | --- | --- | --- |
| compute weights (param dtype) | N, persistent | N, persistent | N, persistent | N, gathered before use, freed after |
| weight source | the compute buffer | same | same | S (this rank's shard) |
| per-micro-batch grads (param dtype) | N while the unit's backward runs | same | same | same |
| fp32 grad accumulator (first grad to step) | N, all-reduced in place | N until the last reduce-scatter, then S | S | S |
| fp32 master + Adam moments | N | S | S | S |

(with grad_accum == 1, ZeRO 0/1 reduce the micro-batch buffer itself and hold no accumulator)

Low-precision gradients (``grad_dtype`` = the param dtype, the plan's ``grad_dtype``), ZeRO 0/1
only: the per-micro-batch buffer *is* the accumulator. It is zeroed once per step, autograd adds
every micro-batch into it in place (fp32 arithmetic, one rounding per micro-batch), and no fp32
copy exists until the last micro-batch's reduction, which casts the unit (scaled by 1/dp) into a
transient fp32 buffer and reduces in fp32: ZeRO-1 reduce-scatters it into the fp32 shard S and
frees the buffer; ZeRO-0 all-reduces it and casts the mean back into the buffer, which the
optimizer reads (upcast per chunk) until the step. Gradient memory between micro-batches: N in
the param dtype instead of N in fp32. ZeRO 2/3 are unchanged (their accumulator is the fp32 shard),
and so is a unit that offloads gradients (its fp32 accumulator is split with the host).

Weights offload (fraction w) keeps the weight source split device/host; the compute buffer then
becomes transient for ZeRO 0-2 as well and is refilled (host part copied in) before each use.
Grads / opt offload split the accumulator / master+moments the same way (``SplitBuffer``).
With fp32 parameters and no conflicting offload the master aliases the weights (no extra copy).

Gradient semantics: every micro-batch's gradient is scaled by 1/dp while it is cast into the fp32
reduction buffer and reduced with SUM, so the reduced gradient is that of the mean loss over the
data-parallel group (the caller scales each micro-batch's loss by 1/grad_accum). ZeRO 0/1
accumulate locally and reduce once on the last micro-batch (all-reduce / reduce-scatter); ZeRO 2/3
reduce-scatter every micro-batch into the sharded accumulator. Reductions run in fp32.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..ir.plan import Offload
from . import kernels
from .dist_compat import Pending, all_gather_flat, all_reduce_flat, reduce_scatter_flat
from .flat_buffer import FlatLayout, FreeableBuffer, bind_grads, bind_params
from .offload import HostMemory, SplitBuffer
from .optimizer import ShardState
from .streams import Streams


@dataclass
class BucketContext:
    """What every bucket of a stage shares."""

    zero: int
    group: dist.ProcessGroup | None
    rank: int
    world: int
    device: torch.device
    param_dtype: torch.dtype
    streams: Streams
    host_memory: HostMemory
    timeout_s: float
    trace: list | None = None  # when a list: ("fetch" | "free" | "reduce", unit) events, for tests and debugging
    # a parameter's initial value when it has none yet (made on demand, see materialize.py), else None
    initial: Callable[[nn.Parameter], torch.Tensor | None] = lambda param: None
    grad_unscale: float = 1.0  # 1 / the loss scale (fp16): folded into the cast to the fp32 reduction buffer
    grad_dtype: torch.dtype = torch.float32  # ZeRO 0/1: dtype of the gradients kept between micro-batches

    def record(self, event: str, unit: str) -> None:
        if self.trace is not None:
            self.trace.append((event, unit))


class UnitBucket:
    """The flat weights, gradients and optimizer shard of one unit's parameters."""

    def __init__(self, unit: str, named_params: list[tuple[str, nn.Parameter]], offload: Offload,
                 ctx: BucketContext) -> None:
        self.unit = unit
        self.ctx = ctx
        self.offload = offload
        self.names = [name for name, _ in named_params]
        self.params = [param for _, param in named_params]
        self.layout = FlatLayout.build(named_params, ctx.world)
        zero, n, s = ctx.zero, self.layout.padded_numel, self.layout.shard_numel
        self.shard_lo, self.shard_hi = self.layout.shard_range(ctx.rank)
        # a unit without trainable parameters has nothing to gather, reduce or update
        self.persistent_full = (zero < 3 and offload.weights == 0.0) or n == 0

        initial = self._initial_fp32()  # N fp32, identical on every dp rank
        self.full = FreeableBuffer(n, ctx.param_dtype, ctx.device)
        bind_params(self.params, self.full, self.layout)
        self.full.tensor.copy_(initial.to(ctx.device))

        local = initial if zero == 0 else initial[self.shard_lo:self.shard_hi]
        self.source: SplitBuffer | None = None
        if not self.persistent_full:
            source_values = initial if zero < 3 else local
            self.source = SplitBuffer(source_values.numel(), ctx.param_dtype, ctx.device, offload.weights,
                                      ctx.host_memory, "weights")
            self.source.write(0, source_values.to(ctx.param_dtype))
        self.master, self.master_aliases_weights = self._make_master(local)
        self.opt_state = ShardState(self.master, ctx.host_memory, offload.opt)

        self.grads = FreeableBuffer(n, ctx.param_dtype, ctx.device, allocated=False)
        self.grad_views = bind_grads(self.params, self.grads, self.layout)
        # low-precision ZeRO 0/1: the micro-batch buffer accumulates the step's gradients itself
        self.keeps_grads = zero <= 1 and ctx.grad_dtype != torch.float32 and offload.grads == 0.0
        acc_numel = n if zero <= 1 else s
        self.grad_acc = SplitBuffer(acc_numel, torch.float32, ctx.device, offload.grads, ctx.host_memory, "grads")
        # the accumulator's device part only exists from a step's first gradient to its optimizer update
        # (ZeRO 0/1 with grad_accum == 1 never allocate it); its host part stays allocated (pinned memory
        # is slow to allocate). acc_has_data False: no gradient yet, the first write copies.
        self.acc_has_data = False
        self._release_acc_device()
        self.reduced: torch.Tensor | None = None  # ZeRO 0/1: the reduced grads after the last micro-batch
        self.pending: list[Pending] = []
        self.weights_pending: Pending | None = None
        self.weights_event = None
        self.weights_state = "ready" if self.persistent_full else "free"
        self.grads_ready = 0
        self.in_backward = False
        self.fwd_holds = 0
        self.bwd_holds = 0
        self.transforms: dict[int, list[Callable[[torch.Tensor], None]]] = {}
        if not self.persistent_full:
            self.full.free()

    # ---- construction helpers -------------------------------------------------------------
    def _initial_fp32(self) -> torch.Tensor:
        flat = torch.zeros(self.layout.padded_numel, dtype=torch.float32, device=self.ctx.device)
        for slot, param in zip(self.layout.slots, self.params):
            value = self.ctx.initial(param)  # made now, one parameter at a time, when deferred
            flat[slot.offset:slot.offset + slot.numel].copy_((param.detach() if value is None else value).reshape(-1))
            del value
        if self.ctx.world > 1 and flat.numel():  # every rank starts from rank 0's weights
            src = dist.get_global_rank(self.ctx.group, 0) if self.ctx.group is not None else 0
            dist.broadcast(flat, src=src, group=self.ctx.group)
        return flat

    def _make_master(self, local: torch.Tensor) -> tuple[SplitBuffer, bool]:
        ctx, off = self.ctx, self.offload
        fp32 = ctx.param_dtype == torch.float32
        if fp32 and self.persistent_full and off.opt == 0.0:
            view = self.full.tensor if ctx.zero == 0 else self.full.tensor[self.shard_lo:self.shard_hi]
            return SplitBuffer(view.numel(), torch.float32, ctx.device, 0.0, ctx.host_memory, "opt", view), True
        if fp32 and ctx.zero == 3 and off.opt == off.weights:
            return self.source, True
        master = SplitBuffer(local.numel(), torch.float32, ctx.device, off.opt, ctx.host_memory, "opt")
        master.write(0, local)
        return master, False

    # ---- weights ------------------------------------------------------------------------------
    def fetch_weights(self) -> None:
        """Start materialising the full compute weights (no-op when resident or already started)."""
        if self.weights_state != "free":
            return
        ctx = self.ctx
        self.full.allocate()
        what = f"all_gather of unit {self.unit!r} weights"
        if ctx.zero < 3:
            self.weights_event = self.source.read_into(self.full.tensor, ctx.streams)
        elif self.source.offloaded:
            # the shard's host part is copied in first; on CUDA the current stream waits for that copy
            # before the all-gather is enqueued (the gather itself still overlaps later compute)
            staging = torch.empty(self.source.numel, dtype=ctx.param_dtype, device=ctx.device)
            ctx.streams.wait(self.source.read_into(staging, ctx.streams))
            self.weights_pending = all_gather_flat(self.full.tensor, staging, ctx.group, what)
            self.weights_pending.keep_alive = staging
        else:
            self.weights_pending = all_gather_flat(self.full.tensor, self.source.device_part, ctx.group, what)
        self.weights_state = "fetching"
        ctx.record("fetch", self.unit)

    def wait_weights(self) -> None:
        self.fetch_weights()
        if self.weights_state == "fetching":
            if self.weights_pending is not None:
                self.weights_pending.wait(self.ctx.timeout_s)
            self.ctx.streams.wait(self.weights_event)
            self.weights_pending, self.weights_event = None, None
            self.weights_state = "ready"

    def maybe_release_weights(self) -> None:
        """Free the transient compute weights when no forward or backward holds them."""
        if self.persistent_full or self.fwd_holds or self.bwd_holds or self.weights_state == "free":
            return
        self.wait_weights()  # never free a buffer a collective or copy is still writing
        self.full.free()
        self.weights_state = "free"
        self.ctx.record("free", self.unit)

    def reset_holds(self) -> None:
        """Between training steps: nothing holds the weights; free transient copies (they may be stale)."""
        self.fwd_holds = self.bwd_holds = 0
        self.maybe_release_weights()

    # ---- gradients ----------------------------------------------------------------------------
    def begin_grads(self) -> None:
        """Make the gradient views usable (zeroed) before autograd accumulates into them."""
        if not self.in_backward:
            # the previous micro-batch's reduction may still read (and then free) this buffer
            self.drain(block=True)
            # an accumulating buffer is zeroed when the step's first micro-batch allocates it
            self.grads.allocate(zero=not (self.keeps_grads and self.grads.allocated))
            self.grads_ready = 0
            self.in_backward = True

    def note_grad_ready(self, param_index: int) -> bool:
        """Count one parameter's gradient as complete; True when the whole bucket is.

        If someone replaced the parameter's ``.grad`` (e.g. ``zero_grad(set_to_none=True)``), autograd
        made a fresh tensor: its values go into the bucket view, which is re-attached.
        """
        param, view = self.params[param_index], self.grad_views[param_index]
        if param.grad is not view:
            if not self.in_backward:
                self.begin_grads()
            if param.grad is not None:
                view.add_(param.grad)
            param.grad = view
        self.grads_ready += 1
        return self.grads_ready == len(self.params)

    def reduce(self, last: bool) -> None:
        """The unit's micro-batch gradients are complete: transform, scale and reduce them."""
        ctx = self.ctx
        grads = self.grads.tensor
        ctx.record("reduce", self.unit)
        if grads.numel() == 0:
            self.in_backward = False
            self.reduced = grads.float()
            return
        for index, functions in self.transforms.items():
            view = self.params[index].grad
            for fn in functions:
                fn(view)
        if self.keeps_grads:
            self._reduce_kept(last)
            return
        scale = ctx.grad_unscale / ctx.world
        reuse = grads.dtype == torch.float32
        comm = grads if reuse else torch.empty_like(grads, dtype=torch.float32)
        kernels.scale_accumulate(comm, grads, scale, accumulate=False)
        if not reuse:
            self.grads.free()
        self.in_backward = False
        release_grads = self.grads.free if reuse else (lambda: None)
        if ctx.zero <= 1 and not last:
            # a fresh fp32 copy (mixed precision) becomes the accumulator on the step's first micro-batch
            # rather than being copied into a new one (two full fp32 buffers at once)
            self._accumulate(comm, adoptable=not reuse)
            release_grads()
            return
        if ctx.zero <= 1:
            if self.acc_has_data and not self.grad_acc.offloaded:
                # reduce the device accumulator in place: the micro-batch buffer can go right away
                self.grad_acc.device_part.add_(comm)
                release_grads()
                comm, release_grads = self.grad_acc.device_part, self._release_acc_device
            elif self.acc_has_data:
                for start, part in self.grad_acc.parts():
                    comm[start:start + part.numel()].add_(part.to(comm.device, non_blocking=True))
                self._release_acc_device()  # folded into the micro-batch buffer: its device part can go now
            if ctx.zero == 0:
                pending = all_reduce_flat(comm, ctx.group, f"all_reduce of unit {self.unit!r} grads")
                self.reduced = comm  # released after the optimizer step
            else:
                out = torch.empty(self.layout.shard_numel, dtype=torch.float32, device=ctx.device)
                pending = reduce_scatter_flat(out, comm, ctx.group, f"reduce_scatter of unit {self.unit!r} grads")
                self.reduced = out
                pending.then.append(release_grads)
        else:
            out = torch.empty(self.layout.shard_numel, dtype=torch.float32, device=ctx.device)
            pending = reduce_scatter_flat(out, comm, ctx.group, f"reduce_scatter of unit {self.unit!r} grads")
            pending.then.append(lambda: self._accumulate(out, adoptable=True))
            pending.then.append(release_grads)
        pending.keep_alive = comm
        self.pending.append(pending)

    def _reduce_kept(self, last: bool) -> None:
        """Low-precision ZeRO 0/1: nothing to do before the last micro-batch (the buffer accumulates);
        then the unit is reduced in fp32 (module docstring)."""
        ctx, grads = self.ctx, self.grads.tensor
        self.in_backward = False
        if not last:
            return
        scale = ctx.grad_unscale / ctx.world
        if ctx.zero == 0 and scale == 1.0:
            self.reduced = grads  # nothing to reduce or unscale: the optimizer reads the buffer
            return
        comm = torch.empty_like(grads, dtype=torch.float32)
        kernels.scale_accumulate(comm, grads, scale, accumulate=False)
        if ctx.zero == 0:
            pending = all_reduce_flat(comm, ctx.group, f"all_reduce of unit {self.unit!r} grads")
            pending.then.append(lambda: grads.copy_(comm))
            self.reduced = grads  # the mean, back in the param dtype, until the optimizer step
        else:
            self.grads.free()
            out = torch.empty(self.layout.shard_numel, dtype=torch.float32, device=ctx.device)
            pending = reduce_scatter_flat(out, comm, ctx.group, f"reduce_scatter of unit {self.unit!r} grads")
            self.reduced = out
        pending.keep_alive = comm
        self.pending.append(pending)

    def _accumulate(self, values: torch.Tensor, adoptable: bool = False) -> None:
        """``acc (+)= values``; an ``adoptable`` fp32 shard becomes the accumulator itself when possible."""
        acc = self.grad_acc
        if not self.acc_has_data:
            if adoptable and not acc.offloaded and values.numel() == acc.numel:
                acc.device_part = values
                self.acc_has_data = True
                return
            acc.device_part = torch.empty(acc.boundary, dtype=torch.float32, device=self.ctx.device)
        acc.write(0, values, accumulate=self.acc_has_data)
        self.acc_has_data = True

    def _release_acc_device(self) -> None:
        self.grad_acc.device_part = torch.empty(0, dtype=torch.float32, device=self.ctx.device)
        self.acc_has_data = False

    def drain(self, block: bool) -> None:
        """Finish completed reductions (all of them when ``block``)."""
        while self.pending and (block or self.pending[0].is_completed()):
            self.pending.pop(0).wait(self.ctx.timeout_s)

    def reduced_grad_views(self, start: int, end: int) -> list[tuple[slice, torch.Tensor]]:
        """Where this rank's reduced fp32 gradient over its master range ``[start, end)`` lives, as views
        (window relative to ``start``, tensor); empty when the unit got no gradient this step."""
        if self.ctx.zero <= 1:
            if self.reduced is None:
                raise RuntimeError(f"unit {self.unit!r}: no reduced gradients; was the last micro-batch's "
                                   f"backward run with set_last_microbatch(True) and finish_gradients()?")
            return [(slice(0, end - start), self.reduced[start:end])]
        if not self.acc_has_data:  # the unit got no gradient this step
            return []
        return [(window, part) for part, window in self.grad_acc.overlapping(start, end)]

    def reduced_parts(self) -> list[torch.Tensor]:
        """This rank's reduced fp32 gradients as stored (device and host parts), for inspection."""
        if self.ctx.zero <= 1:
            return [self.reduced] if self.reduced is not None else []
        return [part for _, part in self.grad_acc.parts()] if self.acc_has_data else []

    def drop_gradients(self) -> None:
        """Forget this step's reduced gradients (after the update, or instead of it: a skipped step)."""
        self.reduced = None
        self._release_acc_device()
        if self.grads.tensor.dtype == torch.float32 or self.keeps_grads:
            self.grads.free()

    # ---- after the optimizer ---------------------------------------------------------------
    def _on_device(self, part: torch.Tensor) -> torch.Tensor:
        """A master part on the compute device: the offloaded (host) part is copied asynchronously and
        cast there, not on the host."""
        ctx = self.ctx
        if part.device == ctx.device:
            return part
        staged = torch.empty(part.numel(), dtype=part.dtype, device=ctx.device)
        ctx.streams.wait(ctx.streams.copy_async(staged, part, "h2d"))
        return staged

    def write_back(self) -> Pending | None:
        """Copy the updated fp32 master into the param-dtype weights; returns an all-gather to wait on."""
        ctx = self.ctx
        self.drop_gradients()
        if (self.master_aliases_weights and ctx.zero in (0, 3)) or self.master.numel == 0:
            return None
        if ctx.zero in (0, 3):  # cast the master straight into the weights: no param-dtype copy of the unit
            for start, part in self.master.parts():
                part = self._on_device(part)
                if ctx.zero == 0 and self.persistent_full:
                    self.full.tensor[start:start + part.numel()].copy_(part)
                else:
                    self.source.write(start, part)
            return None
        new = torch.empty(self.master.numel, dtype=ctx.param_dtype, device=ctx.device)
        for start, part in self.master.parts():
            target = new[start:start + part.numel()]
            target.copy_(self._on_device(part))
        out = self.full.tensor if self.persistent_full else torch.empty(self.layout.padded_numel, dtype=ctx.param_dtype,
                                                                      device=ctx.device)
        pending = all_gather_flat(out, new, ctx.group, f"all_gather of unit {self.unit!r} updated weights")
        pending.keep_alive = new
        if not self.persistent_full:
            pending.then.append(lambda: self.source.write(0, out))
        return pending

    def full_weights(self) -> torch.Tensor:
        """The unit's full flat weights (a collective under ZeRO-3: every rank must call)."""
        if self.persistent_full:
            return self.full.tensor.clone()
        if self.ctx.zero < 3:
            return self.source.read(0, self.source.numel, self.ctx.device, self.ctx.streams).clone()
        out = torch.empty(self.layout.padded_numel, dtype=self.ctx.param_dtype, device=self.ctx.device)
        shard = self.source.read(0, self.source.numel, self.ctx.device, self.ctx.streams)
        all_gather_flat(out, shard.contiguous(), self.ctx.group, f"all_gather of unit {self.unit!r} weights").wait(
            self.ctx.timeout_s)
        return out

    def memory(self) -> dict[str, int]:
        """Bytes of this bucket's device-resident state right now, by kind."""
        def nbytes(tensor: torch.Tensor | None) -> int:
            return 0 if tensor is None else tensor.numel() * tensor.element_size()

        weights = self.full.tensor.untyped_storage().nbytes()
        if self.source is not None:
            weights += nbytes(self.source.device_part)
        opt = sum(b.device_part.numel() * b.device_part.element_size()
                  for b in (self.opt_state.exp_avg, self.opt_state.exp_avg_sq))
        if not self.master_aliases_weights:
            opt += nbytes(self.master.device_part)
        grad_storages = {}
        for tensor in (self.grads.tensor, self.grad_acc.device_part, self.reduced):
            if tensor is not None and tensor.untyped_storage().nbytes():
                grad_storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        grads = sum(grad_storages.values())
        return {"weights": weights, "grads": grads, "opt": opt}
