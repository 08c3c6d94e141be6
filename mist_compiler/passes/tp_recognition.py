"""Tensor-parallel recognition: the one place that decides how a model is split over TP ranks.

A data-flow pass over the torch-level graph capture produced (the program that runs). Every
value of a layer gets a state (:mod:`.tp_walk`): ``R`` replicated, ``S`` split along one
dimension over the ranks (features, heads), ``P`` a partial sum, ``C`` not an activation.
Megatron's rules follow from it (:mod:`.tp_rules`, :mod:`.tp_mixing`):

- a linear whose input is ``R`` is **column-parallel** (weight and bias split along the output
  features; its input reaches it through *f*, ``copy_in``: the input's gradient is all-reduced)
  or **replicated** (a choice, below); with a feature-split input it is **row-parallel** (weight
  split along the input features, output ``P``, its bias added once after the all-reduce).
  ``nn.Linear``, GPT-2's ``Conv1D`` (``addmm``) and ``x @ W.T`` (Falcon) alike;
- views move the split to the output dimension holding the same elements (also into and out of
  a merged ``batch * heads`` dimension, Bloom), and a head count written as a number is divided
  by the degree (``divide_arg``); a fused projection that is split, sliced or viewed into parts
  (``q|k|v`` with grouped key/value heads, ``gate|up``, ``view(B, T, 3, h, d)``) is split part
  by part (the weight's ``segments``); transposes and elementwise code keep the split;
- replicated values meeting split ones: broadcast along the split (a norm's per-head weight, a
  scale, one key/value head) their gradient is all-reduced (*f* again); of full size, a
  parameter is split like the value, any other value computed from the layer's inputs (an ALiBi
  table, a mask, a shared rotary key) is read as this rank's part (``scatter``);
- a sum over the split is a partial sum, a mean the same divided by the degree (``reduce_mean``):
  normalisations over the full split width (q/k norms) get their statistics all-reduced;
  ``layer_norm``/``rms_norm`` there become tensor-parallel norms (``tp_norm``);
- a partial sum stays partial through additions of partial sums and is all-reduced
  (``reduce_out``, Megatron's *g*) where anything else reads it, or where the layer ends.

**Choices.** A linear reading a replicated value may be column-parallel or replicated (a router
whose scores are a softmax over experts, a low-rank projection normalised over its full width
before an up-projection splits the heads), and a view may place a split in several ways. The
walk takes the first option everywhere; where no rule holds it fails naming the choices the
failing values depend on, and :func:`recognise_region` searches (cheapest first: replicating the
fewest weight elements) over those choices until a walk succeeds. Replicated linears are
recorded with the failure that made them so. A layer in which no choice splits anything adds
nothing; a model with no split at all gets tp = 1 only, with the first failure as its reason
(naming the layer, the op and the user's source line). The outcome
(:class:`~mist_compiler.ir.model_graph.TensorParallelPlan`, assembled by ``tp_model``) is what the
cost model prices and what ``tp_sharding`` applies; ``verify.tp_check`` proves it on the model.
"""
from __future__ import annotations

import heapq
import itertools

import torch.fx as fx

from ..ir.model_graph import RegionSharding
from .tp_mixing import activation_matmul, attention, concat, dropout, normalisation, reduction, size, size_arithmetic
from .tp_rules import (ALONG_DIM, EXPANDS, LIKE, LINEAR, NEW, NORMS, POINTWISE, REDUCTIONS, REORDERS, SDPA, SPLITS,
                       VIEWS, expand, factory, getitem, map_view_dim, pointwise, pointwise_body, reorder, split, view, weight_matmul,
                       weight_of)
from .tp_walk import (C, P, R, NotShardable, Walk, is_sharded, is_tensor_value, op_of, shape_of, split_dim,
                      value_of)

FUSED_LOSS = "linear_cross_entropy.default"  # op_of(torch.ops.mist.linear_cross_entropy.default)
MAX_ATTEMPTS = 64  # walks the search over choices may take per region


def step(walk: Walk, node: fx.Node) -> None:
    """Set the state of ``node`` from its inputs' (the rules of the module docstring), and what it
    depends on."""
    if node.name not in walk.decided:
        _apply_rule(walk, node)
    inputs = node.all_input_nodes
    own = frozenset({node.name}) if node.name in walk.options else frozenset()
    walk.origin[node.name] = walk.blame_of(inputs) | own
    if any(a.name in walk.reduced for a in inputs):
        walk.reduced.add(node.name)


