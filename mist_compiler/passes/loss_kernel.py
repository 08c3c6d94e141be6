"""Loss kernel: the plan's choice between the fused, chunked head + loss and the plain one.

Capture fuses the LM head with its cross-entropy (``mist::linear_cross_entropy``: chunked, no
``N x V`` logits, the logits recomputed in the backward: ``8NHV`` FLOPs where the plain loss makes
``6NHV``). That trades time for memory, so the plan chooses (``Plan.fused_loss``, priced both ways
by the cost model, picked by the tuner where memory allows). With ``fused_loss`` false this pass
puts the plain computation back, in every graph of the stage (units and top level)::

    loss = mist.linear_cross_entropy(h, w, labels, ii, red)[0]
        -> loss = cross_entropy(linear(h, w).float(), labels, ignore_index=ii, reduction=red)
    loss = tp.linear_cross_entropy(h, w, labels, ii, red)[0]          (vocabulary-parallel head)
        -> loss = tp.cross_entropy(linear(tp.copy(h), w), labels, ii, red)

(``tp.copy``: the head's input gradient is summed over the tensor-parallel ranks, as the fused
op does itself.) Runs after ``tp_sharding``. A fused op whose second output (the log-sum-exp) is
read elsewhere stays fused. Pure: graphs are cloned before they change.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, replace

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..ir.stage import StageGraph
from .manager import PassResult
from .tp_sharding import clone_graph

FUSED_OP = torch.ops.mist.linear_cross_entropy.default
TP_FUSED = "tp.linear_cross_entropy"


def _is_fused(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target is FUSED_OP) or \
        (node.op == "call_module" and node.target == TP_FUSED)


def _arguments(node: fx.Node) -> tuple:
    """(hidden, weight, labels, ignore_index, reduction) of a fused call."""
    names = ("hidden", "weight", "labels", "ignore_index", "reduction")
    values = dict(zip(names, node.args))
    values.update({k: v for k, v in node.kwargs.items() if k in names})
    values.setdefault("ignore_index", -100)
    values.setdefault("reduction", "mean")
    return tuple(values[name] for name in names)


def _unfuse(graph: fx.Graph, node: fx.Node) -> bool:
    """Replace one fused call whose only reads are ``[0]``; False when it must stay."""
    users = list(node.users)
    if not users or any(u.op != "call_function" or u.target is not operator.getitem or u.args[1] != 0 for u in users):
        return False
    hidden, weight, labels, ignore_index, reduction = _arguments(node)
    tensor_parallel = node.op == "call_module"
    with graph.inserting_before(node):
        if tensor_parallel:
            hidden = graph.call_module("tp.copy", (hidden,))
        logits = graph.call_function(F.linear, (hidden, weight))
        if tensor_parallel:
            loss = graph.call_module("tp.cross_entropy", (logits, labels),
                                     {"ignore_index": ignore_index, "reduction": reduction})
        else:
            upcast = graph.call_method("float", (logits,))
            loss = graph.call_function(F.cross_entropy, (upcast, labels),
                                       {"ignore_index": ignore_index, "reduction": reduction})
    for new in (hidden, logits, loss):
        if isinstance(new, fx.Node):
            new.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")})
    for user in users:
        user.replace_all_uses_with(loss)
        graph.erase_node(user)
    graph.erase_node(node)
    return True


def unfuse_graph(graph: fx.Graph) -> fx.Graph | None:
    """A copy of ``graph`` with its fused losses made plain, or None when it has none to change."""
    if not any(_is_fused(n) for n in graph.nodes):
        return None
    graph = clone_graph(graph)
    changed = [_unfuse(graph, node) for node in [n for n in graph.nodes if _is_fused(n)]]
    if not any(changed):
        return None
    graph.lint()
    return graph


@dataclass
class LossKernel:
    """Keep the fused, chunked loss (``fused``) or put the plain head + cross-entropy back."""

    fused: bool
    name: str = "loss_kernel"
    input_type = output_type = StageGraph

    def __call__(self, stage: StageGraph) -> PassResult:
        if self.fused:
            return PassResult(stage, False)
        units, changed = [], False
        for unit in stage.units:
            graph = unfuse_graph(unit.graph)
            changed |= graph is not None
            units.append(replace(unit, graph=graph, needs_tp=unit.needs_tp or _uses_tp(graph)) if graph is not None
                         else unit)
        top = unfuse_graph(stage.graph)
        if not changed and top is None:
            return PassResult(stage, False)
        return PassResult(replace(stage, units=units, graph=top if top is not None else stage.graph), True)


def _uses_tp(graph: fx.Graph) -> bool:
    return any(n.op == "call_module" and str(n.target).startswith("tp.") for n in graph.nodes)
