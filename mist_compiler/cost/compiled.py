"""What a compiled unit runs and keeps: inductor's partition of the joint graph and its fused kernels.

The runtime compiles each unit (a layer's forward and backward, the pre and post blocks) with
inductor through aot_autograd. Two things then differ from the eager program the capture records:

- **What the forward saves** is chosen by inductor's partitioner (``min_cut_rematerialization_partition``,
  the one ``torch.compile`` uses for training), not by eager autograd: cheap elementwise values the
  backward needs are recomputed there from a smaller set of saved tensors (a fused RMSNorm keeps its
  input and the fp32 reciprocal root, not the fp32 copies; SwiGLU keeps its two projections, not
  ``silu(gate)``; a dropout keeps no mask: the runtime draws it again from its hash).
  :func:`compiled_partition` runs that partitioner on the captured joint graph.
- **Elementwise ops are fused.** A chain of pointwise ops, reductions and normalisations between
  two GEMM/attention kernels runs as one kernel that reads its inputs once and writes only the
  values something else needs: one memory pass. :func:`fuse_costs` groups the annotated ops of each
  graph into such *regions* (connected elementwise ops of one block: a unit never fuses across
  units), prices each as one op of class ``fused`` (its inputs read once, its stored outputs written
  once; the profile's ``efficiency['fused']``, else ``elementwise``, of the copy rate; one kernel
  launch) and names the values that never reach memory (``transient``, for the memory analysis).
  Where a member's math outlasts that pass (erf and exp on a CPU, the dropout's integer hash:
  ``COMPILED_POINTWISE_OPS``), the region also carries one cost of class ``pointwise:<op>`` per such
  op, with the op's elements in the place of bytes and no FLOPs: the profile's
  ``compiled_pointwise_ns`` prices it (``cost.op_time``), zero where the profile has none.

Matmuls, attention, the fused loss, grouped expert GEMMs and data-dependent ops (sort, top-k,
histograms, ...) stay kernels of their own, as inductor calls them.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from ..ir.program import MistProgram
from ..passes.cost_annotation import (GraphCosts, NodeCost, PricedGraphs, ProgramCosts, T, annotate_graphs, is_view,
                                      op_name, program_graphs, tensor_shape, tensor_values, value_bytes)
from ..passes.manager import PassResult, transforms
from .op_time import POINTWISE_PREFIX

FUSIBLE_CLASSES = ("elementwise", "norm", "softmax", "embedding")
# pointwise ops whose vectorised math (erf, exp) a CPU's compiled kernel spends longer on than on
# moving the op's bytes: 0.1-0.5 ns per element beyond the memory pass measured on the machine
# that wrote this (inductor's erf runs at half the speed of eager's)
COMPILED_POINTWISE_OPS = ("gelu", "gelu_backward", "silu", "silu_backward",
                          # the runtime's dropout mask: an integer hash of each element's place (``ops.dropout``),
                          # drawn in the forward and again in the backward (:func:`_runtime_dropouts`)
                          "native_dropout")
POINTWISE_META = "mist_pointwise"  # node metadata naming the op a stand-in node prices as (``_runtime_dropouts``)
# elementwise-classed ops inductor does not generate code for (library calls or data-dependent sizes)
EXTERN_OPS = {"sort", "topk", "histc", "nonzero", "_unique2", "unique_dim", "masked_select", "bucketize",
              "embedding_dense_backward", "index_put", "scatter", "scatter_add"}


def _joint_forward_outputs(joint: fx.GraphModule) -> int:
    """Outputs of the joint graph that belong to the forward: everything before one gradient per primal."""
    primals = sum(1 for n in joint.graph.nodes if n.op == "placeholder" and n.name.startswith("primals"))
    output = next(n for n in joint.graph.nodes if n.op == "output")
    values = output.args[0] if isinstance(output.args[0], (tuple, list)) else output.args
    return len(values) - primals


def compiled_partition(joint: fx.GraphModule) -> tuple[fx.GraphModule, fx.GraphModule]:
    """(forward, backward) as inductor partitions the joint graph: min-cut rematerialisation.

    Runs on a copy of the graph (the partitioner rewrites the graph it is given); node names are
    kept, so the analysis passes find each node's block, and recomputed forward ops appear in the
    backward under their forward names."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    graph = fx.Graph()
    output = graph.graph_copy(joint.graph, {})
    graph.output(output)
    _drop_detaches(graph)
    _runtime_dropouts(graph)
    copy = fx.GraphModule(joint, graph)
    inputs = [n.meta.get("val") for n in copy.graph.nodes if n.op == "placeholder"]
    return min_cut_rematerialization_partition(copy, inputs, compiler="inductor",
                                               num_fwd_outputs=_joint_forward_outputs(joint))


