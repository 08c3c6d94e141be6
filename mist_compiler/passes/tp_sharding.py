"""Tensor-parallel sharding: apply the recognised plan to one stage's unit graphs.

Input: a :class:`~mist_compiler.ir.stage.StageGraph` and the model's
:class:`~mist_compiler.ir.model_graph.TensorParallelPlan` (made by ``tp_recognition``, the one
recogniser); output: the same stage whose units record how each tensor is split
(``Unit.shards``) and whose graphs call the collectives (``tp.copy``, ``tp.reduce``,
``tp.embedding``, ``tp.cross_entropy``, ``tp.linear_cross_entropy``, see :mod:`mist_compiler.ops.tensor_parallel`), with every
size written as a number for a split dimension divided by the degree. Nothing is decided here.
The vocabulary (embedding and head) is split only when the degree divides it; otherwise those
stay whole on every rank.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, replace

import torch
import torch.fx as fx

from ..ir.model_graph import GraphEdit, ModelGraph, RegionSharding, ShardSpec, TensorParallelPlan
from ..ir.plan import PlanError
from ..ir.stage import StageGraph, Unit
from .manager import PassResult


class TensorParallelError(PlanError):
    """A plan asking for a tensor-parallel degree the model cannot take; names the layer and why."""


def check_degree(plan: TensorParallelPlan | None, degree: int, where: str = "tp") -> None:
    """Refuse ``degree`` when the model's recognised structure cannot be split that way."""
    if degree == 1:
        return
    if plan is None or not plan.supported:
        reason = plan.reason if plan is not None else "the model has no layer list"
        raise TensorParallelError(f"{where}: tensor parallelism is not possible for this model: {reason}")
    if plan.granularity % degree:
        raise TensorParallelError(f"{where}: tp={degree} does not divide the model's split sizes "
                                  f"(heads, key/value heads, features: their gcd is {plan.granularity})")


