"""Code generation: from the captured program and a Plan, this rank's stage program.

The lowering is one list of passes run by the :class:`PassManager` (read it in
:func:`lowering_passes`): cut the pipeline stage out of the captured torch-level program, shard
it over the tensor-parallel group (with sequence-parallel edges where the plan says ``sp``), keep or
undo the fused head + loss, checkpoint the first layers, apply the per-tensor keep / recompute /
offload choices to the others, set the units' offload fractions, mark the units whose backward is
split (zero-bubble schedules). Then :func:`~.materialize.build_stage` instantiates the stage's
modules with this rank's weights only (the split units as the two halves of their joint graph,
:mod:`.split_backward`). A rank whose devices run several virtual stages (interleaved and V
schedules) lowers each of them and holds them as the chunks of one :class:`~.materialize.StageProgram`.
"""
from __future__ import annotations

import io
from typing import Any, Callable

import torch
import torch.fx as fx

from ..frontend.labels import label_convention
from ..ir.plan import Plan, PlanError
from ..ir.program import MistProgram
from ..ir.schedule import SCHEDULES
from ..ir.stage import StageGraph
from ..ir.topology import RankCoord
from ..passes.activation_policy import ActivationPolicyInsertion, check_activation_policy
from ..passes.checkpoint import ActivationCheckpoint
from ..passes.loss_kernel import LossKernel
from ..passes.manager import PassManager
from ..passes.offload_insertion import OffloadInsertion
from ..passes.partition import Partition, PartitionError
from ..passes.sequence_parallel import SequenceParallel, check_sequence_parallel
from ..passes.split_backward import SplitBackward
from ..passes.tp_sharding import TensorParallel, check_degree
from .materialize import StageProgram, TensorSource, build_stage, merge_chunks
from .split_backward import WeightGradQueue

LOWERING_PASSES = ("partition", "tp_sharding", "sequence_parallel", "loss_kernel", "checkpoint", "activation_policy",
                   "offload_insertion", "split_backward")


def check_plan_against_program(plan: Plan, program: MistProgram) -> None:
    """Reject, before any computation, a plan that does not fit the captured model: its layer
    count, its sequence length and every stage's tensor-parallel degree."""
    graph = program.model_graph
    if graph is None:
        raise PartitionError(f"{program.model_name}: no list of layers was found in the model, so it cannot be "
                             "cut into pipeline stages or data-parallel units; a model needs its layers in one "
                             "nn.ModuleList")
    plan.check_against_model(graph.num_layers, program.max_positions)
    for index, stage in enumerate(plan.stages):
        check_degree(graph.tp, stage.tp, where=f"plan field stages[{index}].tp")
    check_sequence_parallel(graph, plan)
    check_activation_policy(graph, plan)
    if graph.tied_parameters() and len(plan.stages) > 1 and plan.placement[0] == plan.placement[-1]:
        raise PlanError(f"plan field schedule: {program.model_name} ties its embedding and head, and "
                        f"{plan.schedule!r} with {plan.virtual_stages} virtual stages puts both on the same devices in "
                        f"different virtual stages, which is not supported; use a schedule that places them apart")


def lowering_passes(program: MistProgram, plan: Plan, coord: RankCoord, virtual: int | None = None) -> list[Callable]:
    """The lowering pipeline for one rank's stage (``virtual``: which of its virtual stages, by
    index into ``plan.stages``; default the rank's stage itself), in the order it runs."""
    index = coord.stage if virtual is None else virtual
    stage = plan.stages[index]
    return [
        Partition(plan, index),  # ModelGraph -> StageGraph: this stage's units and boundary
        TensorParallel(program.model_graph, coord.tp_index, stage.tp),  # apply the recognised split
        SequenceParallel(program.model_graph, plan, index),  # TP region edges as sequence collectives
        LossKernel(plan.fused_loss),  # the fused, chunked head + loss, or the plain one
        ActivationCheckpoint(stage.ckpt_layers),  # recompute the first layers in backward
        ActivationPolicyInsertion(stage.activations, stage.sp),  # the other layers: keep / recompute / offload per tensor
        OffloadInsertion(stage.offload),  # each unit's host fractions
        SplitBackward(SCHEDULES[plan.schedule].split_backward),  # input- and weight-gradient halves
    ]


