"""Layer boundaries in the traced graph: which value enters each layer and which leaves it.

Before tracing, every layer of the layer list gets a forward pre-hook and a forward hook that
pass its hidden state through :func:`layer_boundary`, an identity dynamo keeps as a graph node
(``allow_in_graph``). In the torch-level graph dynamo hands the backend, the boundary nodes name
exactly the value a layer receives (its first tensor argument, the residual stream) and the one
it returns (its output, or the first tensor of a returned tuple); everything else a layer reads
from outside (rotary tables, masks, sizes) is shared "glue". :func:`strip_boundaries` records
those values and removes the markers, so the analysed graph holds no trace of them.

This is the contract a pipeline needs of a layer: ``layer(hidden, *glue) -> hidden``.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn

HIDDEN_KWARGS = ("hidden_states", "hidden", "x", "inputs", "input")


class LayerContractError(ValueError):
    """A layer whose hidden state cannot be found (the message names the layer)."""


@torch._dynamo.allow_in_graph
def layer_boundary(value: torch.Tensor, side: int, layer: int) -> torch.Tensor:
    """Identity marker: ``side`` 0 is the value entering layer ``layer``, 1 the value leaving it."""
    return value.view_as(value)


def hidden_argument(args: tuple, kwargs: dict, path: str) -> int | str:
    """Where a layer call passes its hidden state: the first positional argument (0) when it is a
    tensor, else the first of :data:`HIDDEN_KWARGS` given as a tensor (its name)."""
    if args and isinstance(args[0], torch.Tensor):
        return 0
    for key in HIDDEN_KWARGS:
        if isinstance(kwargs.get(key), torch.Tensor):
            return key
    raise LayerContractError(
        f"layer {path} is called without a tensor as its first argument (or hidden_states=...); "
        "a pipeline stage needs layers called as layer(hidden, ...)")


def hidden_output(output: Any, path: str) -> torch.Tensor:
    """The hidden state a layer returns: the output itself or the first item of a returned tuple."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise LayerContractError(f"layer {path} returns {type(output).__name__}; a pipeline stage needs a tensor "
                             "(or a tuple whose first item is the hidden state)")


def _mark_inputs(layer_index: int, path: str):
    def hook(module: nn.Module, args: tuple, kwargs: dict):
        where = hidden_argument(args, kwargs, path)
        if where == 0:
            return (layer_boundary(args[0], 0, layer_index), *args[1:]), kwargs
        return args, {**kwargs, where: layer_boundary(kwargs[where], 0, layer_index)}
    hook.mist_boundary = True
    return hook


def _mark_output(layer_index: int, path: str):
    def hook(module: nn.Module, args: tuple, output: Any):
        marked = layer_boundary(hidden_output(output, path), 1, layer_index)
        return marked if isinstance(output, torch.Tensor) else type(output)([marked, *output[1:]])
    hook.mist_boundary = True
    return hook


def private_hook_tables(layer: nn.Module) -> None:
    """Give a (copied) layer hook tables of its own, without markers an earlier call installed:
    hooks registered on it from now on are not seen by the module it was copied from."""
    def own(table: dict) -> OrderedDict:
        return OrderedDict((k, v) for k, v in table.items() if not getattr(v, "mist_boundary", False))

    layer._forward_pre_hooks = own(layer._forward_pre_hooks)
    layer._forward_pre_hooks_with_kwargs = OrderedDict(layer._forward_pre_hooks_with_kwargs)
    layer._forward_hooks = own(layer._forward_hooks)
    layer._forward_hooks_with_kwargs = OrderedDict(layer._forward_hooks_with_kwargs)
    layer._forward_hooks_always_called = OrderedDict(layer._forward_hooks_always_called)


def install_boundary_hooks(layers: nn.ModuleList, path: str) -> None:
    """Hook every layer of ``layers`` (modules of capture's own copy: their hook tables are made
    private first, so the user's modules never see these hooks)."""
    for index, layer in enumerate(layers):
        private_hook_tables(layer)
        layer.register_forward_pre_hook(_mark_inputs(index, f"{path}.{index}"), with_kwargs=True)
        layer.register_forward_hook(_mark_output(index, f"{path}.{index}"))


@dataclass
class Boundaries:
    """Per traced layer: the graph value entering it and the one leaving it (node names)."""

    inputs: dict[int, str] = field(default_factory=dict)
    outputs: dict[int, str] = field(default_factory=dict)
    # per layer, the nodes that read its hidden state (through the marker); other reads of the same
    # value, if any, pass it as something else (an embedding every layer reads again)
    input_users: dict[int, set[str]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.inputs)


def strip_boundaries(gm: torch.fx.GraphModule) -> Boundaries:
    """Record and remove the boundary markers of a dynamo graph (in place)."""
    found = Boundaries()
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not layer_boundary:
            continue
        value, side, layer = node.args[0], int(node.args[1]), int(node.args[2])
        table = found.inputs if side == 0 else found.outputs
        if layer in table:
            raise LayerContractError(f"layer {layer} is called more than once in one forward; "
                                     "a pipeline needs each layer called once")
        # a value passed straight from one layer to the next is the previous marker: use its source
        table[layer] = value.name
        if side == 0:
            found.input_users[layer] = {user.name for user in node.users}
        node.replace_all_uses_with(value)
        gm.graph.erase_node(node)
    gm.recompile()
    return found
