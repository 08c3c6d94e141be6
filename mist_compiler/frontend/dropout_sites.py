"""Dropout sites of the captured program, rewritten so that every plan draws one process's masks.

Each ``F.dropout(x, p, training=True)`` with ``p > 0`` and each ``scaled_dot_product_attention``
with ``dropout_p > 0`` in the torch-level graph becomes :func:`~mist_compiler.ops.dropout.counter_dropout`
/ :func:`~mist_compiler.ops.dropout.counter_attention`, whose mask is a hash of the sample's seed
(a new batch input, ``dropout_seeds``: the runtime derives it from the step and the sample's
global index), the layer, the site and the element's position. A site is numbered within its
block (the part before the layers, a layer, the part after) in graph order: the order the
model's code runs them, which is also how ``verify.check``'s reference numbers the calls it sees.
Layers of one class share their program, so a layer's index reaches its sites as an input
(``ModelGraph.layer_index``, a glue value the partition replaces by each layer's own constant).
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.fx as fx

from ..ir.model_graph import DROPOUT_SEEDS, LAYER_CONSTANT, ModelGraph
from ..ops.dropout import counter_attention, counter_dropout

_DROPOUT_NAMES = {"dropout", "dropout_"}
_ATTENTION_NAMES = {"scaled_dot_product_attention"}


def _kwargs(node: fx.Node, names: tuple[str, ...]) -> dict:
    return {**dict(zip(names, node.args)), **node.kwargs}


def dropout_of(node: fx.Node) -> dict | None:
    """``{input, p}`` of a training-mode dropout with ``p > 0``, else None."""
    if node.op != "call_function" or getattr(node.target, "__name__", "") not in _DROPOUT_NAMES:
        return None
    kwargs = _kwargs(node, ("input", "p", "training", "inplace"))
    p, training = kwargs.get("p", 0.5), kwargs.get("training", True)
    if not isinstance(p, (int, float)) or not isinstance(training, bool):
        return None
    return {"input": kwargs["input"], "p": float(p)} if p > 0 and training else None


def attention_dropout_of(node: fx.Node) -> dict | None:
    """The arguments of ``scaled_dot_product_attention`` with ``dropout_p > 0``, else None."""
    if node.op != "call_function" or getattr(node.target, "__name__", "") not in _ATTENTION_NAMES:
        return None
    kwargs = _kwargs(node, ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"))
    p = kwargs.get("dropout_p", 0.0)
    return kwargs if isinstance(p, (int, float)) and p > 0 else None


def seed_dropout(model: ModelGraph) -> ModelGraph:
    """The model graph with its dropout sites rewritten (see the module docstring); unchanged when
    it has none."""
    old = model.graph.graph
    if not any(dropout_of(n) or attention_dropout_of(n) for n in old.nodes):
        return model
    graph = fx.Graph()
    graph.output(graph.graph_copy(old, {}))  # node names are kept: the regions name them
    seeds, layer_index = _add_inputs(graph, model)
    block_of = {name: ("layer", region) for region in model.regions for name in region.nodes}
    counters: dict[object, int] = {}
    regions_with_sites: set[int] = set()
    for node in list(graph.nodes):
        found = dropout_of(node) or attention_dropout_of(node)
        if found is None:
            continue
        _, region = block_of.get(node.name, (None, None))
        if region is not None:
            block, layer = region.traced, layer_index
            regions_with_sites.add(region.traced)
        else:
            block = "pre" if node.name in model.pre else "post"
            layer = -1 if block == "pre" else model.num_layers
        site = counters.get(block, 0)
        counters[block] = site + 1
        if "query" in found:  # rewritten in place: its name, users and metadata stay
            kwargs = {k: v for k, v in found.items() if k not in ("query", "key", "value")}
            node.target, node.args = counter_attention, (found["query"], found["key"], found["value"])
            node.kwargs = {**kwargs, "seeds": seeds, "layer": layer, "site": site}
        else:
            node.target, node.args, node.kwargs = counter_dropout, (found["input"], found["p"], seeds, layer, site), {}
    graph.lint()
    module = fx.GraphModule(model.graph, graph)
    for index in range(model.num_layers):
        setattr(module, LAYER_CONSTANT.format(index), torch.tensor(index, dtype=torch.int64))
    regions = [replace(r, glue=(*r.glue, seeds.name, layer_index.name)) if r.traced in regions_with_sites else r
               for r in model.regions]
    return replace(model, graph=module, regions=regions, batch_inputs={**model.batch_inputs, seeds.name: DROPOUT_SEEDS},
                   layer_index=layer_index.name)


def _add_inputs(graph: fx.Graph, model: ModelGraph) -> tuple[fx.Node, fx.Node]:
    """The seeds placeholder (``[batch]`` int64, after the other inputs) and the layer index one."""
    ids = next(n for n in graph.nodes if n.op == "placeholder" and model.batch_inputs.get(n.name) == "input_ids")
    example = ids.meta["example_value"]
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last):
        seeds = graph.placeholder("mist_dropout_seeds")
    with graph.inserting_after(seeds):
        layer = graph.placeholder("mist_layer_index")
    with example.fake_mode:
        seeds.meta["example_value"] = torch.empty(example.shape[0], dtype=torch.int64)
        layer.meta["example_value"] = torch.empty((), dtype=torch.int64)
    return seeds, layer


__all__ = ["attention_dropout_of", "dropout_of", "seed_dropout"]
