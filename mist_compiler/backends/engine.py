"""The training engine: ``mist_compiler.compile(model, plan) -> Engine`` and ``engine.step(batch)``.

Set-up reads top to bottom in the order it happens: check the plan against the launched world
and the model (before any computation), build the process groups, lower this rank's stage
program (:mod:`.codegen`), wrap its units in the per-stage data-parallel runtime (ZeRO, offload,
AdamW), tie embedding/head gradients across stages, link the pipeline neighbours. On a CPU
device the process keeps freed host memory for reuse (:mod:`.host_allocator`).

``step(batch)`` runs one training iteration: every rank is given the same global batch and takes
its own rows; the stage runs the 1F1B schedule over ``grad_accum`` micro-batches, each loss
scaled by ``1/G`` (the runtime averages over data-parallel ranks), then the optimizer steps.
It returns the mean loss of the global batch, the same on every rank.

``forward_backward`` and ``optimizer_step`` are the two halves (the dynamo runtime uses them).

Failures (:class:`FailureMonitor`): every collective and transfer has a timeout; a rank that
fails writes the reason to the rendezvous store and every other rank stops within a heartbeat,
naming it; a rank that dies is found by its stale heartbeat and named the same way.
"""
from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from mist_compiler.ir.plan import Plan, PlanError, load_plan

from .codegen import StageProgram, check_plan_against_model, lower
from .host_allocator import keep_freed_host_memory
from .tensor_parallel import shard_dims
from .pipeline import BACKWARD, FORWARD, P2P, build_links, one_f_one_b
from .topology import ProcessGroups, Topology, build_groups

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_TIMEOUT_S = 300.0
HEARTBEAT_S = 1.0


class RankFailure(RuntimeError):
    """Another rank failed (or this one could not reach it) during a step."""


class BatchError(ValueError):
    """A batch that does not match the plan."""


def _default_runtime_factory() -> Callable[..., Any]:
    from .stage_runtime import StageRuntime

    return StageRuntime


def _default_optimizer() -> Any:
    from .stage_runtime import AdamWConfig

    return AdamWConfig()


class FailureMonitor:
    """Fail fast, and say who failed, through the rendezvous store.

    Every rank writes a heartbeat each second. A rank whose step fails for a reason of its own
    (not a broken transfer) writes ``mist/failed/<rank>``; every other rank's monitor sees that key
    within a heartbeat, prints the reason and exits non-zero (``on_peer_failure``): nobody waits
    for a collective that can never complete. A rank whose step fails because a peer vanished
    (transfer error or timeout) looks for a rank whose heartbeat went stale and reports it on
    that rank's behalf, so the survivors all name the dead rank.
    """

    def __init__(self, rank: int, world: int, timeout_s: float,
                 on_peer_failure: Callable[[str], None] | None = None) -> None:
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.on_peer_failure = on_peer_failure or (lambda message: _exit_on_peer_failure(message, rank))
        self.store = _default_store()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.store is not None and world > 1:
            self._beat()
            self._thread = threading.Thread(target=self._run, name="mist-heartbeat", daemon=True)
            self._thread.start()

    def _key(self, kind: str, rank: int) -> str:
        return f"mist/{kind}/{rank}"

    def _beat(self) -> None:
        self.store.set(self._key("heartbeat", self.rank), repr(time.time()))

    def _run(self) -> None:
        others = [r for r in range(self.world) if r != self.rank]
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._beat()
                for rank in others:
                    if self.store.check([self._key("failed", rank)]):
                        reason = self.store.get(self._key("failed", rank)).decode(errors="replace")
                        if not self._stop.is_set():
                            self.on_peer_failure(f"mist: rank {self.rank} stops because rank {rank} failed: {reason}")
                        return
            except Exception:  # the store itself is gone: the main thread's timeouts take over
                return

    def report_failure(self, message: str, rank: int | None = None) -> None:
        if self.store is None:
            return
        try:
            self.store.set(self._key("failed", self.rank if rank is None else rank), message[:2000])
        except Exception:
            pass

    def find_failed_rank(self, patience_s: float = 6 * HEARTBEAT_S) -> tuple[int, str] | None:
        """A rank that reported a failure or whose heartbeat went stale (waits up to ``patience_s``)."""
        if self.store is None:
            return None
        deadline = time.time() + min(patience_s, self.timeout_s)
        while True:
            try:
                found = self._scan()
            except Exception:
                return None
            if found is not None or time.time() > deadline:
                return found
            time.sleep(HEARTBEAT_S / 2)

    def _scan(self) -> tuple[int, str] | None:
        now = time.time()
        for rank in range(self.world):
            if rank == self.rank:
                continue
            if self.store.check([self._key("failed", rank)]):
                return rank, self.store.get(self._key("failed", rank)).decode(errors="replace")
            if not self.store.check([self._key("heartbeat", rank)]):
                return rank, "never started"
            if now - float(self.store.get(self._key("heartbeat", rank)).decode()) > 4 * HEARTBEAT_S:
                return rank, "stopped responding (process died or hung)"
        return None

    def stop(self) -> None:
        self._stop.set()


