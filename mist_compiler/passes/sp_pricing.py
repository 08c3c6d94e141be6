"""Sequence-parallel pricing: the captured ATen graphs priced as the ``sequence_parallel`` lowering
runs them (an analysis pass; ``sp_recognition`` decided where the edges are).

Seeds come from the torch-level recognition: every ATen node a sequence-split torch node issued
(``from_node`` provenance) and, in the backward, every node differentiating one of them (same
``seq_nr``) is *split along the sequence* (state ``Q``: ``1/t`` of its bytes and FLOPs) where the
tensor-parallel rules leave it replicated. Views and pointwise ops of split values stay split.
Then, inside the layers:

- an op that is not on a chunk (a column-parallel matmul, the weight gradient's matmul) reading a
  split value gets the whole sequence: an **all-gather** of it, once per value and phase (forward:
  the norm outputs entering attention and MLP; backward: the gradients entering the row-parallel
  matmuls and the norm outputs gathered again for the column-parallel weight gradients, which the
  runtime does not keep: Megatron's sequence parallelism);
- a partial sum read by anything in the layer is **reduce-scattered** (it becomes split) instead of
  all-reduced: the row-parallel outputs forward, the column-parallel input gradients backward;
- a value without a sequence dimension computed from split values (a norm weight's gradient) is a
  partial sum over the ranks' chunks: all-reduced where it is read (small, once per weight).

The result (:class:`SequencePriced`: costs and per-block memory) is attached to the program as
``program.analysis.sequence`` for the stage cost model, which uses it for stages with ``sp``. On a
compiled program's partition (``PricedGraphs.refine`` set by ``cost.compiled``) the costs are fused as
that annotation fuses them and its transient values are never stored; the collectives a compiled
layer runs are its eager program's, which ``cost.analysis`` puts in place of these.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any

import sympy
import torch.fx as fx

from ..ir.program import MistProgram
from .cost_annotation import (
    Collective,
    ProgramCosts,
    S,
    annotate_graphs,
    is_pointwise,
    is_view,
    tensor_shape,
    value_bytes,
)
from .manager import PassResult, transforms
from .memory_analysis import analyse_memory


def _has_sequence(node: fx.Node, symbols) -> bool:
    value = node.meta.get("val")
    if isinstance(value, (tuple, list)):  # a norm's (output, mean, rstd): as its output
        value = next((v for v in value if hasattr(v, "shape")), None)
    if not hasattr(value, "shape"):
        return False
    return any(S in sympy.sympify(d).free_symbols for d in tensor_shape(value, symbols))


def _base(node: fx.Node) -> fx.Node:
    while is_view(node) and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


@dataclass
class SequencePricing:
    """The hooks :func:`~.cost_annotation.propagate_costs` calls to price sequence parallelism."""

    split: set[str]  # ATen nodes (forward and backward) of sequence-split torch nodes
    layers: set[str]  # ATen nodes of the layer blocks (where the sequence is split)
    saved_bases: dict[str, str] = field(default_factory=dict)  # backward placeholder -> its forward storage base
    gathered: set[tuple[str, str]] = field(default_factory=set)  # (phase, base) already all-gathered

    def reduction(self, producer: fx.Node, consumer: fx.Node | None, symbols) -> tuple[str, str]:
        """How a partial sum becomes whole for ``consumer``: reduce-scatter inside the layers."""
        if consumer is not None and consumer.name in self.layers and _has_sequence(producer, symbols):
            return "reduce_scatter", "Q"
        return "all_reduce", "R"

    def state(self, node: fx.Node, state: str, inputs: list[fx.Node], in_states: list[str],
              collectives: list[Collective], symbols, phase: str) -> str:
        """The node's state with sequence parallelism (``state``: the tensor-parallel rules' one)."""
        if node.name not in self.layers:
            return state
        chunks = [arg for arg, s in zip(inputs, in_states) if s == "Q"]
        whole = [s for s in in_states if s in ("S", "P")]
        sequence = _has_sequence(node, symbols)
        if state == "R" and sequence and (node.name in self.split or (chunks and not whole and (
                is_view(node) or is_pointwise(node)))):
            return "Q"
        if not chunks:
            return state
        if state == "R" and not sequence:
            return "P"  # summed over this rank's chunk only (a norm weight's gradient)
        for arg in chunks:  # the op needs the whole sequence of these
            base = _base(arg)
            key = (phase, self.saved_bases.get(base.name, base.name))  # views saved apart are one storage
            if key not in self.gathered:
                self.gathered.add(key)
                collectives.append(Collective("all_gather", value_bytes(base, symbols), arg.name,
                                              f"{phase}: {node.name} reads the whole sequence of {arg.name}"))
        return state


def sequence_pricing(program: MistProgram, graphs) -> SequencePricing | None:
    """The seeds for ``program``'s graphs (``cost_annotation.ProgramGraphs``), or None without sequence
    parallelism."""
    model = program.model_graph
    sp = model.sp if model is not None else None
    if sp is None or not sp.supported:
        return None
    torch_split = {name for region in sp.regions.values() for name in region.split_values}
    entering = {region.carried_in for region in model.regions}  # the hidden state a layer receives: a chunk
    layer_ids = {block.class_id for block in program.blocks if block.kind == "layer"}
    layers = set().union(*(graphs.blocks[c] for c in layer_ids if c in graphs.blocks))
    split, sequence_numbers = set(), set()
    for node in graphs.forward.graph.nodes:
        sources = node.meta.get("from_node") or []
        if node.name not in layers and sources and sources[0].name in entering:
            split.add(node.name)  # (made whole before the first layer, split there: priced as the chunk it becomes)
            layers.add(node.name)
        if node.name in layers and sources and sources[0].name in torch_split:
            split.add(node.name)
            if node.meta.get("seq_nr") is not None and not is_view(node):
                sequence_numbers.add(node.meta["seq_nr"])
    forward = {node.name: node for node in graphs.forward.graph.nodes}
    saved_bases = {}
    for node in graphs.backward.graph.nodes:
        if node.name in layers and node.meta.get("seq_nr") in sequence_numbers:
            split.add(node.name)
        elif node.op == "placeholder" and node.name in forward:
            saved_bases[node.name] = _base(forward[node.name]).name
    return SequencePricing(split, layers, saved_bases)


@dataclass
class SequencePriced:
    """The program's costs and per-block memory with sequence parallelism (class id -> BlockMemory)."""

    costs: ProgramCosts
    memory: dict[int, Any]