def clone_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` whose nodes share their metadata values (no FakeTensor is copied)."""
    new = fx.Graph()
    output = new.graph_copy(graph, {})
    new.output(output)
    return new


def _node(graph: fx.Graph, name: str) -> fx.Node | None:
    """The node ``name`` of the captured graph in this (unit or stage) graph, or None when it is elsewhere."""
    for candidate in (name, f"{name}_in"):
        for node in graph.nodes:
            if node.name == candidate and node.op != "output":
                return node
    return None


def _divide(value, position: tuple, degree: int):
    if not position:
        if not isinstance(value, int) or value % degree:
            raise TensorParallelError(f"size {value} cannot be divided by the tensor-parallel degree {degree}")
        return value // degree
    head, rest = position[0], position[1:]
    items = list(value)
    items[head] = _divide(items[head], rest, degree)
    return type(value)(items) if not isinstance(value, torch.Size) else torch.Size(items)


def _is_column_matmul(node: fx.Node, activation: fx.Node, sharded: dict[str, ShardSpec]) -> bool:
    name = getattr(node.target, "__name__", str(node.target))
    if node.op == "call_method":
        return False
    if name == "linear" and node.args[0] is activation:
        weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
        column_dim = 0
    elif name == "addmm" and node.args[1] is activation:
        weight, column_dim = node.args[2], 1
    elif name in ("matmul", "mm") and node.args[0] is activation:
        weight, column_dim = node.args[1], 1
    else:
        return False
    return isinstance(weight, fx.Node) and weight.op == "get_attr" and \
        sharded.get(weight.target, ShardSpec(-1)).dim == column_dim


def _attr_of(graph: fx.Graph, attrs: dict[str, str], placeholder: str) -> fx.Node:
    target = attrs[placeholder]
    return next(n for n in graph.nodes if n.op == "get_attr" and n.target == target)


def apply_edits(graph: fx.Graph, edits: list[GraphEdit], attrs: dict[str, str], shards: dict[str, ShardSpec],
                degree: int) -> bool:
    """Rewrite ``graph`` in place; ``attrs`` maps captured placeholders to the unit's attributes."""
    uses_tp = False
    for edit in edits:
        node = _node(graph, edit.node)
        if node is None or (node.op == "placeholder" and edit.kind != "copy_in"):
            continue  # the value is computed in another graph of the stage, which applies the edit
        if edit.kind == "divide_arg":
            index, rest = edit.position[0], edit.position[1:]
            args = list(node.args)
            args[index] = _divide(args[index], rest, degree)
            node.args = tuple(args)
        elif edit.kind == "defer_bias":
            name = getattr(node.target, "__name__", "")
            if name == "addmm":
                node.target, node.args = torch.mm, (node.args[1], node.args[2])
            else:
                node.args, node.kwargs = (node.args[0], node.args[1]), {k: v for k, v in node.kwargs.items() if k != "bias"}
        elif edit.kind == "copy_in":
            users = [u for u in node.users if _is_column_matmul(u, node, shards)]
            if not users:
                continue  # its column-parallel readers are in another graph of the stage
            with graph.inserting_after(node):
                copied = graph.call_module("tp.copy", (node,))
            copied.meta.update(node.meta)
            for user in users:
                user.replace_input_with(node, copied)
            uses_tp = True
        elif edit.kind == "reduce_out":
            users = list(node.users)
            with graph.inserting_after(node):
                reduced = graph.call_module("tp.reduce", (node,))
            reduced.meta.update(node.meta)
            result = reduced
            for bias in edit.data:
                with graph.inserting_after(result):
                    weight = _attr_of(graph, attrs, bias)
                    result = graph.call_function(operator.add, (result, weight))
                result.meta.update(node.meta)
            for user in users:
                user.replace_input_with(node, result)
            uses_tp = True
        elif edit.kind == "vocab_embedding":
            node.op, node.target = "call_module", "tp.embedding"
            node.args, node.kwargs = node.args[:3], {}
            uses_tp = True
        elif edit.kind == "vocab_loss":
            ignore_index, reduction = edit.data
            node.op, node.target = "call_module", "tp.cross_entropy"
            node.args, node.kwargs = (node.args[0], node.args[1]), {"ignore_index": ignore_index,
                                                                     "reduction": reduction}
            uses_tp = True
        elif edit.kind == "vocab_fused_loss":
            ignore_index, reduction = edit.data
            node.op, node.target = "call_module", "tp.linear_cross_entropy"
            node.args, node.kwargs = tuple(node.args[:3]), {"ignore_index": ignore_index, "reduction": reduction}
            uses_tp = True
        else:
            raise TensorParallelError(f"unknown tensor-parallel edit {edit.kind!r}")
    graph.lint()
    return uses_tp


def _vocab_divisible(model: ModelGraph, region: RegionSharding, degree: int) -> bool:
    by_name = model._by_name()
    for name, spec in region.shards.items():
        size = by_name[name].meta["example_value"].shape[spec.dim]
        if int(size) % degree:
            return False
    return True


def _unit_attrs(model: ModelGraph, unit: Unit) -> dict[str, str]:
    """Captured placeholder -> the unit's attribute for it."""
    if unit.kind == "layer":
        region = next(r for r in model.regions if r.label == unit.region)
        return dict(region.params)
    attribute = {fqn: attr for attr, (_, fqn) in unit.tensors.items()}
    return {placeholder: attribute[name] for placeholder, (_, name) in model.tensors.items() if name in attribute}


@dataclass
class TensorParallel:
    """The sharding pass for one rank: ``(tp rank, degree)`` of the stage's tensor-parallel group."""

    model: ModelGraph
    rank: int
    degree: int
    name: str = "tp_sharding"
    input_type = output_type = StageGraph

    def __call__(self, stage: StageGraph) -> PassResult:
        if self.degree == 1:
            return PassResult(stage, False)
        plan = self.model.tp
        check_degree(plan, self.degree, f"plan field stages[{stage.stage}].tp")
        done: dict[int, tuple[fx.Graph, bool]] = {}
        units = []
        for unit in stage.units:
            region = plan.regions.get(unit.region, RegionSharding())
            if unit.kind != "layer" and not _vocab_divisible(self.model, region, self.degree):
                region = RegionSharding()
            attrs = _unit_attrs(self.model, unit)
            shards = {attrs[p]: spec for p, spec in region.shards.items() if p in attrs}
            if id(unit.graph) not in done:
                graph = clone_graph(unit.graph)
                uses_tp = apply_edits(graph, region.edits, attrs, shards, self.degree)
                done[id(unit.graph)] = (graph, uses_tp)
            graph, uses_tp = done[id(unit.graph)]
            units.append(replace(unit, graph=graph, shards=shards, needs_tp=uses_tp))
        top = clone_graph(stage.graph)  # the pre/post code outside modules (the loss) is split here
        top_edits = [e for part in ("pre", "post") if _vocab_divisible(self.model, plan.regions.get(part, RegionSharding()),
                                                                         self.degree)
                     for e in plan.regions.get(part, RegionSharding()).edits]
        top_needs_tp = apply_edits(top, top_edits, {}, {}, self.degree)
        return PassResult(replace(stage, graph=top, units=units, tp=(self.rank, self.degree), needs_tp=top_needs_tp), True)


__all__ = ["TensorParallel", "TensorParallelError", "apply_edits", "check_degree"]