def _exit_on_peer_failure(message: str, rank: int) -> None:
    print(message, file=sys.stderr, flush=True)
    if rank == 0:
        # rank 0 often hosts the rendezvous store: keep it up a moment for the others to read
        time.sleep(3 * HEARTBEAT_S)
    os._exit(1)


def is_transfer_error(error: BaseException) -> bool:
    """A failure to talk to a peer (timeout, closed connection), as opposed to a failure of our own."""
    text = f"{type(error).__name__}: {error}".lower()
    markers = ("timed out", "timeout", "connection", "closed by peer", "collectiveerror", "pipelinetimeout",
               "distbackenderror", "broken pipe", "gloo")
    return any(marker in text for marker in markers)


def _default_store() -> Any:
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:
        return None


@dataclass
class StepState:
    """Per-iteration bookkeeping of one stage."""

    inputs: dict[int, list[torch.Tensor]]
    outputs: dict[int, Any]
    loss_sum: torch.Tensor


class Engine:
    """Executes a Plan on this rank; see the module docstring."""

    def __init__(self, model: nn.Module, plan: Plan, *, optimizer: Any = None, device: torch.device | str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, runtime_factory: Callable[..., Any] | None = None) -> None:
        self.plan = plan
        self.timeout_s = timeout_s
        self.source_model: nn.Module | None = None  # set by the dynamo runtime
        self._step_pending = False
        self.topology = Topology(plan)
        _ensure_process_group(timeout_s)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.topology.check_world_size(self.world)
        check_plan_against_model(plan, model)
        self.monitor = FailureMonitor(self.rank, self.world, timeout_s)
        self.coord = self.topology.coord(self.rank)
        self.stage_plan = plan.stages[self.coord.stage]
        self.device = torch.device(device) if device is not None else _default_device()
        if self.device.type == "cpu":
            keep_freed_host_memory()  # large per-step tensors reuse memory instead of page-faulting it in again
        timeout = datetime.timedelta(seconds=timeout_s)
        self.tied_names = _tied_parameter_names(model)
        self.groups: ProcessGroups = build_groups(self.topology, self.rank, tied=bool(self.tied_names), timeout=timeout)
        self.program: StageProgram = lower(model, plan, self.coord, self.groups.tp)
        self.program.module.to(self.device)
        self.tied = TiedWeights.create(self, model) if self.tied_names and plan.pp > 1 else None
        units = [u for u in self.program.units if self.tied is None or u[0] not in self.tied.excluded_units]
        self.offload_table = {name: self.program.offload[name] for name, _ in units}
        factory = runtime_factory or _default_runtime_factory()
        self.runtime = factory(
            units, dp_group=self.groups.dp, zero=self.stage_plan.zero, offload=self.offload_table,
            optimizer=optimizer if optimizer is not None else _default_optimizer(), device=self.device,
            param_dtype=DTYPES[plan.dtype], timeout_s=timeout_s, grad_dtype=DTYPES[plan.grad_dtype],
        )
        self._offload_hooks = install_activation_offload(self.runtime, units, self.offload_table,
                                                         checkpointed=self.program.checkpointed)
        if self.tied is not None:
            self.tied.attach(self.runtime)
        self.interface = self.program.interface
        # activations travel in the plan's dtype (the runtime casts the weights to it)
        inputs, outputs = (_in_dtype(values, DTYPES[plan.dtype]) for values in (self.interface.inputs, self.interface.outputs))
        self.p2p = P2P(build_links(self.topology, self.rank), inputs, outputs,
                       self.stage_plan.micro_batch, self.device, timeout_s)
        self.schedule = one_f_one_b(plan.pp, self.coord.stage, plan.grad_accum)
        # The next stage sends dp_next * dL/dx (its loss share is averaged over its own dp ranks);
        # this stage's data-parallel mean needs dp_here * dL/dx.
        is_last = self.coord.stage == plan.pp - 1
        self.grad_scale = 1.0 if is_last else self.stage_plan.dp / plan.stages[self.coord.stage + 1].dp

    # ----------------------------------------------------------------- the step
    def step(self, batch: dict[str, torch.Tensor]) -> float:
        """One training step (forward, backward, optimizer) on the global batch; its mean loss."""
        loss = self.forward_backward(batch)
        self.optimizer_step()
        return loss

    def forward_backward(self, batch: dict[str, torch.Tensor]) -> float:
        """The micro-batch schedule (forward and backward); gradients are reduced, not yet applied."""
        self.flush_optimizer_step()
        return self._guarded(self._forward_backward, batch)

    def optimizer_step(self) -> None:
        """Apply the reduced gradients (AdamW) and sync tied weights."""
        self._step_pending = False
        self._guarded(self._optimizer_step)

    def request_optimizer_step(self) -> None:
        """Apply the gradients before the next forward or weight read (used from autograd hooks,
        where running collectives and in-place weight updates is not safe)."""
        self._step_pending = True

    def flush_optimizer_step(self) -> None:
        if self._step_pending:
            self.optimizer_step()

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

    def _micro_inputs(self, batch: dict[str, torch.Tensor], micro: int) -> dict[str, torch.Tensor]:
        start, end = self.topology.sample_range(self.coord.stage, self.coord.dp_index, micro)
        return {name: batch[name][start:end].to(self.device, non_blocking=True) for name in self.interface.batch_inputs}

    def _check_batch(self, batch: dict[str, torch.Tensor]) -> None:
        for name in self.interface.batch_inputs:
            if name not in batch:
                raise BatchError(f"batch has no {name!r}; the model needs {self.interface.batch_inputs}")
            if batch[name].shape[0] != self.plan.global_batch:
                raise BatchError(f"batch[{name!r}] has {batch[name].shape[0]} samples but the plan's global_batch is "
                                 f"{self.plan.global_batch}")

    def _forward_backward(self, batch: dict[str, torch.Tensor]) -> float:
        self._check_batch(batch)
        grad_accum = self.plan.grad_accum
        state = StepState({}, {}, torch.zeros((), dtype=torch.float64))
        self.runtime.begin_iteration()
        if self.tied is not None:
            self.tied.begin_iteration()
        backward_done = 0
        for position, (kind, micro) in enumerate(self.schedule):
            self._prefetch(position)
            if kind == FORWARD:
                self._forward(batch, micro, state)
            else:
                backward_done += 1
                last = backward_done == grad_accum
                self.runtime.set_last_microbatch(last)
                if self.tied is not None:
                    self.tied.last_backward = last
                self._backward(micro, state, grad_accum)
        if self.tied is not None:
            self.tied.after_backward()
        self.runtime.finish_gradients()
        self.p2p.wait_sends()
        return self._mean_loss(state.loss_sum)

    def _optimizer_step(self) -> None:
        self.runtime.step()
        if self.tied is not None:
            self.tied.after_step()

    def _prefetch(self, position: int) -> None:
        """Post the receives of the next action's inputs before running this one (overlap)."""
        if position + 1 >= len(self.schedule):
            return
        kind, micro = self.schedule[position + 1]
        if kind == FORWARD and not self.interface.is_first:
            self.p2p.prefetch_forward(micro)
        elif kind == BACKWARD and not self.interface.is_last:
            self.p2p.prefetch_backward(micro)

    def _forward(self, batch: dict[str, torch.Tensor], micro: int, state: StepState) -> None:
        received = self.p2p.recv_forward(micro) if not self.interface.is_first else []
        out = self.program.module(*received, **self._micro_inputs(batch, micro))
        state.inputs[micro] = received
        if self.interface.is_last:
            state.loss_sum += out.detach().double().cpu()
            state.outputs[micro] = out
        else:
            outputs = list(out)
            self.p2p.send_forward(outputs, micro)
            state.outputs[micro] = outputs

    def _backward(self, micro: int, state: StepState, grad_accum: int) -> None:
        outputs = state.outputs.pop(micro)
        if self.interface.is_last:
            (outputs / grad_accum).backward()
        else:
            grads = self.p2p.recv_backward(micro)
            if self.grad_scale != 1.0:
                grads = [g.mul_(self.grad_scale) if g is not None else None for g in grads]
            pairs = [(o, g) for o, g, v in zip(outputs, grads, self.interface.outputs)
                     if v.needs_grad and g is not None and o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        inputs = state.inputs.pop(micro)
        if not self.interface.is_first:
            grads = [t.grad if t.grad is not None else torch.zeros_like(t) if v.needs_grad else None
                     for t, v in zip(inputs, self.interface.inputs)]
            self.p2p.send_backward(grads, micro)

    def _mean_loss(self, loss_sum: torch.Tensor) -> float:
        total = loss_sum.clone().to(self.device if self.device.type == "cuda" else "cpu")
        if not self.interface.is_last:
            total.zero_()
        if self.world > 1:
            dist.all_reduce(total)
        last = self.plan.stages[-1]
        return float(total.item() / (self.plan.grad_accum * last.dp * last.tp))

    # ----------------------------------------------------------------- checks
    def named_full_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameters, unsharded over data parallelism (names as in the stage program)."""
        self.flush_optimizer_step()
        params = dict(self.runtime.named_full_parameters())
        if self.tied is not None:
            params.update(self.tied.local_parameters())
        return params

    def gather_full_state(self, dst: int = 0) -> dict[str, torch.Tensor] | None:
        """The whole model's parameters (unsharded, CPU) on rank ``dst``; None elsewhere.

        Collective: every rank must call it. Tensor-parallel slices are concatenated along their
        split dimension; data-parallel replicas are taken from dp index 0.
        """
        self.flush_optimizer_step()
        dims: dict[str, int | None] = {}
        for unit_name, module in self.program.units:
            dims.update(shard_dims(module, unit_name))
        mine = None
        full = self.named_full_parameters()  # a collective under ZeRO-3: every rank takes part
        if self.coord.dp_index == 0:
            params = {name: tensor.detach().float().cpu() for name, tensor in full.items()}
            mine = (self.coord.tp_index, {name: (tensor, dims.get(name)) for name, tensor in params.items()})
        gathered: list[Any] = [None] * self.world if self.rank == dst else None
        if self.world > 1:
            dist.gather_object(mine, gathered, dst=dst)
        else:
            gathered = [mine]
        if self.rank != dst:
            return None
        pieces: dict[str, dict[int, tuple[torch.Tensor, int | None]]] = {}
        for item in gathered:
            if item is None:
                continue
            tp_index, params = item
            for name, (tensor, dim) in params.items():
                pieces.setdefault(name, {})[tp_index] = (tensor, dim)
        state = {}
        for name, by_tp in pieces.items():
            ordered = [by_tp[t] for t in sorted(by_tp)]
            dim = ordered[0][1]
            state[name] = ordered[0][0] if dim is None else torch.cat([t for t, _ in ordered], dim=dim)
        return state

    def close(self) -> None:
        self.monitor.stop()
        for handle in self._offload_hooks:
            handle.remove()
        remove = getattr(self.runtime, "remove_hooks", None)
        if remove is not None:
            remove()


def _in_dtype(values: list, dtype: torch.dtype) -> list:
    from dataclasses import replace

    return [replace(v, dtype=dtype) if v.dtype.is_floating_point else v for v in values]


def install_activation_offload(runtime: Any, units: list[tuple[str, nn.Module]], table: dict[str, Any],
                               checkpointed: set[str]) -> list[Any]:
    """Enter ``runtime.activation_offload(unit)`` around each offloading unit's forward.

    Checkpointed units keep only their inputs (saved by the checkpoint outside the unit), so they
    have nothing to offload and are skipped.
    """
    handles = []
    for name, module in units:
        if table[name].acts <= 0.0 or name in checkpointed:
            continue
        active: list[Any] = []

        def enter(module, args, name=name, active=active):
            if torch.is_grad_enabled():
                context = runtime.activation_offload(name)
                context.__enter__()
                active.append(context)

        def leave(module, args, output, active=active):
            if active:
                active.pop().__exit__(None, None, None)

        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave))
    return handles


class TiedWeights:
    """A weight shared by the first stage (embedding) and the last (head) of a pipeline.

    The first stage owns it (its runtime shards and updates it); the last stage keeps a plain
    copy outside its runtime. Gradients: the last stage accumulates its share over the
    micro-batches and, after its schedule, all-reduces ``sum(h_r) / dp_last`` over the tied group;
    the first stage takes part in that all-reduce from the gradient transform of its *last*
    micro-batch (the last stage is then done with backward, so nobody waits on anybody) and adds
    it to its own gradient. After the step the first stage broadcasts the updated weight.
    """

    def __init__(self, engine: "Engine", names: list[str]) -> None:
        self.engine = engine
        self.names = names  # tied parameter names present in this stage program
        self.is_first = engine.coord.stage == 0
        self.group = engine.groups.tied
        self.source = engine.topology.rank_of(0, 0, engine.coord.tp_index)
        self.last_backward = False
        self.excluded_units: set[str] = set()
        self.params: dict[str, nn.Parameter] = {}
        if not self.is_first:
            for unit_name, module in engine.program.units:
                owned = {f"{unit_name}.{n}" for n, _ in module.named_parameters()}
                tied_here = owned & set(names)
                if tied_here and tied_here != owned:
                    raise PlanError(f"unit {unit_name} mixes tied and untied parameters; cannot pipeline it")
                if tied_here:
                    self.excluded_units.add(unit_name)
                    for n, p in module.named_parameters():
                        self.params[f"{unit_name}.{n}"] = p

    @classmethod
    def create(cls, engine: "Engine", model: nn.Module) -> "TiedWeights | None":
        if engine.coord.stage not in (0, engine.plan.pp - 1):
            return None
        local = {name for name, _ in _unit_parameters(engine.program.units)}
        names = sorted(local & engine.tied_names)
        return cls(engine, names) if names else None

    def attach(self, runtime: Any) -> None:
        if self.is_first:
            for name in self.names:
                runtime.register_grad_transform(name, self._add_last_stage_share)
        else:
            dtype = DTYPES[self.engine.plan.dtype]
            for param in self.params.values():
                param.data = param.data.to(self.engine.device, dtype)

    def begin_iteration(self) -> None:
        for param in self.params.values():
            param.grad = None

    def _add_last_stage_share(self, grad: torch.Tensor) -> None:
        if not self.last_backward:
            return
        share = torch.zeros_like(grad, dtype=torch.float32)
        dist.all_reduce(share, group=self.group)
        grad.add_(share.to(grad.dtype))

    def after_backward(self) -> None:
        if self.is_first:
            return
        dp = self.engine.stage_plan.dp
        for param in self.params.values():
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            share = grad.float() / dp
            dist.all_reduce(share, group=self.group)

    def after_step(self) -> None:
        if self.is_first:
            full = self.engine.runtime.named_full_parameters()
            for name in self.names:
                weight = full[name].contiguous()
                dist.broadcast(weight, src=self.source, group=self.group)
        else:
            for param in self.params.values():
                weight = torch.empty_like(param.data)
                dist.broadcast(weight, src=self.source, group=self.group)
                param.data.copy_(weight)

    def local_parameters(self) -> dict[str, torch.Tensor]:
        return {name: p.detach() for name, p in self.params.items()}


def _unit_parameters(units: list[tuple[str, nn.Module]]):
    for unit_name, module in units:
        for name, param in module.named_parameters():
            yield f"{unit_name}.{name}" if unit_name else name, param


def _tied_parameter_names(model: nn.Module) -> set[str]:
    """Qualified names of parameters registered under more than one name (tied weights)."""
    names_by_id: dict[int, list[str]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            names_by_id.setdefault(id(param), []).append(f"{module_name}.{name}" if module_name else name)
    return {name for names in names_by_id.values() if len(set(names)) > 1 for name in names}


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _ensure_process_group(timeout_s: float) -> None:
    """Use the launched process group, or start a one-rank one for single-process use."""
    if dist.is_initialized():
        return
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=timeout_s))


def compile(model: nn.Module, plan: Plan | str, *, optimizer: Any = None, device: torch.device | str | None = None,
            timeout_s: float = DEFAULT_TIMEOUT_S, runtime_factory: Callable[..., Any] | None = None) -> Engine:
    """Lower ``model`` with ``plan`` (a Plan or a path) for this rank and return its training engine."""
    if isinstance(plan, str):
        plan = load_plan(plan)
    if not isinstance(plan, Plan):
        raise PlanError(f"plan: expected a Plan or a path to a plan file, got {type(plan).__name__}")
    return Engine(model, plan, optimizer=optimizer, device=device, timeout_s=timeout_s, runtime_factory=runtime_factory)
