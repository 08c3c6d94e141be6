"""Cut the traced torch-level graph into regions: pre, one region per traced layer, post.

Input: dynamo's graph of capture's reduced model (one layer per group of identical layers), the
layer boundaries the markers recorded (:mod:`.boundaries`) and the groups. Output: a
:class:`~mist_compiler.ir.model_graph.ModelGraph`: for every graph input what it is (a parameter
or buffer of the real model and its name, a batch input, a batch/sequence size), and for every
layer which nodes it runs, which value it carries in and out and which shared values ("glue")
it reads. A layer whose value leaks anywhere but into the next layer, or code between layers,
cannot be pipelined and is refused here, naming the layer and the value.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.fx

from ..ir.model_graph import BUFFER, PARAMETER, LayerRegion, ModelGraph
from ..passes.block_discovery import module_paths
from .boundaries import LayerContractError

_CONTAINERS = {"_modules": None, "_parameters": PARAMETER, "_buffers": BUFFER}


class RegionError(ValueError):
    """The traced graph does not have the layer structure a pipeline needs."""


def source_path(source) -> tuple[str | None, list[str], str | None]:
    """(local variable, attribute path, PARAMETER | BUFFER | None) of a dynamo input source."""
    parts: list[str] = []
    kind = None
    while source is not None:
        name = type(source).__name__
        if name == "LocalSource":
            return source.local_name, list(reversed(parts)), kind
        if isinstance(getattr(source, "member", None), str):  # AttrSource and its subclasses
            if source.member in _CONTAINERS:
                kind = kind or _CONTAINERS[source.member]
            else:
                parts.append(source.member)
        elif name in ("DictGetItemSource", "GetItemSource"):
            index = getattr(source, "index", None)
            parts.append(str(index))
        source = getattr(source, "base", None)
    return None, list(reversed(parts)), kind


def batch_input_name(source) -> str | None:
    """``"input_ids"`` or ``"labels"`` when a graph input's dynamo ``source`` is that argument of the
    call (a local, or a key of ``**kwargs``), else None."""
    local, path, _ = source_path(source)
    name = path[-1] if local == "kwargs" and len(path) == 1 else local
    return name if name in ("input_ids", "labels") else None


def _source_name(source) -> str | None:
    name = getattr(source, "name", None)  # a method in older torch, a property in newer
    return name() if callable(name) else name


def classify_inputs(gm: torch.fx.GraphModule, model_arg: str, model_path: tuple[str, ...] = (),
                    error: type[Exception] = RegionError) -> tuple[dict, dict, dict]:
    """Per placeholder of ``gm``: a parameter or buffer of the module at ``model_path`` inside local
    ``model_arg`` (``tensors``: kind and path below it), a batch input (``batch``: ``input_ids`` or
    ``labels``) or a batch input's size (``sizes``: input and dimension). Any other input raises
    ``error``: capture's trace and dynamo's graph (``dynamo_graph``) name their inputs alike."""
    root = list(model_path)
    tensors, batch, sizes = {}, {}, {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        source = getattr(node, "_dynamo_source", None)
        local, path, kind = source_path(source)
        if type(source).__name__ == "TensorPropertySource" and batch_input_name(source.base) is not None:
            sizes[node.name] = (batch_input_name(source.base), int(source.idx))
        elif local == model_arg and path[:len(root)] == root and kind is not None:
            tensors[node.name] = (kind, ".".join(path[len(root):]))
        elif batch_input_name(source) is not None and isinstance(node.meta.get("example_value"), torch.Tensor):
            batch[node.name] = batch_input_name(source)
        else:
            raise error(f"capture: graph input {node.name} (from {_source_name(source)}) is neither a tensor of "
                        "the model, input_ids, labels nor one of their sizes")
    return tensors, batch, sizes


def _layer_of(node: torch.fx.Node, prefix: str) -> int | None:
    head = f"{prefix}." if prefix else ""
    for path in module_paths(node):
        if path.startswith(head):
            first = path[len(head):].split(".")[0]
            if first.isdigit():
                return int(first)
    return None


def _with_mode_switches(body: list[torch.fx.Node], layer_of: dict[str, int | None]) -> dict[str, int | None]:
    """Grad-mode switches (``with torch.no_grad()`` in a layer's code, as PhiMoE's router) carry no
    module stack: one between two nodes of the same layer belongs to that layer."""
    known = [(i, layer_of[n.name]) for i, n in enumerate(body) if layer_of[n.name] is not None]
    for i, node in enumerate(body):
        if layer_of[node.name] is not None or node.op != "call_function" or node.target is not torch._C._set_grad_enabled:
            continue
        before = [layer for j, layer in known if j < i][-1:]
        after = [layer for j, layer in known if j > i][:1]
        if before and before == after:
            layer_of[node.name] = before[0]
    return layer_of


def layer_of_nodes(body: list[torch.fx.Node], layer_list: str) -> dict[str, int | None]:
    """Per node name, the index of the layer of ``layer_list`` whose code issued it (None: outside)."""
    return _with_mode_switches(body, {n.name: _layer_of(n, layer_list) for n in body})


def _region(index: int, layers: tuple[int, ...], nodes: list[torch.fx.Node], carried_in: str, carried_out: str,
            tensors: dict, prefix: str, hidden_users: set[str], own_weights: bool = True) -> LayerRegion:
    members = {n.name for n in nodes}
    own = f"{prefix}.{index}." if prefix else f"{index}."
    params: dict[str, str] = {}
    glue: list[str] = []
    for node in nodes:
        for arg in node.all_input_nodes:
            as_hidden = arg.name == carried_in and node.name in hidden_users
            if arg.name in members or as_hidden or arg.name in params or arg.name in glue:
                continue
            if arg.name in tensors and tensors[arg.name][1].startswith(own):
                params[arg.name] = tensors[arg.name][1][len(own):]
            elif arg.name in tensors and tensors[arg.name][0] == PARAMETER and own_weights:
                raise RegionError(f"layer {prefix}.{layers[0]} reads the parameter {tensors[arg.name][1]} of "
                                  "another module; a pipeline needs every layer to own its weights")
            else:
                glue.append(arg.name)
    if carried_out not in members and carried_out != carried_in:
        raise RegionError(f"layer {prefix}.{layers[0]}: its output {carried_out} is not computed inside the layer")
    return LayerRegion(index, layers, tuple(n.name for n in nodes), carried_in, carried_out, tuple(glue), params,
                       frozenset(hidden_users))


def find_regions(gm: torch.fx.GraphModule, boundaries, layer_list: str, layer_groups: tuple,
                 model_arg: str = "model", own_weights: bool = True, inputs: tuple | None = None) -> ModelGraph:
    """The :class:`ModelGraph` of ``gm`` (see the module docstring); ``own_weights=False`` accepts
    layers sharing weights (capture's chain check runs the same layers twice); ``inputs``: what the
    graph inputs are, ``(tensors, batch, sizes)``, when the caller has named them already (a graph
    cut from dynamo's, whose sources still name the layers of the real model)."""
    tensors, batch, sizes = inputs if inputs is not None else classify_inputs(gm, model_arg)
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    layer_of = layer_of_nodes(body, layer_list)
    traced = sorted(boundaries.inputs)
    if traced != list(range(len(layer_groups))) or sorted(boundaries.outputs) != traced:
        raise RegionError(f"capture: the layers of {layer_list} did not all run once in the forward "
                          f"(entered {sorted(boundaries.inputs)}, left {sorted(boundaries.outputs)})")
    positions = [i for i, n in enumerate(body) if layer_of[n.name] is not None]
    first, last = positions[0], positions[-1]
    stray = [n.name for n in body[first:last + 1] if layer_of[n.name] is None]
    if stray:
        raise RegionError(f"capture: code runs between the layers of {layer_list} ({stray[:3]}); "
                          "a pipeline needs the layers called back to back")
    regions = []
    for index in traced:
        nodes = [n for n in body if layer_of[n.name] == index]
        regions.append(_region(index, tuple(layer_groups[index]), nodes, boundaries.inputs[index],
                               boundaries.outputs[index], tensors, layer_list,
                               boundaries.input_users.get(index, set()), own_weights))
    for region in regions:
        _check_only_output_leaves(gm, region, layer_list)
    num_layers = sum(len(group) for group in layer_groups)
    pre = tuple(n.name for n in body[:first])
    post = tuple(n.name for n in body[last + 1:])
    return ModelGraph(gm, layer_list, num_layers, regions, pre, post, tensors, batch, sizes)


def _check_only_output_leaves(gm: torch.fx.GraphModule, region: LayerRegion, prefix: str) -> None:
    members = set(region.nodes)
    by_name = {n.name: n for n in gm.graph.nodes}
    for name in region.nodes:
        if name == region.carried_out:
            continue
        outside = [u.name for u in by_name[name].users if u.name not in members]
        if outside:
            raise RegionError(f"layer {prefix}.{region.layers[0]}: its value {name} is used outside the layer "
                              f"({outside[:3]}); a pipeline stage can only pass on the layer's output")


def with_real_names(graph: ModelGraph, layer_groups: tuple) -> ModelGraph:
    """Tensors of traced layer ``i`` are named in the reduced model (``layers.<i>``); name every
    tensor outside the layers as in the real model (the reduced model only renumbers layers)."""
    own_prefix = f"{graph.layer_list}." if graph.layer_list else ""
    tensors = {}
    for placeholder, (kind, name) in graph.tensors.items():
        rest = name[len(own_prefix):] if name.startswith(own_prefix) else None
        index = rest.split(".")[0] if rest else None
        if index is not None and index.isdigit():
            real = int(layer_groups[int(index)][0])
            name = f"{own_prefix}{real}.{rest.split('.', 1)[1]}"
        tensors[placeholder] = (kind, name)
    return replace(graph, tensors=tensors)


__all__ = ["LayerContractError", "RegionError", "batch_input_name", "classify_inputs", "find_regions", "layer_of_nodes",
           "source_path", "with_real_names"]
