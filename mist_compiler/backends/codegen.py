"""Code generation: from a model and a Plan, this rank's stage program and its runtime units.

The lowering is one list of passes run by the :class:`PassManager` (read it in
:func:`lowering_passes`): cut the pipeline stage, shard it over the tensor-parallel group,
checkpoint the first layers, insert activation-offload points. The result is a
:class:`StageProgram`: an fx ``GraphModule`` with its stage interface, and the parameter-holding
modules it calls in execution order (the units the runtime buckets, shards and hooks).
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, Callable

import torch.fx as fx
from torch import nn

from mist_compiler.frontend.layer_stack import find_layer_stack
from mist_compiler.ir.plan import Plan, PlanError, load_plan
from mist_compiler.passes.checkpoint import ActivationCheckpoint
from mist_compiler.passes.manager import PassManager
from mist_compiler.passes.partition import Partition, PartitionError, StageInterface, stage_interface, trace_model
from mist_compiler.passes.tp_sharding import TensorParallel, check_heads_divisible

from .topology import RankCoord


@dataclass
class StageProgram:
    """One rank's lowered program."""

    module: fx.GraphModule
    interface: StageInterface
    units: list[tuple[str, nn.Module]]
    offload: dict[str, Any]  # unit name -> UnitOffload (from the offload-insertion pass)
    checkpointed: set[str]  # units run under activation checkpointing


def check_plan_against_model(plan: Plan, model: nn.Module) -> None:
    """Reject, before any computation, a plan whose layers/heads/sequence do not fit the model."""
    stack = find_layer_stack(model)
    config = getattr(model, "config", None)
    max_seq = getattr(config, "max_seq", None) if config is not None else None
    plan.check_against_model(len(stack), max_seq if isinstance(max_seq, int) else None)
    for index, stage in enumerate(plan.stages):
        if stage.tp > 1 and config is not None:
            check_heads_divisible(config, stage.tp, where=f"plan field stages[{index}].tp")


@dataclass
class OffloadPoints:
    """Runs the offload-insertion pass on the program's units and records the per-unit table
    (``meta["mist_offload"]``) from which the runtime offloads weights, gradients, optimizer
    state and activations."""

    offload: Any
    name: str = "offload_insertion"

    def __call__(self, gm: fx.GraphModule):
        from mist_compiler.passes.manager import PassResult
        from mist_compiler.passes.offload_insertion import OffloadInput, offload_insertion

        units = program_units(gm)
        sizes = tuple((unit, sum(p.numel() for p in module.parameters())) for unit, module in units)
        result = offload_insertion(OffloadInput(sizes, self.offload))
        marked = fx.GraphModule(gm, gm.graph, class_name=type(gm).__name__)
        marked.meta.update(gm.meta)
        marked.meta["mist_offload"] = result.program.per_unit
        return PassResult(marked, result.modified)


def lowering_passes(plan: Plan, coord: RankCoord, tp_group: Any) -> list[Callable]:
    """The lowering pipeline for one rank, in the order it runs."""
    stage = plan.stages[coord.stage]
    passes: list[Callable] = [
        Partition(plan, coord.stage),
        TensorParallel(tp_group, coord.tp_index, stage.tp),
        ActivationCheckpoint(stage.ckpt_layers),
        OffloadPoints(stage.offload),
    ]
    return passes


def program_units(gm: fx.GraphModule) -> list[tuple[str, nn.Module]]:
    """Parameter-holding modules the program calls (or checkpoints), in execution order."""
    units: list[tuple[str, nn.Module]] = []
    seen: set[str] = set()
    for node in gm.graph.nodes:
        if node.op not in ("call_module", "get_attr") or node.target in seen:
            continue
        try:
            module = gm.get_submodule(node.target)
        except AttributeError:
            if node.op == "get_attr" and isinstance(getattr_path(gm, node.target), nn.Parameter):
                raise PlanError(f"parameter {node.target} is read outside any module; the runtime shards parameters by module")
            continue
        if any(True for _ in module.parameters()):
            units.append((node.target, module))
            seen.add(node.target)
    return units


def getattr_path(module: nn.Module, target: str) -> Any:
    value: Any = module
    for part in target.split("."):
        value = getattr(value, part)
    return value