def _apply_rule(walk: Walk, node: fx.Node) -> None:
    op = op_of(node)
    if size_arithmetic(walk, node):
        return
    tensors = [a for a in node.all_input_nodes if is_tensor_value(value_of(a))]
    states = [walk.state(a) for a in tensors]
    if not any(s in (R, P) or is_sharded(s) for s in states):
        walk.states[node.name] = C  # nothing of the activations flows here
        return
    if op in LINEAR | {"addmm", "matmul", "mm"} and weight_of(node, walk.params) is not None:
        return weight_matmul(walk, node)
    if op in ("add", "sub", "iadd", "isub") and states and all(s == P for s in states):
        walk.states[node.name] = P
        walk.read_partial.update(a.name for a in tensors)
        biases = tuple(b for a in tensors for b in walk.pending_bias.pop(a.name, ()))
        if biases:
            walk.pending_bias[node.name] = biases
        means = [a.name in walk.means for a in tensors]
        if any(means) and not all(means):
            walk.fail(node, "adds a mean over split features to a sum over them")
        if all(means):
            walk.means.add(node.name)
        return
    states = walk.full_inputs(node)
    if all(s in (R, C) for s in states):
        walk.states[node.name] = R
        return
    if op in VIEWS:
        return view(walk, node, op)
    if op in EXPANDS:
        return expand(walk, node, op)
    if op in NEW or op in LIKE:
        return factory(walk, node, op)
    if op in REORDERS:
        return reorder(walk, node, op)
    if op == "getitem":
        return getitem(walk, node)
    if op in SPLITS:
        return split(walk, node, op)
    if op in SDPA or op == "counter_attention":
        return attention(walk, node)
    if op == "counter_dropout":
        return dropout(walk, node)
    if op in ("cat", "stack", "concat"):
        return concat(walk, node, op)
    if op == "repeat_interleave":
        walk.states[node.name] = walk.state(node.args[0])
        return
    if op in ("matmul", "bmm", "baddbmm"):
        return activation_matmul(walk, node)
    if op in NORMS:
        return normalisation(walk, node, op)
    if op in REDUCTIONS or op in ALONG_DIM:
        return reduction(walk, node, op, along=op in ALONG_DIM)
    if op in ("size", "dim", "numel"):
        return size(walk, node) if op == "size" else walk.states.__setitem__(node.name, C)
    if op in POINTWISE or (op == "autograd_function_apply" and pointwise_body(walk, node)):
        return pointwise(walk, node, tensors)
    walk.fail(node, f"is not known to the tensor-parallel rules (input states {states})")


def _walk(graph: fx.Graph, nodes: list[fx.Node], inputs: list[str], params: set[str], label: str, output: str,
          choices: dict[str, int]) -> Walk:
    """One walk of the region under ``choices``; its output must end replicated."""
    walk = Walk(graph, label, params, dict(choices))
    for name in inputs:
        walk.states[name] = R
    try:
        for node in nodes:
            step(walk, node)
        out = next((n for n in nodes if n.name == output), None)
        if out is not None and walk.state(out) == P:
            walk.reduce(out)
        if out is not None and is_sharded(walk.state(out)):
            raise NotShardable(f"{label}: its output {output} would be split over the ranks", walk.blame_of([out]))
    except NotShardable as error:
        error.walk = walk
        raise
    by_name = {n.name: n for n in graph.nodes}
    unused = sorted(p for p in params if p not in walk.sharding.shards and p not in walk.replicated
                    and _used_as_weight(by_name.get(p), params))
    if unused:
        raise NotShardable(f"{label}: weights {unused} are on no column/row-parallel path")
    return walk


def recognise_region(graph: fx.Graph, nodes: list[fx.Node], inputs: list[str], params: set[str], label: str,
                     output: str) -> tuple[RegionSharding, list[int]]:
    """The split of one layer region: the first walk to succeed in a search over the choices,
    cheapest first (see the module docstring). Raises the first walk's ``NotShardable`` when no
    choice succeeds."""
    counter = itertools.count()
    frontier: list = [(0, next(counter), {}, {})]
    tried: set[frozenset] = set()
    first: NotShardable | None = None
    while frontier and len(tried) < MAX_ATTEMPTS:
        cost, _, choices, reasons = heapq.heappop(frontier)
        key = frozenset(choices.items())
        if key in tried:
            continue
        tried.add(key)
        try:
            walk = _walk(graph, nodes, inputs, params, label, output, choices)
        except NotShardable as error:
            first = first or error
            failed = getattr(error, "walk", None)
            for point in error.blame if failed is not None else ():
                option = choices.get(point, 0) + 1
                if option < failed.options.get(point, 0):
                    heapq.heappush(frontier, (cost + failed.costs[point], next(counter), {**choices, point: option},
                                              {**reasons, point: str(error)}))
            continue
        walk.sharding.replicated = {weight: reasons.get(linear, "") for weight, linear in walk.replicated.items()}
        return walk.sharding, walk.sizes
    raise first if first is not None else NotShardable(f"{label}: no split found in {MAX_ATTEMPTS} attempts")


def _used_as_weight(node: fx.Node | None, params: set[str]) -> bool:
    if node is None:
        return False
    for user in node.users:
        found = weight_of(user, params)
        if found is not None and found[1] is node:
            return True
        if op_of(user) in ("getattr", "t", "transpose") and any(
                (weight_of(u, params) or (None, None))[1] is node for u in user.users):
            return True
    return False


# names other passes use
_Walk, _step, _shape = Walk, step, shape_of

__all__ = ["FUSED_LOSS", "NotShardable", "P", "R", "map_view_dim", "recognise_region", "split_dim", "step"]
