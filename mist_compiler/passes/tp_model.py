"""Tensor-parallel recognition of a whole model: the layers (``tp_recognition.recognise_region``,
one region per layer group), the token embedding split over the vocabulary, and the head that
only feeds the loss (column-parallel with a vocabulary-parallel cross-entropy, or the fused
``mist::linear_cross_entropy`` over the head's vocabulary rows). A tied embedding/head is split
only when both sides are. The outcome (:class:`~mist_compiler.ir.model_graph.TensorParallelPlan`)
is what the cost model prices and what ``tp_sharding`` applies.
"""
from __future__ import annotations

import math
import operator

import torch.fx as fx

from ..ir.model_graph import PARAMETER, GraphEdit, ModelGraph, RegionSharding, ShardSpec, TensorParallelPlan
from .tp_recognition import (FUSED_LOSS, P, R, NotShardable, _shape, _step, _Walk, is_sharded, op_of,
                             recognise_region)


def recognise_pre(model: ModelGraph) -> RegionSharding:
    """The token embedding, indexed by ``input_ids``, split over the vocabulary (else nothing)."""
    sharding = RegionSharding()
    ids = {p for p, name in model.batch_inputs.items() if name == "input_ids"}
    by_name = model._by_name()
    for name in model.pre:
        node = by_name[name]
        if op_of(node) != "embedding":
            continue
        index, weight = node.args[0], node.args[1]
        if not (isinstance(weight, fx.Node) and model.tensors.get(weight.name, ("", ""))[0] == PARAMETER):
            continue
        if derives_from(index, ids):
            sharding.shards[weight.name] = ShardSpec(0)
            sharding.edits.append(GraphEdit(node.name, "vocab_embedding"))
    return sharding


def derives_from(node, sources: set[str]) -> bool:
    """Whether ``node`` reads (through any chain of inputs) a node named in ``sources``."""
    todo, seen = [node], set()
    while todo:
        current = todo.pop()
        if not isinstance(current, fx.Node) or current.name in seen:
            continue
        if current.name in sources:
            return True
        seen.add(current.name)
        todo.extend(current.all_input_nodes)
    return False


def recognise_post(model: ModelGraph) -> RegionSharding:
    """The head that only feeds the cross-entropy: column-parallel with a vocabulary-parallel loss."""
    by_name = model._by_name()
    params = {p for p, (kind, _) in model.tensors.items() if kind == PARAMETER}
    walk = _Walk(model.graph.graph, "post", params)
    walk.states[model.regions[-1].carried_out] = R
    losses = []
    try:
        for name in model.post:
            node = by_name[name]
            op = op_of(node)
            if op == "cross_entropy" and is_sharded(walk.state(node.args[0])):
                _vocab_loss(walk, node)
                losses.append(node.name)
                continue
            if op == FUSED_LOSS and walk.state(node.args[0]) == R and node.args[1].name in params:
                _vocab_fused_loss(walk, node)
                losses.append(node.name)
                continue
            _step(walk, node)
    except NotShardable:
        return RegionSharding()
    if not losses or any(is_sharded(walk.state(by_name[n])) or walk.state(by_name[n]) == P for n in model.post[-1:]):
        return RegionSharding()
    return walk.sharding


def _vocab_loss(walk: _Walk, node: fx.Node) -> None:
    names = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
    kwargs = {**dict(zip(names, node.args)), **node.kwargs}
    logits = kwargs["input"]
    if walk.state(logits)[1] != len(_shape(logits)) - 1 or len(_shape(logits)) != 2:
        walk.fail(node, "reads logits split elsewhere than their last dimension")
    if kwargs.get("weight") is not None or kwargs.get("label_smoothing", 0.0) not in (0, 0.0):
        walk.fail(node, "uses class weights or label smoothing (not split over the vocabulary)")
    if kwargs.get("reduction", "mean") not in ("mean", "sum"):
        walk.fail(node, f"uses reduction={kwargs.get('reduction')!r}")
    walk.edit(node, "vocab_loss", data=(kwargs.get("ignore_index", -100), kwargs.get("reduction", "mean")))
    walk.states[node.name] = R


def _vocab_fused_loss(walk: _Walk, node: fx.Node) -> None:
    """``mist::linear_cross_entropy(hidden, weight, labels, ignore_index, reduction)`` (the head fused
    with its loss, ``ops.fuse``): the weight split over the vocabulary rows, run by
    ``tp.linear_cross_entropy`` (which all-reduces the hidden gradient itself: no ``copy_in``)."""
    if any(not (user.target is operator.getitem and user.args[1] == 0) for user in node.users):
        walk.fail(node, "reads more of the fused loss than the loss itself")
    walk.sharding.shards[node.args[1].name] = ShardSpec(0)
    walk.edit(node, "vocab_fused_loss", data=(node.args[3], node.args[4]))
    walk.states[node.name] = R


def recognise(model: ModelGraph) -> TensorParallelPlan:
    """The tensor-parallel plan of a captured model (see the module docstring)."""
    regions: dict[str, RegionSharding] = {}
    sizes: list[int] = []
    by_name = model._by_name()
    try:
        for region in model.regions:
            nodes = [by_name[n] for n in region.nodes]
            params = {p for p in region.params if model.tensors[p][0] == PARAMETER}
            sharding, found = recognise_region(model.graph.graph, nodes, [region.carried_in, *region.glue], params,
                                               f"layer {model.layer_list}.{region.layers[0]}", region.carried_out)
            regions[region.label] = sharding
            sizes += found
    except NotShardable as error:
        return TensorParallelPlan(False, str(error))
    if not any(r.shards for r in regions.values()):
        return TensorParallelPlan(False, f"no linear layer of {model.layer_list} can be split column/row-parallel")
    pre, post = recognise_pre(model), recognise_post(model)
    tied = set(pre.shards) & {p for p in model.tensors if p in _post_params(model)}
    if tied and not set(pre.shards) <= set(post.shards):
        pre = RegionSharding()  # a tied embedding is split only together with its head
    if set(post.shards) & set(_pre_params(model)) and not set(post.shards) & set(pre.shards):
        post = RegionSharding()
    # the vocabulary is split only where the degree divides it (else embedding and head stay whole):
    # it does not limit the degree
    regions["pre"], regions["post"] = pre, post
    granularity = math.gcd(*sizes) if sizes else 0
    return TensorParallelPlan(True, "", regions, granularity)


def _pre_params(model: ModelGraph) -> set[str]:
    by_name = model._by_name()
    return {a.name for n in model.pre for a in by_name[n].all_input_nodes if a.name in model.tensors}


def _post_params(model: ModelGraph) -> set[str]:
    by_name = model._by_name()
    return {a.name for n in model.post for a in by_name[n].all_input_nodes if a.name in model.tensors}


__all__ = ["derives_from", "recognise"]