def _drop_detaches(graph: fx.Graph) -> None:
    """Leave out the ``detach`` nodes of the captured joint graph (autograd's saved values). The partitioner
    takes a value a ``detach`` reads in the backward for one it must save, where torch.compile's own run
    recomputes it: HF GPT-2's tanh GELU saved its ``tanh`` here, not under ``saved_tensors_hooks``."""
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.detach.default]:
        node.replace_all_uses_with(node.args[0])
        graph.erase_node(node)


def _runtime_dropouts(graph: fx.Graph) -> None:
    """Each captured ``native_dropout`` as the compiled units run it (``lowering.compile``,
    ``ops.dropout``): ``where(mask, x * scale, 0)``, a deterministic function the partitioner may recompute,
    whose mask is drawn again in the backward, not saved (tagged ``MUST_RECOMPUTE`` as the runtime's
    hash is). The mask item becomes a bool factory of the value's shape carrying the hash's price
    (``meta[POINTWISE_META]``: wherever the partition computes it, forward or backward), the op a
    multiplication by the scale, the output item the ``where``: every node keeps its name, so its block
    and the memory analysis find it."""
    from torch.utils.checkpoint import CheckpointPolicy

    for dropout in [n for n in graph.nodes if n.target is torch.ops.aten.native_dropout.default]:
        items = {user.args[1]: user for user in dropout.users if user.target is operator.getitem}
        x, p = dropout.args[0], float(dropout.args[1])
        if set(items) != {0, 1} or len(dropout.users) != 2 or not 0.0 < p < 1.0 or "val" not in items[0].meta:
            continue
        out, mask = items[0], items[1]
        shape = []
        for dim, size in enumerate(out.meta["val"].shape):  # a symbolic size as a node, as captured ones are
            if isinstance(size, torch.SymInt):
                with graph.inserting_before(dropout):
                    size_node = graph.call_function(torch.ops.aten.sym_size.int, (x, dim))
                size_node.meta["val"] = size
                size = size_node
            shape.append(size)
        dropout.prepend(mask)
        mask.target, mask.args = torch.ops.aten.full.default, (shape, True)
        mask.kwargs = {"dtype": torch.bool, "device": out.meta["val"].device, "pin_memory": False}
        mask.meta.update({"recompute": CheckpointPolicy.MUST_RECOMPUTE, "ac_graph_id": 0,
                          POINTWISE_META: "native_dropout"})
        dropout.target, dropout.args = torch.ops.aten.mul.Tensor, (x, 1.0 / (1.0 - p))
        dropout.meta["val"] = out.meta["val"]
        out.target, out.args = torch.ops.aten.where.ScalarOther, (mask, dropout, 0.0)


def _pointwise_op(node: fx.Node) -> str:
    """The op whose math beyond its memory pass ``node`` pays for (``COMPILED_POINTWISE_OPS``)."""
    return node.meta.get(POINTWISE_META) or op_name(node)


def _is_fusible(node: fx.Node, cost: NodeCost | None) -> bool:
    return cost is not None and cost.op_class in FUSIBLE_CLASSES and op_name(node) not in EXTERN_OPS


def _source(node: fx.Node) -> fx.Node:
    """The node whose storage a view shows."""
    while is_view(node) and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def _consumers(node: fx.Node) -> list[fx.Node]:
    """The nodes that read ``node``'s value, through any views of it."""
    found, stack = [], list(node.users)
    while stack:
        user = stack.pop()
        if is_view(user):
            stack.extend(user.users)
        else:
            found.append(user)
    return found


@dataclass
class FusedGraph:
    """A graph's costs with its elementwise regions priced as fused kernels."""

    costs: GraphCosts
    transient: frozenset[str]  # values a fused kernel never writes to memory
    regions: list[list[str]]  # the member ops of each region, in graph order


def _stored_bytes(node: fx.Node, states: dict[str, str], symbols) -> sympy.Expr:
    size = value_bytes(node, symbols)
    return size / T if states.get(node.name) in ("S", "Q") else size  # split by TP, or along the sequence by SP


def _elements(node: fx.Node, states: dict[str, str], symbols) -> sympy.Expr:
    """Elements of ``node``'s value (its first, where it has several: ``native_dropout``'s output) on one rank."""
    values = tensor_values(node.meta.get("val"))
    if not values:
        return sympy.Integer(0)
    elements = sympy.Mul(*tensor_shape(values[0], symbols))
    return elements / T if states.get(node.name) in ("S", "Q") else elements


