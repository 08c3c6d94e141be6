"""The training engine: a lowered stage program run under a plan, ``engine.step(batch)``.

``Engine(stage, plan, world)`` takes what the driver made before it: this rank's place in the
world (:func:`.world.join_world`: device, process groups) and its lowered stage program
(:func:`mist_compiler.lowering.lower.lower`, modules holding only this rank's weights, made unit by
unit as the runtime lays them out). Set-up reads top to bottom in the order it happens: wrap the
stage's units in the per-stage data-parallel runtime (ZeRO, offload, AdamW), tie embedding/head
gradients across stages, link the pipeline neighbours. On a CPU device the process keeps freed
host memory for reuse (:mod:`.host_allocator`).

``step(batch)`` runs one training iteration: every rank is given the same global batch and takes
its own rows; the stage runs its actions of the plan's pipeline schedule (``ir/schedule.py``;
``set_schedule`` may pick another with the same placement) over ``grad_accum`` micro-batches and
its chunks (virtual stages), each loss scaled by ``1/G`` (the runtime averages over
data-parallel ranks), then the optimizer steps. A ``B`` action runs a chunk's whole backward; an
``I`` action its input-gradient half, the split units queueing their weight halves, which the
chunk's ``W`` action of the same micro-batch runs.
It returns the mean loss of the global batch, the same on every rank.

``forward_backward`` and ``optimizer_step`` are the two halves (the ``torch.compile`` runtime
and ``--check`` use them).

Failures (:class:`.failure.FailureMonitor`): every collective and transfer has a timeout; a rank that
fails writes the reason to the rendezvous store and every other rank stops within a heartbeat,
naming it; a rank that dies is found by its stale heartbeat and named the same way.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..ir.model_graph import DROPOUT_SEEDS, ShardSpec
from ..ir.plan import Plan, PlanError
from ..ir.schedule import F, I, W, build_schedule, placement, schedule_problem
from ..ir.vocabulary import TORCH_DTYPES
from ..lowering.compile import CompileStats
from ..lowering.materialize import StageProgram
from ..lowering.split_backward import WeightGradQueue
from ..ops.dropout import sample_seeds
from .failure import HEARTBEAT_S, FailureMonitor, is_transfer_error
from .host_allocator import keep_freed_host_memory
from .loss_scaling import loss_scaler_for
from .optimizer import AdamWConfig
from .pipeline import P2P
from .saved_activations import install_saved_activations
from .unit_hooks import around_forward
from .stage_runtime import StageRuntime
from .tied_weights import TiedWeights
from .world import DEFAULT_TIMEOUT_S, RankWorld

__all__ = ["DEFAULT_TIMEOUT_S", "EXTERNAL_OPTIMIZER", "BatchError", "Engine", "RankFailure"]


class RankFailure(RuntimeError):
    """Another rank failed (or this one could not reach it) during a step."""


class BatchError(ValueError):
    """A batch that does not match the plan."""


EXTERNAL_OPTIMIZER = "external"  # Engine(optimizer=...): the caller's optimizer updates the fp32 masters in place


@dataclass
class StepState:
    """Per-iteration bookkeeping of one stage."""

    inputs: dict[tuple[int, int], list[torch.Tensor]]  # (chunk, micro) -> what its forward received
    outputs: dict[tuple[int, int], Any]
    loss_sum: torch.Tensor
    weights: list[float]  # per micro-batch: its share of the global batch's counted labels (frontend.labels)


class Engine:
    """Executes a Plan on this rank; see the module docstring."""

    def __init__(self, stage: StageProgram, plan: Plan, world: RankWorld, *,
                 optimizer: AdamWConfig | str | None = None) -> None:
        self.plan = plan
        self.world_info = world
        self.timeout_s = world.timeout_s
        self.topology, self.device, self.groups = world.topology, world.device, world.groups
        self.rank, self.world, self.coord = world.rank, world.size, world.coord
        self.stage_plan = world.stage
        self.program = stage
        self.source_model: nn.Module | None = None  # set by the torch.compile runtime
        self.loss_scaler = loss_scaler_for(plan.dtype)  # fp16 only: dynamic loss scaling, overflowing steps skipped
        self._skip_next_step = False
        self.dropout_seed, self.dropout_step = 0, 0  # dropout masks of step k: ops.dropout.sample_seeds(seed, k, ...)
        self.monitor = FailureMonitor(self.rank, self.world, self.timeout_s)
        self.labels = stage.labels  # how the model reads its labels (frontend.labels): loss weights by label count
        self.tied_names = stage.tied
        # lowering.compile: what compiling the units cost so far (eager when the stage was lowered without it)
        self.compile_stats = stage.compile_stats or CompileStats(enabled=False, eager_units=len(stage.units))
        self.tied = TiedWeights.create(self) if self.tied_names else None
        if self.tied is not None:
            for param in self.tied.params.values():
                stage.materialize(param)
        units = stage.units
        self.offload_table = {name: stage.offload[name] for name, _ in units}
        self.runtime = StageRuntime(
            units, dp_group=self.groups.dp, zero=self.stage_plan.zero, offload=self.offload_table,
            optimizer=None if optimizer == EXTERNAL_OPTIMIZER else optimizer or AdamWConfig(), device=self.device,
            param_dtype=TORCH_DTYPES[plan.dtype], timeout_s=self.timeout_s, grad_dtype=TORCH_DTYPES[plan.grad_dtype],
            exclude=frozenset(self.tied.params.values()) if self.tied is not None else frozenset(),
            initial=stage.initial_value,
        )
        self._offload_hooks = install_activation_offload(self.runtime, units, self.offload_table,
                                                         checkpointed=stage.checkpointed | set(stage.saved))
        self._offload_hooks += install_saved_activations(self.runtime, units, stage.saved)  # per-tensor choices
        if self.tied is not None:
            self.tied.attach(self.runtime)
        self.interface = stage.interface
        self.chunks = stage.chunk_programs  # the virtual stages this rank runs, in pipeline order
        # the batch inputs any of this rank's chunks reads
        self.batch_inputs = list(dict.fromkeys(name for c in self.chunks for name in c.interface.batch_inputs))
        self.weight_grads = stage.weight_grads if stage.weight_grads is not None else WeightGradQueue()
        # activations travel in the plan's dtype (the runtime casts the weights to it)
        dtype = TORCH_DTYPES[plan.dtype]
        self._boundaries = [(_in_dtype(c.interface.inputs, dtype), _in_dtype(c.interface.outputs, dtype))
                            for c in self.chunks]
        self.set_schedule(plan.schedule)
        if self.device.type == "cpu":
            # from now on large per-step tensors reuse freed memory instead of page-faulting it in again
            # (not before: start-up's transients would fragment a heap that never returns memory)
            keep_freed_host_memory()
        # The next stage sends dp_next * dL/dx (its loss share is averaged over its own dp ranks);
        # this stage's data-parallel mean needs dp_here * dL/dx.
        self.grad_scale = [1.0 if c.interface.is_last else self.stage_plan.dp / plan.stages[c.interface.stage + 1].dp
                           for c in self.chunks]

    def set_schedule(self, name: str) -> None:
        """Use pipeline schedule ``name`` (``ir.schedule.SCHEDULES``; the plan's by default) from the
        next step on; it must place the virtual stages as the plan does. Every rank must choose the same.
        A schedule that splits backward on a program lowered without split units runs each unit's
        whole backward in its input half (its weight halves have nothing to do)."""
        plan = self.plan
        problem = schedule_problem(name, plan.pp, plan.virtual_stages, plan.grad_accum)
        if problem is not None:
            raise PlanError(f"plan field {problem[0]}: {problem[1]}")
        if placement(name, plan.pp, plan.virtual_stages) != plan.placement:
            raise PlanError(f"schedule {name!r} places the virtual stages differently from the plan's {plan.schedule!r}")
        self.schedule = build_schedule(name, plan.pp, plan.virtual_stages, plan.grad_accum)
        self.actions = self.schedule.compute(self.coord.stage)
        self.p2p = P2P(self.topology, self.rank, self.schedule, self._boundaries, self.stage_plan.micro_batch,
                       self.device, self.timeout_s, channels=self.groups.channels)

    # ----------------------------------------------------------------- the step
    def step(self, batch: dict[str, torch.Tensor]) -> float:
        """One training step (forward, backward, optimizer) on the global batch; its mean loss."""
        loss = self.forward_backward(batch)
        self.optimizer_step()
        return loss

    def forward_backward(self, batch: dict[str, torch.Tensor]) -> float:
        """The micro-batch schedule (forward and backward); gradients are reduced, not yet applied."""
        with math_attention_in_compute_dtype():
            return self._guarded(self._forward_backward, batch)

    def optimizer_step(self) -> None:
        """Apply the reduced gradients (AdamW) and sync tied weights."""
        self._guarded(self._optimizer_step)

    def skip_optimizer_step(self) -> None:
        """Drop this step's reduced gradients without updating anything (a diverged step). Every rank
        must make the same choice (call it instead of ``optimizer_step``)."""
        self._skip_next_step = False
        self._guarded(self.runtime.skip_step)

    @property
    def overflowed(self) -> bool:
        """fp16: this step's gradients overflowed, so ``optimizer_step`` will skip it (the loss scaler's rule)."""
        return self._skip_next_step

    def set_optimizer(self, config: Any) -> None:
        """Use these AdamW settings from the next update on (a learning-rate schedule changes them)."""
        self.runtime.optimizer.config = config

    def _guarded(self, fn: Callable, *args: Any) -> Any:
        try:
            return fn(*args)
        except (BatchError, PlanError):
            raise
        except Exception as error:
            raise self._failure(error) from error

    def _failure(self, error: Exception) -> RankFailure:
        """Record why this rank stops and build the message naming the rank at fault."""
        what = f"{type(error).__name__}: {error}"
        if self.world == 1:
            return RankFailure(f"rank {self.rank} stopped the step: {what}")
        if not is_transfer_error(error):
            self.monitor.stop()
            self.monitor.report_failure(what)
            if self.rank == 0:  # often the rendezvous store's host: let the others read the reason
                time.sleep(3 * HEARTBEAT_S)
            return RankFailure(f"rank {self.rank} (stage {self.coord.stage}) failed: {what}")
        found = self.monitor.find_failed_rank()
        if found is None:
            return RankFailure(f"rank {self.rank} (stage {self.coord.stage}) lost contact with its peers and no rank "
                               f"reported a failure: {what}")
        rank, reason = found
        self.monitor.stop()
        self.monitor.report_failure(reason, rank=rank)
        if self.rank == 0:
            time.sleep(3 * HEARTBEAT_S)
        return RankFailure(f"rank {self.rank} (stage {self.coord.stage}) stops because rank {rank} failed: {reason} "
                           f"(here: {what})")

    def _stage_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's rows of every micro-batch, on the device in one (pinned, asynchronous) copy per
        input; micro-batch ``m`` is rows ``[m * mb, (m + 1) * mb)``."""
        ranges = [self.topology.sample_range(self.coord.stage, self.coord.dp_index, m) for m in range(self.plan.grad_accum)]
        rows = torch.cat([torch.arange(start, end) for start, end in ranges])
        staged = {}
        for name in self.batch_inputs:
            mine = batch[name].index_select(0, rows.to(batch[name].device))
            if self.device.type == "cuda" and mine.device.type == "cpu":
                mine = mine.pin_memory()
            staged[name] = mine.to(self.device, non_blocking=True)
        return staged

    def _micro_inputs(self, staged: dict[str, torch.Tensor], micro: int, names: list[str]) -> dict[str, torch.Tensor]:
        mb = self.stage_plan.micro_batch
        return {name: staged[name][micro * mb:(micro + 1) * mb] for name in names}


    def _check_batch(self, batch: dict[str, torch.Tensor]) -> None:
        for name in self.batch_inputs:
            if name not in batch:
                raise BatchError(f"batch has no {name!r}; the model needs {self.batch_inputs}")
            if batch[name].shape[0] != self.plan.global_batch:
                raise BatchError(f"batch[{name!r}] has {batch[name].shape[0]} samples but the plan's global_batch is "
                                 f"{self.plan.global_batch}")

    def _with_dropout_seeds(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch with this step's per-sample dropout seeds (the whole global batch's: each rank
        takes its rows like any input), when the stage has dropout sites; every stage counts steps."""
        step, self.dropout_step = self.dropout_step, self.dropout_step + 1
        if DROPOUT_SEEDS not in self.batch_inputs or DROPOUT_SEEDS in batch:
            return batch
        return {**batch, DROPOUT_SEEDS: sample_seeds(self.dropout_seed, step, torch.arange(self.plan.global_batch))}

    def _forward_backward(self, batch: dict[str, torch.Tensor]) -> float:
        batch = self._with_dropout_seeds(batch)
        self._check_batch(batch)
        grad_accum = self.plan.grad_accum
        state = StepState({}, {}, torch.zeros((), dtype=torch.float64, device=self.device), self._weights(batch))
        batch = self._stage_batch(batch)
        self.runtime.begin_iteration()
        if self.loss_scaler is not None:
            self.runtime.set_loss_scale(self.loss_scaler.scale)
        if self.tied is not None:
            self.tied.begin_iteration()
        if self.weight_grads is not None:
            self.weight_grads.clear()
        for position, action in enumerate(self.actions):
            self.p2p.exchange(position)  # the previous action's sends and this one's receives, in one batch
            if action.kind == F:
                self._forward(batch, action.chunk, action.micro, state)
                continue
            last = action.micro == grad_accum - 1  # each chunk runs its backwards in micro-batch order
            self.runtime.set_last_microbatch(last)
            if self.tied is not None:
                self.tied.last_backward = last and self.chunks[action.chunk].interface.is_first
            if action.kind == W:
                self._weight_halves(action.chunk, action.micro)
            else:
                self.weight_grads.defer, self.weight_grads.key = action.kind == I, (action.chunk, action.micro)
                try:
                    self._backward(action.chunk, action.micro, state, grad_accum)
                finally:
                    self.weight_grads.defer = False
        self.p2p.exchange(len(self.actions))  # the last action's sends (before any collective that waits on them)
        if self.tied is not None:
            self.tied.after_backward()
        self.runtime.finish_gradients()
        self.p2p.wait_sends()
        return self._step_outcome(state.loss_sum)

    def _weight_halves(self, chunk: int, micro: int) -> None:
        """A ``W`` action: the weight halves its input halves queued, each dropped (with the values it
        kept from the input half) once it has run, as a whole backward frees a unit's saved tensors."""
        queued = self.weight_grads.take((chunk, micro))
        while queued:
            unit, run = queued.pop(0)
            self.runtime.weight_backward(unit, run)
            del run

    def _weights(self, batch: dict[str, torch.Tensor]) -> list[float]:
        """This rank's micro-batch loss weights (1.0 but where rows count different numbers of labels)."""
        if not any(c.interface.is_last for c in self.chunks) or "labels" not in batch:
            return [1.0] * self.plan.grad_accum
        shares = [self.topology.sample_range(self.coord.stage, self.coord.dp_index, m)
                  for m in range(self.plan.grad_accum)]
        return self.labels.share_weights(batch["labels"], shares, self.plan.grad_accum * self.stage_plan.dp)

    def _optimizer_step(self) -> None:
        if self._skip_next_step:  # fp16 gradients overflowed somewhere: every rank skips (the scale backed off)
            self._skip_next_step = False
            self.runtime.skip_step()
            return
        self.runtime.step()
        if self.tied is not None:
            self.tied.after_step()

    def _forward(self, batch: dict[str, torch.Tensor], chunk: int, micro: int, state: StepState) -> None:
        program = self.chunks[chunk]
        interface = program.interface
        received = self.p2p.recv_forward(chunk, micro) if not interface.is_first else []
        out = program.module(*received, **self._micro_inputs(batch, micro, interface.batch_inputs))
        state.inputs[(chunk, micro)] = received
        if interface.is_last:
            state.loss_sum += out.detach() * state.weights[micro]  # on the device: one host sync per step
            state.outputs[(chunk, micro)] = out
        else:
            outputs = list(out)
            self.p2p.send_forward(chunk, outputs, micro)
            state.outputs[(chunk, micro)] = outputs

    def _backward(self, chunk: int, micro: int, state: StepState, grad_accum: int) -> None:
        """A chunk's backward of one micro-batch (``B``), or its input half (``I``: the weight
        halves of split units are queued meanwhile)."""
        interface = self.chunks[chunk].interface
        outputs = state.outputs.pop((chunk, micro))
        if interface.is_last:
            weight = state.weights[micro]
            loss = outputs / grad_accum if weight == 1.0 else outputs * (weight / grad_accum)
            (loss * self.loss_scaler.scale if self.loss_scaler is not None else loss).backward()
        else:
            grads = self.p2p.recv_backward(chunk, micro)
            scale = self.grad_scale[chunk]
            if scale != 1.0:
                grads = [g.mul_(scale) if g is not None else None for g in grads]
            pairs = [(o, g) for o, g, v in zip(outputs, grads, interface.outputs)
                     if v.needs_grad and g is not None and o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        inputs = state.inputs.pop((chunk, micro))
        if not interface.is_first:
            grads = [t.grad if t.grad is not None else torch.zeros_like(t) if v.needs_grad else None
                     for t, v in zip(inputs, interface.inputs)]
            self.p2p.send_backward(chunk, grads, micro)

    def _step_outcome(self, loss_sum: torch.Tensor) -> float:
        """The global batch's mean loss on every rank, and (fp16) whether any rank's gradients overflowed:
        one all-reduce of both and the step's only host sync."""
        found = (self.loss_scaler.found_nonfinite(self.runtime.reduced_gradients(), self.device)
                 if self.loss_scaler is not None else torch.zeros((), device=self.device))
        holds_loss = any(c.interface.is_last for c in self.chunks)
        total = torch.stack([loss_sum.double() if holds_loss else torch.zeros_like(loss_sum, dtype=torch.float64),
                             found.double()])
        if self.world > 1:
            dist.all_reduce(total)
        loss, overflow = total.tolist()
        self._skip_next_step = self.loss_scaler.update(overflow > 0) if self.loss_scaler is not None else False
        last = self.plan.stages[-1]
        return loss / (self.plan.grad_accum * last.dp * last.tp)

    # ----------------------------------------------------------------- checks
    def named_full_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameters, unsharded over data parallelism (names as in the stage program)."""
        params = dict(self.runtime.named_full_parameters())
        if self.tied is not None:
            params.update(self.tied.local_parameters())
        return params

    def gather_full_state(self, dst: int = 0) -> dict[str, torch.Tensor] | None:
        """The whole model's parameters (unsharded, fp32, CPU) on rank ``dst``, named as in the model;
        None elsewhere. Collective: every rank must call it."""
        return self._gather_to(self.named_full_parameters(), dst)  # a collective under ZeRO-3

    def gather_full_masters(self, dst: int | None = 0) -> dict[str, torch.Tensor] | None:
        """The whole model's fp32 master weights (the values ``gather_full_state`` rounds to the plan's
        dtype), named as in the model, on rank ``dst`` (every rank when None). Collective."""
        masters = dict(self.runtime.named_full_masters())
        if self.tied is not None:
            masters.update({name: value.float() for name, value in self.tied.local_parameters().items()})
        return self._gather_to(masters, dst)

    def gather_full_gradients(self, dst: int | None = 0) -> dict[str, torch.Tensor] | None:
        """The gradients after this step's reductions, before the optimizer (call between
        ``forward_backward`` and ``optimizer_step``), whole and named as in the model, on rank
        ``dst``. A weight tied across stages is reported by the stage that updates it."""
        return self._gather_to(self.runtime.named_full_gradients(), dst)

    def _gather_to(self, local: dict[str, torch.Tensor], dst: int | None) -> dict[str, torch.Tensor] | None:
        """Collect per-rank tensors on ``dst`` (every rank when None): tensor-parallel slices put back
        together (fused projections part by part), data-parallel replicas taken from dp index 0."""
        mine = None
        if self.coord.dp_index == 0:
            tensors = {self.program.fqn.get(name, name): (tensor.detach().float().cpu(), self.program.shards.get(name))
                       for name, tensor in local.items()}
            mine = (self.coord.tp_index, self.stage_plan.tp, tensors)
        gathered: list[Any] = [None] * self.world if dst is None or self.rank == dst else None
        if self.world == 1:
            gathered = [mine]
        elif dst is None:
            dist.all_gather_object(gathered, mine)
        else:
            dist.gather_object(mine, gathered, dst=dst)
        if dst is not None and self.rank != dst:
            return None
        pieces: dict[str, dict[int, tuple[torch.Tensor, ShardSpec | None, int]]] = {}
        for item in gathered:
            if item is None:
                continue
            tp_index, degree, tensors = item
            for name, (tensor, spec) in tensors.items():
                pieces.setdefault(name, {})[tp_index] = (tensor, spec, degree)
        return {name: unshard(by_tp) for name, by_tp in pieces.items()}

    def close(self) -> None:
        self.monitor.stop()
        for handle in self._offload_hooks:
            handle.remove()
        remove = getattr(self.runtime, "remove_hooks", None)
        if remove is not None:
            remove()


@contextlib.contextmanager
def math_attention_in_compute_dtype():
    """Within the block, torch's math attention kernel keeps fp16/bf16 inputs in their dtype, as the
    memory model prices it (and as torch did before 2.5, when Mist measured its runtime). By default
    it copies q, k and v to fp32 and keeps fp32 scores and probabilities: twice the bytes of the
    ``b*h*s*s`` tensors a recomputed or stored attention holds. The switch is process-wide
    (autograd's device threads read it during backward), so it is restored on the way out."""
    flag = getattr(torch.backends.cuda, "allow_fp16_bf16_reduction_math_sdp", None)
    if flag is None:
        yield
        return
    before = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    flag(True)
    try:
        yield
    finally:
        flag(before)


def _in_dtype(values: list, dtype: torch.dtype) -> list:
    from dataclasses import replace

    return [replace(v, dtype=dtype) if v.dtype.is_floating_point else v for v in values]


def install_activation_offload(runtime: Any, units: list[tuple[str, nn.Module]], table: dict[str, Any],
                               checkpointed: set[str]) -> list[Any]:
    """Enter ``runtime.activation_offload(unit)`` around each offloading unit's forward.

    Checkpointed units keep only their inputs (saved by the checkpoint outside the unit), so they
    have nothing to offload and are skipped.
    """
    return [handle for name, module in units if table[name].acts > 0.0 and name not in checkpointed
            for handle in around_forward(module, lambda args, name=name: runtime.activation_offload(name))]


def unshard(by_tp: dict[int, tuple[torch.Tensor, ShardSpec | None, int]]) -> torch.Tensor:
    """A whole tensor from its tensor-parallel pieces (rank -> (piece, split, degree))."""
    ranks = sorted(by_tp)
    first, spec, degree = by_tp[ranks[0]]
    if spec is None or degree == 1:
        return first
    if len(ranks) != degree:
        raise RuntimeError(f"tensor-parallel pieces of ranks {ranks} do not make up degree {degree}")
    parts = spec.segments or (first.shape[spec.dim] * degree,)
    columns = []
    for index, part in enumerate(parts):
        piece = part // degree
        offset = sum(p // degree for p in parts[:index])
        columns += [by_tp[r][0].narrow(spec.dim, offset, piece) for r in ranks]
    return torch.cat(columns, dim=spec.dim)