def graphs_are_well_formed(program: Any) -> None:
    """Invariant between lowering passes: every fx graph of a stage (its top level and each distinct
    unit graph) passes ``Graph.lint`` (each use after its definition, targets that exist)."""
    if not isinstance(program, StageGraph):
        return  # the captured model graph, before partitioning: linted by capture's trace
    for graph in {id(g): g for g in [program.graph, *(unit.graph for unit in program.units)]}.values():
        graph.lint()


def lower_stage(program: MistProgram, plan: Plan, coord: RankCoord, *, virtual: int | None = None,
                print_after: tuple[str, ...] = (), on_dump: Callable[[str, Any], None] | None = None) -> StageGraph:
    """Run the lowering passes for one rank's stage, or one of its virtual stages (no weights
    involved); the plan was checked against the program before (:func:`check_plan_against_program`,
    the driver's ``check_plan``)."""
    manager = PassManager(lowering_passes(program, plan, coord, virtual), invariants=(graphs_are_well_formed,),
                          print_after=print_after, on_dump=on_dump)
    return manager(program.model_graph).program


def lower(program: MistProgram, plan: Plan, coord: RankCoord, source: TensorSource, *, device: torch.device,
          tp_group: Any = None, deferred: bool = True, compile_graph: Any = None) -> StageProgram:
    """This rank's runnable stage program: its lowered virtual stages (one unless stages share
    devices), built with this rank's weights (made when the runtime lays each unit out when
    ``deferred``, so no rank ever holds more than its own state plus one unit in flight).
    ``compile_graph``: how the halves of split units are compiled (default: run as fx graphs)."""
    queue = WeightGradQueue()
    made: dict = {}
    chunks = [build_stage(lower_stage(program, plan, coord, virtual=j), program.model_graph, source, device=device,
                          group=tp_group, deferred=deferred, made=made, weight_grads=queue, compile_graph=compile_graph)
              for j in plan.chunks(coord.stage)]
    built = chunks[0] if len(chunks) == 1 else merge_chunks(chunks)
    labels = label_convention(program)
    for stage in [built, *chunks]:
        stage.labels = labels
    return built


def dump_lowered(program: MistProgram, plan: Plan, after: str) -> str:
    """The program of every stage (tensor-parallel rank 0) right after the pass ``after``."""
    if after not in LOWERING_PASSES:
        raise PlanError(f"unknown pass {after!r}; lowering passes are: {', '.join(LOWERING_PASSES)}")
    check_plan_against_program(plan, program)
    out = io.StringIO()
    for stage_index, where in enumerate(plan.placement):
        dumps: list[str] = []
        lower_stage(program, plan, RankCoord(where, 0, 0), virtual=stage_index, print_after=(after,),
                    on_dump=lambda name, stage: dumps.append(describe(stage)))
        stage = plan.stages[stage_index]
        runs_on = f" on the devices of stage {where}" if plan.virtual_stages > 1 else ""
        out.write(f"# stage {stage_index}{runs_on}: layers [{stage.layers[0]}, {stage.layers[1]}), dp={stage.dp} "
                  f"tp={stage.tp} zero={stage.zero} ckpt_layers={stage.ckpt_layers}{' sp' if stage.sp else ''} "
                  f"(after {after})\n")
        out.write("".join(dumps))
    return out.getvalue()


def describe(stage: StageGraph) -> str:
    """A stage program in words: its top-level code, then each distinct unit program once."""
    lines = [f"# receives {[v.name for v in stage.interface.inputs]} + batch {stage.interface.batch_inputs}; "
             f"sends {[v.name for v in stage.interface.outputs]}"]
    lines.append(fx.GraphModule(torch.nn.Module(), stage.graph).code.strip()
                 if not any(n.op in ("get_attr", "call_module") for n in stage.graph.nodes)
                 else stage.graph.python_code("self").src.strip())
    shown: set[int] = set()
    for unit in stage.units:
        extra = ["checkpointed" if unit.checkpointed else "", "backward split" if unit.split_backward else "",
                 f"offload {unit.offload}" if unit.offload != type(unit.offload)() else "",
                 f"split {({a: (s.dim, s.segments) for a, s in unit.shards.items()})}" if unit.shards else ""]
        lines.append(f"#   unit {unit.name} ({unit.kind}, {len(unit.tensors)} tensors) {' '.join(e for e in extra if e)}".rstrip())
        if id(unit.graph) not in shown:
            shown.add(id(unit.graph))
            lines.append("\n".join("    " + line for line in unit.graph.python_code("self").src.strip().splitlines()))
    return "\n".join(lines) + "\n\n"
