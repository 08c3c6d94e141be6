"""The data-parallel memory machinery of one pipeline stage: ZeRO 0-3, offload, AdamW.

``StageRuntime`` takes the stage's units (name, module) in execution order, turns each unit's
parameters into one flat bucket (``zero.UnitBucket``) and installs hooks on the unit modules:

- forward pre-hook: make the unit's weights resident (ZeRO-3 all-gather / offloaded part copied
  in), then prefetch the next unit's;
- forward hook: free transient weights, and hook the unit's outputs so that the moment their
  gradient arrives (the unit's backward begins) the weights are made resident again, the
  gradient views are zeroed, the previous unit's weights and this unit's offloaded activations
  are prefetched;
- post-accumulate-grad hooks: when all of a unit's gradients are complete, its bucket is scaled
  and reduced asynchronously (overlapping the rest of the backward), and its weights are freed.

A unit whose backward is split (``lowering/split_backward.py``) and defers its weight half holds
its weights through the input half only (released when its autograd node has run) and produces
no gradient there; ``weight_backward(unit, run)`` later makes its weights resident again, opens
its gradient buffers and runs the weight half, whose gradients arrive through the same hooks.

Typical use by the pipeline engine, per training step::

    runtime.begin_iteration()
    for each micro-batch m (in whatever schedule order):
        with runtime.activation_offload(name) per unit: forward the units
        runtime.set_last_microbatch(m is the last one); backward (loss already scaled by 1/G)
    runtime.finish_gradients(); runtime.step()

Contract details:
- ``dp_group=None`` means no data parallelism (dp = 1: no collectives), not the default group.
- Every dp rank starts from dp-rank 0's weights (one broadcast per unit at construction).
- Trainable parameters move into the runtime's buffers on ``device``; modules' buffers (e.g.
  rotary tables) stay where they are, so move the modules to ``device`` first. Frozen parameters
  (``requires_grad=False``) and those in ``exclude`` are left alone: not sharded, not updated.
- The units' ``.grad`` tensors are views into the runtime's gradient buckets. Setting them to
  None (``zero_grad``) is tolerated (the next gradient is copied back into the bucket, at the cost
  of one extra copy) but pointless: the runtime zeroes its buckets itself.
- ``set_last_microbatch`` must be called before each backward when grad_accum > 1 (ZeRO 0/1
  would otherwise reduce every micro-batch; the default is "last").
- ``grad_dtype`` (float32 or ``param_dtype``): the dtype of the gradients ZeRO 0/1 keep between
  micro-batches (``zero.py``: low-precision gradients accumulate in their micro-batch buffer).
- ``optimizer=None``: the caller's optimizer updates the fp32 masters in place (no Adam moments are
  made); ``refresh_weights()`` then casts them into the compute weights (``step()`` is refused).
- ``trace_events()`` records (event, unit) pairs (forward, backward, recompute, fetch, free,
  reduce) for debugging and for tests of the prefetch order.
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch
import torch.distributed as dist
from torch import nn

from ..ir.plan import Offload
from ..passes.offload_insertion import unit_offload_table
from ..lowering.split_backward import SplitBackward
from .dist_compat import all_gather_flat, group_rank, group_size
from .offload import ActivationOffloader, HostMemory
from .optimizer import AdamWConfig, FlatAdamW
from .streams import HostWorkers, Streams
from .zero import BucketContext, UnitBucket

__all__ = ["AdamWConfig", "StageRuntime", "StageRuntimeError"]


class StageRuntimeError(ValueError):
    """Bad arguments to the stage runtime; the message names the argument."""


def _in_backward() -> bool:
    """True while the autograd engine runs (e.g. a checkpointed forward being recomputed)."""
    return torch._C._current_graph_task_id() != -1


class StageRuntime:
    """ZeRO 0-3 over flat per-unit buckets, fractional offload and AdamW for one pipeline stage."""

    def __init__(self, units: list[tuple[str, nn.Module]], *, dp_group: dist.ProcessGroup | None,
                 zero: int, offload: Offload | dict[str, Offload], optimizer: AdamWConfig | None,
                 device: torch.device, param_dtype: torch.dtype = torch.float32,
                 timeout_s: float = 300.0, exclude: frozenset = frozenset(),
                 initial: Callable[[nn.Parameter], torch.Tensor | None] | None = None,
                 grad_dtype: torch.dtype = torch.float32) -> None:
        self._validate(units, zero, param_dtype, timeout_s, grad_dtype)
        self.exclude = {id(p) for p in exclude}  # parameters someone else keeps (a tied head)
        self.unit_names = [name for name, _ in units]
        self.modules = [module for _, module in units]
        self.device = torch.device(device)
        self.zero = zero
        self.streams = Streams(self.device)
        self.host_workers = HostWorkers()
        self.host_memory = HostMemory(self.streams, self.host_workers, timeout_s)
        self.ctx = BucketContext(zero, dp_group, group_rank(dp_group), group_size(dp_group), self.device,
                                 param_dtype, self.streams, self.host_memory, timeout_s, grad_dtype=grad_dtype,
                                 moments=optimizer is not None)
        if initial is not None:  # parameters without a value yet get it unit by unit (see materialize.py)
            self.ctx.initial = initial
        owned, self._needs = self._assign_parameters(units)
        table = self._offload_table(offload, owned)
        self.unit_offload = table
        self.buckets = [UnitBucket(name, owned[name], table[name], self.ctx) for name in self.unit_names]
        self._param_index = {name: (bucket, i) for bucket in self.buckets for i, name in enumerate(bucket.names)}
        self.optimizer = FlatAdamW(optimizer, self.streams, self.host_workers, timeout_s) if optimizer is not None \
            else None
        acts = {name: table[name].acts for name in self.unit_names}
        self.activations = {
            name: ActivationOffloader(fraction, self.streams, self.host_memory, self._weight_storage_ptrs)
            for name, fraction in acts.items()
        }
        self._last = True
        self._handles: list = []
        self._splits = [split if isinstance(split := getattr(m, "split", None), SplitBackward) else None
                        for m in self.modules]
        self._input_only = [0] * len(self.modules)  # input halves running without their weight half
        self._in_weight_half: int | None = None
        self._install_hooks()

    # ---- set-up ---------------------------------------------------------------------------------
    @staticmethod
    def _validate(units, zero, param_dtype, timeout_s, grad_dtype=torch.float32) -> None:
        if not isinstance(units, (list, tuple)) or not units:
            raise StageRuntimeError("StageRuntime: units must be a non-empty list of (name, nn.Module)")
        names = set()
        for index, unit in enumerate(units):
            if not (isinstance(unit, tuple) and len(unit) == 2 and isinstance(unit[0], str)
                    and isinstance(unit[1], nn.Module)):
                raise StageRuntimeError(f"StageRuntime: units[{index}] must be (name, nn.Module), got {unit!r}")
            if unit[0] in names:
                raise StageRuntimeError(f"StageRuntime: units[{index}] repeats the unit name {unit[0]!r}")
            names.add(unit[0])
        if zero not in (0, 1, 2, 3):
            raise StageRuntimeError(f"StageRuntime: zero must be 0, 1, 2 or 3, got {zero!r}")
        if param_dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise StageRuntimeError(f"StageRuntime: param_dtype must be float32, float16 or bfloat16, got {param_dtype}")
        if not timeout_s > 0:
            raise StageRuntimeError(f"StageRuntime: timeout_s must be > 0, got {timeout_s}")
        if grad_dtype not in (torch.float32, param_dtype):
            raise StageRuntimeError(f"StageRuntime: grad_dtype must be float32 or param_dtype {param_dtype}, got {grad_dtype}")

    def _assign_parameters(self, units):
        """Each trainable parameter belongs to the first unit that has it; later users 'need' that bucket."""
        owner_of: dict[int, str] = {}
        owned: dict[str, list[tuple[str, nn.Parameter]]] = {}
        needs: dict[str, list[str]] = {}
        for unit, module in units:
            owned[unit], needs[unit] = [], [unit]
            for name, param in module.named_parameters(remove_duplicate=True):
                if not param.requires_grad or id(param) in self.exclude:
                    continue
                if id(param) in owner_of:
                    if owner_of[id(param)] not in needs[unit]:
                        needs[unit].append(owner_of[id(param)])
                    continue
                owner_of[id(param)] = unit
                owned[unit].append((f"{unit}.{name}", param))
        return owned, needs

    def _offload_table(self, offload, owned) -> dict[str, Offload]:
        if isinstance(offload, Offload):
            sizes = [(name, sum(p.numel() for _, p in owned[name])) for name in self.unit_names]
            return unit_offload_table(sizes, offload)
        if isinstance(offload, dict):
            missing = [name for name in self.unit_names if name not in offload]
            if missing:
                raise StageRuntimeError(f"StageRuntime: offload table lacks unit(s) {missing}")
            return {name: offload[name] for name in self.unit_names}
        raise StageRuntimeError(f"StageRuntime: offload must be a plan Offload or {{unit: Offload}}, got {offload!r}")

    def _install_hooks(self) -> None:
        by_name = {bucket.unit: bucket for bucket in self.buckets}
        self._need_buckets = [[by_name[n] for n in self._needs[name]] for name in self.unit_names]
        for index, module in enumerate(self.modules):
            self._handles.append(module.register_forward_pre_hook(self._make_forward_pre(index)))
            self._handles.append(module.register_forward_hook(self._make_forward_post(index)))
        for index, bucket in enumerate(self.buckets):
            for param_index, param in enumerate(bucket.params):
                self._handles.append(param.register_post_accumulate_grad_hook(self._make_grad_ready(index, param_index)))

    def trace_events(self, enabled: bool = True) -> list:
        """Start (or stop) recording (event, unit) pairs: forward, backward, recompute, fetch, free, reduce."""
        self.ctx.trace = [] if enabled else None
        return self.ctx.trace

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.host_workers.shutdown()

    def _weight_storage_ptrs(self) -> set[int]:
        return {b.full.tensor.untyped_storage().data_ptr() for b in self.buckets if b.full.allocated}

    # ---- hooks ----------------------------------------------------------------------------------
    def _make_forward_pre(self, index: int):
        def hook(module, args):
            # a forward inside backward is a checkpoint recompute: the unit's backward already holds
            # its weights, and the recompute may stop early (no post-hook), so it takes no hold
            recompute = _in_backward()
            buckets = self._need_buckets[index]
            for bucket in buckets:
                bucket.fetch_weights()
            for bucket in buckets:
                bucket.wait_weights()
                bucket.fwd_holds += 0 if recompute else 1
            self.ctx.record("recompute" if recompute else "forward", self.unit_names[index])
            if not recompute and not self.buckets[index].params and torch.is_grad_enabled():
                self._finish_with_input_gradients(index, args)
            if index + 1 < len(self.buckets) and not recompute:
                for bucket in self._need_buckets[index + 1]:
                    bucket.fetch_weights()
            if index == 0 and not recompute:
                # a micro-batch entering the stage first finishes the previous backward's reductions, so
                # their full gradient buffers never outlive it (gloo's reduce-scatter never reports
                # completion before wait(), so a non-blocking drain alone would keep them to the next step)
                for bucket in self.buckets:
                    bucket.drain(block=True)
        return hook

    def _finish_with_input_gradients(self, index: int, args) -> None:
        """A unit that owns no parameters (a head tied to the embedding) gets no gradient that would end its
        backward: with one input, it ends when that input's gradient is made, which releases the weights it
        borrowed (with several: when the step's backward is flushed)."""
        inputs = [t for t in _flatten_tensors(args) if t.requires_grad]
        if len(inputs) == 1:
            inputs[0].register_hook(lambda grad: self._unit_backward_done(index) if self.buckets[index].in_backward
                                    else None)

    def _make_forward_post(self, index: int):
        def hook(module, args, output):
            if _in_backward():
                return output
            for bucket in self._need_buckets[index]:
                bucket.fwd_holds -= 1
                bucket.maybe_release_weights()
            if not torch.is_grad_enabled():
                return output
            tensors = [t for t in _flatten_tensors(output) if t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, lambda grads: self._backward_begin(index), mode="any")
                node = next((t.grad_fn for t in tensors if t.grad_fn is not None), None)
                if self._splits[index] is not None and node is not None:  # the split unit's one autograd node
                    node.register_hook(lambda grad_inputs, grad_outputs: self._input_half_done(index))
            return output
        return hook

    def _backward_begin(self, index: int) -> None:
        split = self._splits[index]
        deferring = split is not None and split.deferring  # the input half only: no gradient for now
        for bucket in self._need_buckets[index]:
            bucket.fetch_weights()
        self.activations[self.unit_names[index]].prefetch(self.unit_names[index])
        for bucket in self._need_buckets[index]:
            bucket.wait_weights()
            bucket.bwd_holds += 1
        if not deferring:
            # only the unit's own gradients: a weight it shares (a head tied to the embedding) gets its gradient
            # once every use has added to it, in the owner's backward, which opens the owner's buffer then
            self.buckets[index].begin_grads()
        if deferring:
            self._input_only[index] += 1
        self.ctx.record("backward", self.unit_names[index])
        if index > 0:
            for bucket in self._need_buckets[index - 1]:
                bucket.fetch_weights()
            previous = self.unit_names[index - 1]
            self.activations[previous].prefetch(previous)

    def _input_half_done(self, index: int) -> None:
        """A split unit's input half has run: its weights and activation records are let go (its
        weight half holds what it needs)."""
        if self._input_only[index] == 0:
            return  # a whole backward: the gradients release the weights
        self._input_only[index] -= 1
        for needed in self._need_buckets[index]:
            needed.bwd_holds = max(0, needed.bwd_holds - 1)
            needed.maybe_release_weights()
        self.activations[self.unit_names[index]].backward_done(self.unit_names[index])

    def weight_backward(self, unit: str, run: Callable[[], None]) -> None:
        """Run a split unit's deferred weight half (``run``): its weights resident, its gradient
        buffers open; its gradients are reduced as any unit's (ZeRO 0/1 on ``set_last_microbatch``)."""
        index = self.unit_names.index(unit)
        for bucket in self._need_buckets[index]:
            bucket.fetch_weights()
        for bucket in self._need_buckets[index]:
            bucket.wait_weights()
            bucket.bwd_holds += 1
            bucket.begin_grads()
        self.ctx.record("weight_backward", unit)
        self._in_weight_half = index
        try:
            run()
            if self.buckets[index].in_backward:  # a parameter without a gradient: reduce what there is
                self._unit_backward_done(index)
        finally:
            self._in_weight_half = None

    def _make_grad_ready(self, index: int, param_index: int):
        def hook(param):
            bucket = self.buckets[index]
            if not bucket.in_backward and param.grad is bucket.grad_views[param_index]:
                return  # no gradient arrived: autograd runs the hook for a split unit's input half too
            if bucket.note_grad_ready(param_index):
                self._unit_backward_done(index)
        return hook

    def _unit_backward_done(self, index: int) -> None:
        bucket = self.buckets[index]
        # the reductions launched before this one have had a whole unit's backward to finish: wait for
        # them before launching this unit's (one group runs its collectives in order anyway), so their
        # buffers are gone when this one's are made: one reduction in flight at a time, overlapping the
        # next unit's backward (gloo's reduce-scatter never reports completion to a non-blocking check)
        for other_index, other in enumerate(self.buckets):
            if other_index != index:
                other.drain(block=True)
        bucket.reduce(self._last)
        for needed in self._need_buckets[index]:
            needed.bwd_holds = max(0, needed.bwd_holds - 1)
            needed.maybe_release_weights()
        if self._in_weight_half != index:  # a weight half's records went with its input half
            self.activations[self.unit_names[index]].backward_done(self.unit_names[index])
        bucket.drain(block=False)

    def _flush_incomplete(self) -> None:
        """Units whose backward began but some parameter got no gradient: reduce what they have."""
        for index, bucket in enumerate(self.buckets):
            if bucket.in_backward:
                self._unit_backward_done(index)

    # ---- the per-step API -------------------------------------------------------------------
    def begin_iteration(self) -> None:
        """Before the first micro-batch of a training step."""
        for bucket in self.buckets:
            bucket.drain(block=True)
            bucket.reset_holds()
        for offloader in self.activations.values():
            offloader.clear()
        self._last = True

    def set_last_microbatch(self, last: bool) -> None:
        """Call before each micro-batch's backward; ZeRO 0/1 reduce only when ``last``."""
        self._flush_incomplete()
        self._last = bool(last)

    def finish_gradients(self) -> None:
        """Wait for every outstanding gradient reduction (after the last micro-batch's backward)."""
        self._flush_incomplete()
        for bucket in self.buckets:
            bucket.drain(block=True)

    def step(self) -> None:
        """AdamW on the local fp32 master shards, then write the param-dtype weights back."""
        if self.optimizer is None:
            raise StageRuntimeError("step: this runtime has no optimizer (built with optimizer=None: the caller "
                                    "updates the masters, then calls refresh_weights())")
        self.finish_gradients()
        states = [bucket.opt_state for bucket in self.buckets]
        pendings = []
        # each unit is written back as soon as its update is complete, in unit order on every rank
        self.optimizer.step(states, self.buckets, on_unit_done=lambda i: pendings.append(self.buckets[i].write_back()))
        for pending in pendings:
            if pending is not None:
                pending.wait(self.ctx.timeout_s)
        for bucket in self.buckets:  # no forward/backward is in flight: drop every transient weight copy
            bucket.reset_holds()

    def refresh_weights(self) -> None:
        """The masters were updated in place by someone else: drop this step's gradients and write the
        masters into the compute weights (a cast, and the ZeRO gathers), unit by unit."""
        self.finish_gradients()
        pendings = [bucket.write_back() for bucket in self.buckets]
        for pending in pendings:
            if pending is not None:
                pending.wait(self.ctx.timeout_s)
        for bucket in self.buckets:
            bucket.reset_holds()

    def set_loss_scale(self, scale: float) -> None:
        """The loss the backward starts from is multiplied by ``scale`` (fp16 loss scaling): divide the
        gradients by it while casting them for the reduction."""
        self.ctx.grad_unscale = 1.0 / scale

    def reduced_gradients(self) -> list[torch.Tensor]:
        """This rank's reduced fp32 gradient shards (after ``finish_gradients``), device and host parts."""
        return [part for bucket in self.buckets for part in bucket.reduced_parts()]

    def skip_step(self) -> None:
        """Drop this step's gradients without updating anything (a skipped fp16 step)."""
        self.finish_gradients()
        for bucket in self.buckets:
            bucket.drop_gradients()
            bucket.reset_holds()

    def register_grad_transform(self, param_name: str, fn: Callable[[torch.Tensor], None]) -> None:
        """Apply ``fn`` in place to ``param_name``'s local gradient of every micro-batch, before reduction."""
        if param_name not in self._param_index:
            raise StageRuntimeError(f"register_grad_transform: unknown parameter {param_name!r}; "
                                    f"known: {sorted(self._param_index)[:8]}...")
        bucket, index = self._param_index[param_name]
        bucket.transforms.setdefault(index, []).append(fn)

    def activation_offload(self, unit_name: str) -> ContextManager:
        """Saved-tensor hooks offloading the plan's ``acts`` fraction of this unit's activations."""
        if unit_name not in self.activations:
            raise StageRuntimeError(f"activation_offload: unknown unit {unit_name!r}; units: {self.unit_names}")
        offloader = self.activations[unit_name]
        if offloader.fraction <= 0.0:
            return contextlib.nullcontext()
        return offloader.context(unit_name)

    def full_parameter(self, name: str) -> torch.Tensor:
        """One parameter's current full weight: a view of its resident bucket, or (ZeRO-3, offloaded
        weights) a copy of its unit's weights only (a collective over the dp group under ZeRO-3)."""
        if name not in self._param_index:
            raise StageRuntimeError(f"full_parameter: unknown parameter {name!r}")
        bucket, index = self._param_index[name]
        slot = bucket.layout.slots[index]
        flat = bucket.full.tensor if bucket.persistent_full else bucket.full_weights()
        return flat[slot.offset:slot.offset + slot.numel].view(slot.shape)

    def named_full_parameters(self) -> dict[str, torch.Tensor]:
        """Current full weights by qualified name (a collective under ZeRO-3: call on every dp rank)."""
        result: dict[str, torch.Tensor] = {}
        for bucket in self.buckets:
            flat = bucket.full_weights()
            for slot in bucket.layout.slots:
                result[slot.name] = flat[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()
        return result

    def named_full_masters(self) -> dict[str, torch.Tensor]:
        """The fp32 master weights by qualified name, whole over the data-parallel group (a collective
        when they are sharded: call on every dp rank)."""
        result: dict[str, torch.Tensor] = {}
        for bucket in self.buckets:
            local = bucket.master.read(0, bucket.master.numel, self.device, self.streams)
            if self.zero >= 1 and bucket.ctx.world > 1:
                flat = torch.empty(bucket.layout.padded_numel, dtype=torch.float32, device=self.device)
                all_gather_flat(flat, local.contiguous(), bucket.ctx.group,
                                f"all_gather of unit {bucket.unit!r} masters").wait(bucket.ctx.timeout_s)
            else:
                flat = local
            for slot in bucket.layout.slots:
                result[slot.name] = flat[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()
        return result

    def named_full_gradients(self) -> dict[str, torch.Tensor]:
        """The reduced fp32 gradients (after ``finish_gradients``, before ``step``) by qualified name,
        whole over the data-parallel group (a collective when the gradients are sharded)."""
        result: dict[str, torch.Tensor] = {}
        for bucket in self.buckets:
            local = torch.zeros(bucket.master.numel, dtype=torch.float32, device=self.device)
            for window, part in bucket.reduced_grad_views(0, bucket.master.numel):
                local[window].copy_(part)
            if self.zero >= 1 and bucket.ctx.world > 1:
                flat = torch.empty(bucket.layout.padded_numel, dtype=torch.float32, device=self.device)
                all_gather_flat(flat, local, bucket.ctx.group, f"all_gather of unit {bucket.unit!r} gradients").wait(
                    bucket.ctx.timeout_s)
            else:
                flat = local
            for slot in bucket.layout.slots:
                result[slot.name] = flat[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()
        return result

    def state_dict(self) -> dict:
        """Full fp32 master weights and Adam moments of this rank's shards, plus the step count."""
        if self.optimizer is None:
            raise StageRuntimeError("state_dict: this runtime keeps no optimizer state (optimizer=None)")
        return {
            "step": self.optimizer.step_count,
            "units": {
                b.unit: {kind: buffer.read(0, buffer.numel, torch.device("cpu"), self.streams).clone()
                         for kind, buffer in (("master", b.master), ("exp_avg", b.opt_state.exp_avg),
                                              ("exp_avg_sq", b.opt_state.exp_avg_sq))}
                for b in self.buckets
            },
        }

    def load_state_dict(self, state: dict) -> None:
        units = state.get("units", {})
        missing = [b.unit for b in self.buckets if b.unit not in units]
        if missing:
            raise StageRuntimeError(f"load_state_dict: state lacks unit(s) {missing}")
        for bucket in self.buckets:
            for kind, buffer in (("master", bucket.master), ("exp_avg", bucket.opt_state.exp_avg),
                                 ("exp_avg_sq", bucket.opt_state.exp_avg_sq)):
                values = units[bucket.unit][kind]
                if values.numel() != buffer.numel:
                    raise StageRuntimeError(f"load_state_dict: unit {bucket.unit!r} {kind} has {values.numel()} "
                                            f"elements, expected {buffer.numel} (same dp and ZeRO level?)")
                buffer.write(0, values)
        self.optimizer.step_count = int(state["step"])
        pendings = [bucket.write_back() for bucket in self.buckets]
        for pending in pendings:
            if pending is not None:
                pending.wait(self.ctx.timeout_s)

    def memory_report(self) -> dict[str, dict[str, int]]:
        """Device-resident bytes by kind (weights, grads, opt) and host bytes by kind, right now."""
        device: dict[str, int] = {}
        for bucket in self.buckets:
            for kind, nbytes in bucket.memory().items():
                device[kind] = device.get(kind, 0) + nbytes
        return {"device": device, "host": self.host_memory.bytes_by_kind()}


def _flatten_tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _flatten_tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _flatten_tensors(item)]
    return []