@transforms(MistProgram)
def sequence_parallel_pricing(program: MistProgram) -> PassResult:
    """Pass: price the program with sequence parallelism (module docstring) next to its tensor-parallel
    prices: ``program.analysis.sequence`` (None when the model cannot run sequence-parallel). Needs the
    cost annotation to have run."""
    priced = program.analysis
    if priced is None:
        raise ValueError("sequence_parallel_pricing runs after cost_annotation")
    graphs = priced.graphs
    seeds = sequence_pricing(program, graphs)
    result = None
    if seeds is not None and priced.costs.sharding.supported:
        costs = annotate_graphs(graphs.forward, graphs.backward, graphs.params, graphs.symbols,
                                sharding=graphs.sharding, sequence=seeds)
        transient = frozenset()
        if priced.refine is not None:  # a compiled program: its elementwise chains run as fused kernels
            costs, transient = priced.refine(costs)
        blocks = {str(class_id): names for class_id, names in graphs.blocks.items()}
        memory = analyse_memory(graphs.forward, graphs.backward, costs, graphs.params, blocks, graphs.symbols,
                                transient=transient, block_nodes=priced.block_nodes)
        result = SequencePriced(costs, {int(label): m for label, m in memory.items()})
    analysed = copy.copy(program)
    analysed.analysis = replace(priced, sequence=result)
    return PassResult(analysed, False)


__all__ = ["SequencePriced", "SequencePricing", "sequence_parallel_pricing", "sequence_pricing"]
