"""Sequence-parallel lowering: turn a tensor-parallel stage's region edges into sequence collectives.

Runs after ``tp_sharding`` on a stage whose plan says ``sp``. In every layer unit graph the
``tp.copy`` of a value ``sp_recognition`` found sequence-split becomes ``tp.sp_gather`` (all-gather
forward, reduce-scatter backward) and the ``tp.reduce`` of a partial sum it scatters becomes
``tp.sp_scatter`` (reduce-scatter forward, all-gather backward); each call carries the value's
sequence dimension. The layers' hidden state is then a sequence chunk, and so is every value
computed from it outside the tensor-parallel regions: the weights those values read (norm scales,
biases added after a reduce-scatter) get only this rank's chunk's share of their gradient, so each
such value is read through ``tp.copy`` (identity forward, all-reduce of the gradient backward:
Megatron's all-reduce of the sequence-parallel weights' gradients). In the stage's top-level
graph:

- the hidden state entering the first layer is split (``tp.sp_split``) unless it arrives as a
  chunk: from a previous stage with the same ``tp`` and ``sp``, the boundary carries chunks;
- the hidden state leaving the last layer is gathered (``tp.sp_collect``) for the post part (head
  and loss run on the whole sequence) or for a next stage without the same ``tp`` and ``sp``; to one
  with them it is sent as a chunk (the interface's boundary shapes say so).
Nothing is decided here: the edges come from the recognition, the choice from the plan.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.fx as fx

from ..ir.model_graph import ModelGraph
from ..ir.plan import Plan, PlanError
from ..ir.stage import BoundaryValue, StageGraph
from .manager import PassResult
from .tp_sharding import clone_graph


class SequenceParallelError(PlanError):
    """A plan asking for sequence parallelism the model cannot take; names the layer and why."""


def check_sequence_parallel(model: ModelGraph, plan: Plan) -> None:
    """Refuse a plan whose ``sp`` stages the model's layers cannot run sequence-parallel."""
    for index, stage in enumerate(plan.stages):
        if not stage.sp:
            continue
        sp = model.sp
        if sp is None or not sp.supported:
            reason = sp.reason if sp is not None else "the model has no layer list"
            raise SequenceParallelError(f"plan field stages[{index}].sp: sequence parallelism is not possible for this "
                                        f"model: {reason}")


def chunked_boundary(plan: Plan, stage: int, neighbour: int) -> bool:
    """Whether the hidden state between ``stage`` and ``neighbour`` travels as sequence chunks (both
    use sequence parallelism over the same tensor-parallel degree)."""
    if not 0 <= neighbour < plan.pp:
        return False
    here, there = plan.stages[stage], plan.stages[neighbour]
    return here.sp and there.sp and here.tp == there.tp


def _captured_name(node: fx.Node) -> str:
    """The captured graph's name of a unit graph's value (the layer input is ``<name>_in`` there)."""
    if node.op == "placeholder" and node.name.endswith("_in"):
        return node.name[: -len("_in")]
    return node.name


def rewrite_layer_graph(graph: fx.Graph, gathers: dict[str, int], scatters: dict[str, int]) -> int:
    """In place: ``tp.copy`` of a gathered value -> ``tp.sp_gather``, ``tp.reduce`` of a scattered
    partial sum -> ``tp.sp_scatter``, and the other values that sequence-split values read (weights)
    go through ``tp.copy``; returns the number of edges rewritten."""
    changed = 0
    for node in graph.nodes:
        if node.op != "call_module" or node.target not in ("tp.copy", "tp.reduce"):
            continue
        source = _captured_name(node.args[0])
        table, target = (gathers, "tp.sp_gather") if node.target == "tp.copy" else (scatters, "tp.sp_scatter")
        if source in table:
            node.target = target
            node.kwargs = {"dim": table[source]}
            changed += 1
    return changed + _reduce_split_weight_grads(graph)