def fuse_costs(graph: fx.Graph, costs: GraphCosts, block_of: dict[str, str], symbols) -> FusedGraph:
    """Group ``costs``' fusible ops into regions (connected through their values, within one block)
    and price each region as one ``fused`` op: FLOPs summed, bytes = its inputs once + its stored
    outputs once. Other ops keep their costs; collectives and states are unchanged."""
    by_name = {c.name: c for c in costs.nodes}
    nodes = [n for n in graph.nodes if n.name in by_name]
    fusible = {n for n in nodes if _is_fusible(n, by_name[n.name])}
    parent = {n: n for n in fusible}

    def root(node: fx.Node) -> fx.Node:
        while parent[node] is not node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    for node in fusible:
        for arg in node.all_input_nodes:
            source = _source(arg)
            if source in fusible and block_of.get(source.name) == block_of.get(node.name):
                parent[root(source)] = root(node)
    members: dict[fx.Node, list[fx.Node]] = {}
    for node in nodes:
        if node in fusible:
            members.setdefault(root(node), []).append(node)
    transient: set[str] = set()
    fused: dict[fx.Node, NodeCost] = {}
    extra: dict[fx.Node, list[NodeCost]] = {}
    for group in members.values():
        inside = set(group)
        reads: dict[fx.Node, sympy.Expr] = {}
        writes = sympy.Integer(0)
        for node in group:
            for arg in node.all_input_nodes:
                source = _source(arg)
                if source not in inside:
                    reads[source] = _stored_bytes(source, costs.states, symbols)
            if any(user not in inside for user in _consumers(node)):
                writes += _stored_bytes(node, costs.states, symbols)
            else:
                transient.add(node.name)
        first = group[0]
        extra[first] = [NodeCost(first.name, _pointwise_op(node), POINTWISE_PREFIX + _pointwise_op(node),
                                 sympy.Integer(0), _elements(node, costs.states, symbols), by_name[node.name].tp)
                        for node in group if _pointwise_op(node) in COMPILED_POINTWISE_OPS]
        fused[first] = NodeCost(first.name, "fused", "fused", sympy.expand(sum((by_name[n.name].flops for n in group),
                                                                               sympy.Integer(0))),
                                sympy.expand(sympy.Add(*reads.values()) + writes), by_name[first.name].tp)
    kept = []
    for node in nodes:
        if node in fused:  # a region's extra costs first: by name, its fused cost is the one found last
            kept.extend(extra[node])
            kept.append(fused[node])
        elif node not in fusible:
            kept.append(by_name[node.name])
    regions = [[n.name for n in group] for group in members.values()]
    return FusedGraph(GraphCosts(kept, list(costs.collectives), costs.states), frozenset(transient), regions)


@transforms(MistProgram)
def compiled_cost_annotation(program: MistProgram) -> PassResult:
    """Pass: the program's costs as its compiled units run it, kept as ``program.analysis`` for the
    memory analysis and the stage cost model: the graphs of :func:`compiled_partition`, annotated
    (FLOPs, bytes, tensor-parallel states and collectives) and fused per block (:func:`fuse_costs`).
    The IR nodes keep the eager annotation of ``cost_annotation`` (or none). Pure."""
    import copy

    graphs = program_graphs(program, compiled_partition)
    costs = annotate_graphs(graphs.forward, graphs.backward, graphs.params, graphs.symbols, sharding=graphs.sharding)
    block_of = {name: label for label, names in graphs.blocks.items() for name in names}

    def fused(annotated: ProgramCosts) -> tuple[ProgramCosts, frozenset[str]]:
        """``annotated`` (these graphs' costs, e.g. re-annotated with sequence parallelism) with every
        elementwise region priced as one kernel, and the values those kernels never store."""
        forward = fuse_costs(graphs.forward.graph, annotated.forward, block_of, graphs.symbols)
        backward = fuse_costs(graphs.backward.graph, annotated.backward, block_of, graphs.symbols)
        return (ProgramCosts(forward.costs, backward.costs, annotated.sharding, annotated.param_states),
                forward.transient | backward.transient)

    fused_costs, transient = fused(costs)
    priced = copy.copy(program)
    priced.analysis = PricedGraphs(graphs, fused_costs, transient=transient, block_nodes=True, refine=fused)
    return PassResult(priced, False)


__all__ = ["COMPILED_POINTWISE_OPS", "FUSIBLE_CLASSES", "FusedGraph", "compiled_cost_annotation", "compiled_partition",
           "fuse_costs"]
