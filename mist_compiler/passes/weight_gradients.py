"""Weight-gradient analysis: each block's backward cut into input and weight halves, on the captured graph.

Zero-bubble schedules (``ir/schedule.py``) run a block's backward as two halves: the input half
(``I``, what the previous block waits for) and, later, the weight half (``W``,
``lowering/split_backward.py`` cuts each unit's joint graph the same way). This pass finds, per
block class of the captured backward graph:

- the weight half: the block's backward ops from which no path reaches another block's backward
  (their results only become the block's parameter gradients; ops no module issued are looked
  through);
- the bytes the weight half reads from elsewhere (saved activations and the input half's results,
  parameters and their views excluded, views counted once with their base): what a deferred
  weight half keeps alive per micro-batch, from ``I`` to ``W``.

The stage cost model prices the weight half with the block's own op costs (``backward_weight``)
and ``cost/schedule.py`` holds those bytes from ``I`` to ``W``.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch.fx as fx

from ..ir.program import MistProgram
from .cost_annotation import is_view, value_bytes
from .manager import PassResult, transforms


@dataclass(frozen=True)
class WeightSplit:
    """One block class's weight half: its backward nodes and the bytes it keeps from ``I`` to ``W``."""

    names: frozenset[str]
    stash: sympy.Expr


def _reaches_other_blocks(backward: fx.Graph, block_of: dict[str, int]) -> dict[fx.Node, bool]:
    """Per node: some path from it reaches a node of another block (nodes of no block looked through)."""
    reaches: dict[fx.Node, bool] = {}
    for node in reversed(list(backward.nodes)):
        own = block_of.get(node.name)
        found = False
        for user in node.users:
            if user.op == "output":
                continue
            theirs = block_of.get(user.name)
            if (theirs is not None and theirs != own) or reaches.get(user, False):
                found = True
                break
        reaches[node] = found
    return reaches


def _base(node: fx.Node, graphs: dict[str, fx.Node]) -> fx.Node:
    """The value ``node`` is a view of (following views, and a backward placeholder to the forward
    value it stands for)."""
    while True:
        if node.op == "placeholder" and node.name in graphs and graphs[node.name] is not node:
            node = graphs[node.name]
            continue
        if is_view(node) and node.args and isinstance(node.args[0], fx.Node):
            node = node.args[0]
            continue
        return node


def split_block(backward: fx.GraphModule, forward: fx.GraphModule, names: set[str], block_of: dict[str, int],
                params: set[str], symbols: dict[str, sympy.Symbol]) -> WeightSplit:
    """The weight half of the block whose backward nodes are ``names``."""
    reaches = _reaches_other_blocks(backward.graph, block_of)
    weight = {n for n in backward.graph.nodes if n.op == "call_function" and n.name in names and not reaches[n]}
    forward_nodes = {n.name: n for n in forward.graph.nodes}
    kept: dict[str, fx.Node] = {}
    for node in weight:
        for arg in node.all_input_nodes:
            if arg in weight:
                continue
            base = _base(arg, forward_nodes)
            if base.op == "placeholder" and base.name in params:
                continue  # a parameter (or a view of one): not an activation
            kept.setdefault(base.name, base)
    stash = sympy.Add(*(value_bytes(node, symbols) for node in kept.values()))
    return WeightSplit(frozenset(n.name for n in weight), sympy.expand(stash))


@transforms(MistProgram)
def weight_gradients(program: MistProgram) -> PassResult:
    """Pass: ``program.analysis.weight_split[class id]`` = the block class's :class:`WeightSplit`
    (after ``cost_annotation``, which attaches the live graphs)."""
    import copy
    from dataclasses import replace

    priced = program.analysis
    graphs = priced.graphs
    block_of = {name: cid for cid, names in graphs.blocks.items() for name in names}
    split = {cid: split_block(graphs.backward, graphs.forward, names, block_of, graphs.params, graphs.symbols)
             for cid, names in graphs.blocks.items()}
    result = copy.copy(program)
    result.analysis = replace(priced, weight_split=split)
    return PassResult(result, False)