def _reduce_split_weight_grads(graph: fx.Graph) -> int:
    """Route every floating-point value a sequence-split value reads that is not split itself (a norm
    scale, ``1 + weight`` of a Gemma norm, a bias added after the reduce-scatter) through ``tp.copy``:
    its gradient from this rank's chunk is summed over the ranks."""
    hidden = next((n for n in graph.nodes if n.op == "placeholder"), None)
    split = {hidden} if hidden is not None else set()
    for node in graph.nodes:
        if node.op == "call_module" and node.target == "tp.sp_scatter":
            split.add(node)
        elif node.op != "placeholder" and not (node.op == "call_module" and node.target == "tp.sp_gather") \
                and any(arg in split for arg in node.all_input_nodes):
            split.add(node)
    partners: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.nodes:
        if node not in split or node.op == "placeholder" or node.target == "tp.sp_scatter":
            continue  # (a reduce-scatter reads the partial sum it splits, not a partner)
        for arg in node.all_input_nodes:
            value = arg.meta.get("example_value", arg.meta.get("val"))
            if arg not in split and arg.op != "placeholder" and isinstance(value, torch.Tensor) \
                    and value.is_floating_point():
                partners.setdefault(arg, []).append(node)
    for value, readers in partners.items():
        with graph.inserting_after(value):
            copied = graph.call_module("tp.copy", (value,))
        copied.meta.update(value.meta)
        for reader in readers:
            reader.replace_input_with(value, copied)
    return len(partners)


def _chunk(value: BoundaryValue, dim: int, degree: int) -> BoundaryValue:
    """The boundary value as a sequence chunk (``dim``: the sequence dimension of the whole value)."""
    sample = list(value.sample_shape)
    position = dim - 1 if value.batched else dim
    if sample[position] % degree:
        raise SequenceParallelError(f"the hidden state's sequence length {sample[position]} is not divisible by tp = {degree}")
    sample[position] //= degree
    return replace(value, sample_shape=tuple(sample))


class SequenceParallel:
    """The pass for one stage of a plan (every rank of the stage applies the same rewrite)."""

    name = "sequence_parallel"
    input_type = output_type = StageGraph

    def __init__(self, model: ModelGraph, plan: Plan, stage: int) -> None:
        self.model, self.plan, self.stage = model, plan, stage

    def __call__(self, stage: StageGraph) -> PassResult:
        if not self.plan.stages[self.stage].sp:
            return PassResult(stage, False)
        check_sequence_parallel(self.model, self.plan)
        regions = self.model.sp.regions
        done: dict[int, fx.Graph] = {}
        units = []
        for unit in stage.units:
            if unit.kind == "layer":
                if id(unit.graph) not in done:
                    graph = clone_graph(unit.graph)
                    region = regions[unit.region]
                    rewrite_layer_graph(graph, region.gathers, region.scatters)
                    graph.lint()
                    done[id(unit.graph)] = graph
                unit = replace(unit, graph=done[id(unit.graph)])
            units.append(unit)
        graph, interface = clone_graph(stage.graph), stage.interface
        layers = [u for u in units if u.kind == "layer"]
        first_dim = regions[layers[0].region].hidden_dim
        last_dim = regions[layers[-1].region].hidden_dim
        calls = [n for n in graph.nodes if n.op == "call_module" and n.target in {u.name for u in layers}]
        degree = self.plan.stages[self.stage].tp
        needs_tp = stage.needs_tp
        if chunked_boundary(self.plan, self.stage, self.stage - 1):
            interface = replace(interface, inputs=[_chunk(interface.inputs[0], first_dim, degree), *interface.inputs[1:]])
        else:
            hidden = calls[0].args[0]
            with graph.inserting_before(calls[0]):
                split = graph.call_module("tp.sp_split", (hidden,), {"dim": first_dim})
            split.meta.update(hidden.meta)
            calls[0].replace_input_with(hidden, split)
            needs_tp = True
        if chunked_boundary(self.plan, self.stage, self.stage + 1):
            interface = replace(interface, outputs=[_chunk(interface.outputs[0], last_dim, degree), *interface.outputs[1:]])
        else:
            last = calls[-1]
            users = list(last.users)
            with graph.inserting_after(last):
                collect = graph.call_module("tp.sp_collect", (last,), {"dim": last_dim})
            collect.meta.update(last.meta)
            for user in users:
                user.replace_input_with(last, collect)
            needs_tp = True
        graph.lint()
        return PassResult(replace(stage, graph=graph, units=units, interface=interface, needs_tp=needs_tp), True)


__all__ = ["SequenceParallel", "SequenceParallelError", "check_sequence_parallel", "chunked_boundary"]