class WholeModel(nn.Module):
    """A model fx cannot trace, run as it is (plans of one stage, no TP, no checkpointing)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        output = self.model(input_ids=input_ids, labels=labels)
        return output.loss if hasattr(output, "loss") else output


def whole_model_program(model: nn.Module, plan: Plan, reason: Exception) -> StageProgram:
    """The fallback when tracing fails: the module runs whole; its top-level children are the units."""
    from mist_compiler.passes.offload_insertion import OffloadInput, offload_insertion

    stage = plan.stages[0]
    if plan.pp > 1 or stage.tp > 1 or stage.ckpt_layers > 0:
        raise PartitionError(f"{reason}; pipeline, tensor parallelism and checkpointing need a traceable model "
                             f"(plan has {plan.pp} stage(s), tp={stage.tp}, ckpt_layers={stage.ckpt_layers})")
    units = [(name, child) for name, child in model.named_children() if any(True for _ in child.parameters())]
    sizes = tuple((name, sum(p.numel() for p in child.parameters())) for name, child in units)
    table = offload_insertion(OffloadInput(sizes, stage.offload)).program.per_unit
    interface = StageInterface(stage=0, num_stages=1, inputs=[], batch_inputs=["input_ids", "labels"], outputs=[])
    return StageProgram(WholeModel(model), interface, units, table, set())


def lower(model: nn.Module, plan: Plan, coord: RankCoord, tp_group: Any, *,
          print_after: tuple[str, ...] = (), on_dump: Callable[[str, Any], None] | None = None) -> StageProgram:
    """Run the lowering passes for one rank and return its stage program."""
    check_plan_against_model(plan, model)
    try:
        traced = trace_model(model)
    except PartitionError as error:
        return whole_model_program(model, plan, error)
    manager = PassManager(lowering_passes(plan, coord, tp_group), print_after=print_after, on_dump=on_dump)
    gm = manager(traced).program
    return StageProgram(gm, stage_interface(gm), program_units(gm), gm.meta["mist_offload"],
                        set(gm.meta.get("mist_checkpointed", ())))


def lowering_pass_names() -> list[str]:
    return ["partition", "tp_sharding", "checkpoint", "offload_insertion"]


def dump_lowered(model_name: str, plan_path: str, after: str) -> str:
    """The program of every stage (tensor-parallel index 0) right after the pass ``after``.

    No process group is needed: tensor-parallel collectives are printed, never run.
    """
    from mist_compiler.models import build_model

    import torch

    plan = load_plan(plan_path)
    with torch.device("meta"):  # shapes only: no weights are allocated, any model size dumps fast
        model = build_model(model_name, seq_len=plan.seq_len)
    out = io.StringIO()
    for stage_index in range(plan.pp):
        coord = RankCoord(stage_index, 0, 0)
        dumps: list[str] = []

        def on_dump(name: str, program: Any) -> None:
            dumps.append(_describe(name, program))

        names = [getattr(p, "name", "") for p in lowering_passes(plan, coord, None)]
        if after not in names:
            raise PlanError(f"unknown pass {after!r}; lowering passes are: {', '.join(names)}")
        lower(model, plan, coord, None, print_after=(after,), on_dump=on_dump)
        stage = plan.stages[stage_index]
        out.write(f"# stage {stage_index}: layers [{stage.layers[0]}, {stage.layers[1]}), dp={stage.dp} tp={stage.tp} "
                  f"zero={stage.zero} ckpt_layers={stage.ckpt_layers} (after {after})\n")
        out.write("".join(dumps))
    return out.getvalue()


def _describe(name: str, program: Any) -> str:
    if not isinstance(program, fx.GraphModule):
        return f"{program}\n"
    interface = program.meta.get("mist_stage")
    lines = []
    if interface is not None:
        lines.append(f"# receives {[v.name for v in interface.inputs]} + batch {interface.batch_inputs}; "
                     f"sends {[v.name for v in interface.outputs]}")
    lines.append(program.code.strip())
    offload = program.meta.get("mist_offload", {})
    for target, module in program_units(program):
        shapes = ", ".join(f"{n}{list(p.shape)}" for n, p in module.named_parameters())
        extra = f"  offload {offload[target]}" if target in offload else ""
        lines.append(f"#   unit {target}: {type(module).__name__} {shapes}{extra}")
    return "\n".join(lines) + "\n\n"
