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


def _node(graph: fx.Graph, name: str, attrs: dict[str, str] | None = None) -> fx.Node | None:
    """The node ``name`` of the captured graph in this (unit or stage) graph (a parameter: the
    attribute standing for it), or None when it is elsewhere."""
    if attrs and name in attrs:
        return next((n for n in graph.nodes if n.op == "get_attr" and n.target == attrs[name]), None)
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


def _attr_of(graph: fx.Graph, attrs: dict[str, str], placeholder: str) -> fx.Node:
    target = attrs[placeholder]
    return next(n for n in graph.nodes if n.op == "get_attr" and n.target == target)


def _insert_after(graph: fx.Graph, node: fx.Node, make) -> fx.Node:
    with graph.inserting_after(node):
        new = make()
    new.meta.update(node.meta)
    return new


def _divide_slice(item, degree: int):
    bounds = [None if b is None else _divide(b, (), degree) for b in (item.start, item.stop)]
    return slice(bounds[0], bounds[1], item.step)


def _readers(node: fx.Node, names: tuple) -> list[fx.Node]:
    return [u for u in node.users if u.name in names]


def _apply(graph: fx.Graph, node: fx.Node, edit: GraphEdit, attrs: dict[str, str], degree: int) -> bool:
    """Apply one edit; returns whether the graph now calls a tensor-parallel collective."""
    if edit.kind == "divide_arg":
        index, rest = edit.position[0], edit.position[1:]
        args = list(node.args)
        args[index] = _divide(args[index], rest, degree)
        node.args = tuple(args)
        return False
    if edit.kind == "divide_slice":
        args = list(node.args)
        if len(edit.position) == 1:
            args[1] = _divide_slice(args[1], degree)
        else:
            items = list(args[1])
            items[edit.position[1]] = _divide_slice(items[edit.position[1]], degree)
            args[1] = tuple(items)
        node.args = tuple(args)
        return False
    if edit.kind == "defer_bias":
        if getattr(node.target, "__name__", "") == "addmm":
            node.target, node.args = torch.mm, (node.args[1], node.args[2])
        else:
            node.args, node.kwargs = (node.args[0], node.args[1]), {k: v for k, v in node.kwargs.items() if k != "bias"}
        return False
    if edit.kind == "copy_in":
        users = _readers(node, edit.data)
        if not users:
            return False  # its readers are in another graph of the stage
        copied = _insert_after(graph, node, lambda: graph.call_module("tp.copy", (node,)))
        for user in users:
            user.replace_input_with(node, copied)
        return True
    if edit.kind == "scatter":
        users = _readers(node, edit.data[:1])
        if not users:
            return False
        dim, block = edit.position
        part = _insert_after(graph, node, lambda: graph.call_module("tp.scatter", (node, dim, block, edit.data[1])))
        for user in users:
            user.replace_input_with(node, part)
        return True
    if edit.kind in ("reduce_out", "reduce_mean"):
        users = list(node.users)
        result = _insert_after(graph, node, lambda: graph.call_module("tp.reduce", (node,)))
        if edit.kind == "reduce_mean":
            reduced = result
            result = _insert_after(graph, reduced, lambda: graph.call_function(operator.truediv, (reduced, degree)))
        for bias in edit.data:
            previous = result
            result = _insert_after(graph, previous, lambda: graph.call_function(
                operator.add, (previous, _attr_of(graph, attrs, bias))))
        for user in users:
            user.replace_input_with(node, result)
        return True
    if edit.kind == "split_dropout":  # counter_dropout / counter_attention of this rank's part
        kind, parts = edit.data[0], tuple(edit.data[1]) if len(edit.data) > 1 else ()
        node.op, node.target = "call_module", f"tp.{kind}"
        node.kwargs = {**node.kwargs, "dim": edit.position[0], "block": edit.position[1], "parts": parts}
        return True
    if edit.kind == "tp_norm":
        node.op, node.target = "call_module", f"tp.{edit.data[0]}"
        return True
    if edit.kind == "vocab_embedding":
        node.op, node.target = "call_module", "tp.embedding"
        node.args, node.kwargs = node.args[:3], {}
        return True
    if edit.kind in ("vocab_loss", "vocab_fused_loss"):
        ignore_index, reduction = edit.data
        node.op = "call_module"
        node.target = "tp.cross_entropy" if edit.kind == "vocab_loss" else "tp.linear_cross_entropy"
        node.args = (node.args[0], node.args[1]) if edit.kind == "vocab_loss" else tuple(node.args[:3])
        node.kwargs = {"ignore_index": ignore_index, "reduction": reduction}
        return True
    raise TensorParallelError(f"unknown tensor-parallel edit {edit.kind!r}")


def apply_edits(graph: fx.Graph, edits: list[GraphEdit], attrs: dict[str, str], shards: dict[str, ShardSpec],
                degree: int) -> bool:
    """Rewrite ``graph`` in place; ``attrs`` maps captured placeholders to the unit's attributes."""
    uses_tp = False
    for edit in edits:
        node = _node(graph, edit.node, attrs)
        if node is None or (node.op == "placeholder" and edit.kind not in ("copy_in", "scatter")):
            continue  # the value is computed in another graph of the stage, which applies the edit
        uses_tp |= _apply(graph, node, edit, attrs, degree)
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
