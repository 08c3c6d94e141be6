"""Prove that a model's layers run back to back, each on the previous one's hidden state.

Capture traces one representative per group of identical layers, so its graph cannot show code
that runs *between* two layers of the real model (a scale, a per-layer mask, an auxiliary loss)
or a layer that reads something the layer before it returned besides its hidden state. A
pipeline runs the layers as regions of that graph, so such code would silently be lost.

:func:`prove_layer_chain` runs one eager forward of the reduced model (FakeTensor weights: no
memory, no arithmetic) whose layer list runs the kept layers in the model's own order of groups,
long enough that every pair of neighbouring groups the model has meets once
(:func:`chain_order`), and watches it with a ``TorchFunctionMode``:

- any torch call returning a tensor after one layer returns and before the next is called is
  code between layers, reported with the user's source line;
- the next layer must be called on the very tensor the previous layer returned as its hidden
  state, and must read none of the other tensors the layers before it returned.

An eager forward rather than a second dynamo trace: it sees the same torch-level calls the traced
graph would hold, at about a tenth of the cost (the trace of a 22B model's layer list twice over
took 1.5 s of capture's 5 s).
"""
from __future__ import annotations

import copy
import os
import sys
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from .boundaries import hidden_argument, hidden_output, private_hook_tables
from .regions import RegionError

_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _user_line() -> str:
    """``file:line`` of the innermost frame that is neither torch's nor ours (the user's code)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith((_TORCH_DIR, _OWN_DIR)) and not name.startswith("<"):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return "unknown location"


def _holds_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) or (
        isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value))


class _ChainWatch(TorchFunctionMode):
    """Watches one forward of a layer list: what runs between layers and what each layer reads."""

    def __init__(self, layer_list: str, names: list[str]) -> None:
        super().__init__()
        self.layer_list, self.names = layer_list, names
        self.depth = 0  # layers currently running
        self.ran: list[int] = []  # layers (positions in the repeated list) in the order they returned
        self.last_hidden: torch.Tensor | None = None
        self.other_outputs: dict[int, tuple[torch.Tensor, int]] = {}  # id -> (tensor kept alive, layer)
        self.between: list[str] = []  # torch calls since the last layer returned

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if self.depth == 0 and self.ran and _holds_tensor(result):
            self.between.append(f"{getattr(func, '__name__', func)} at {_user_line()}")
        return result

    def entering(self, position: int, args: tuple, kwargs: dict) -> None:
        name = self.names[position]
        where = hidden_argument(args, kwargs, name)
        if self.ran:
            before = self.names[self.ran[-1]]
            if self.between:
                raise RegionError(f"capture: code runs between the layers of {self.layer_list} (after {before}: "
                                  f"{'; '.join(self.between[:3])}); a pipeline needs the layers called back to back")
            if (args[0] if where == 0 else kwargs[where]) is not self.last_hidden:
                raise RegionError(f"capture: {name} is not called on the hidden state {before} returned; a pipeline "
                                  "needs each layer called on the previous layer's output")
            for value in tree_leaves((args, kwargs)):
                if isinstance(value, torch.Tensor) and id(value) in self.other_outputs:
                    source = self.names[self.other_outputs[id(value)][1]]
                    raise RegionError(f"capture: {name} reads a tensor {source} returned besides its hidden state; "
                                      "a pipeline stage can only pass on the hidden state")
        self.depth += 1

    def left(self, position: int, output: Any) -> None:
        self.depth -= 1
        hidden = hidden_output(output, self.names[position])
        for value in tree_leaves(output):
            if isinstance(value, torch.Tensor) and value is not hidden:
                self.other_outputs[id(value)] = (value, position)
        self.last_hidden, self.between = hidden, []
        self.ran.append(position)


def _watch(layer: nn.Module, position: int, watch: _ChainWatch) -> None:
    private_hook_tables(layer)  # the copy's hooks are its own: the kept layer never sees these
    layer.register_forward_pre_hook(lambda _m, args, kwargs: watch.entering(position, args, kwargs),
                                    with_kwargs=True, prepend=True)  # before the user's own pre-hooks
    layer.register_forward_hook(lambda _m, _args, output: watch.left(position, output))  # after the user's hooks


def chain_order(groups: list[tuple[int, ...]]) -> list[int]:
    """Which kept layer (group) to run at each position of the proof: the model's own order of
    groups, cut after the shortest prefix in which every pair of neighbours the model has occurs
    (a uniform stack: two layers; alternating kinds: three; dense then MoE layers: the first MoE
    layer twice). Never longer than the model, whose forward may run only that many layers."""
    group_of = {layer: g for g, members in enumerate(groups) for layer in members}
    order = [group_of[layer] for layer in sorted(group_of)]
    pairs = set(zip(order, order[1:]))
    seen: set[tuple[int, int]] = set()
    for end in range(1, len(order)):
        seen.add((order[end - 1], order[end]))
        if seen == pairs and set(order[:end + 1]) == set(order):
            return order[:end + 1]
    return order


def prove_layer_chain(run_forward, layers: nn.ModuleList, layer_list: str, real_names: list[str],
                      groups: list[tuple[int, ...]] | None = None) -> None:
    """Run ``run_forward(repeated)`` once, where ``repeated`` runs the kept ``layers`` in the order
    :func:`chain_order` gives (shallow copies sharing the weights; without ``groups``, the kept
    layers twice over), and raise :class:`RegionError` naming the layer unless the layers ran back
    to back as a pipeline needs. ``real_names[i]`` names kept layer ``i`` in the model."""
    count = len(layers)
    order = chain_order(groups) if groups else [i % count for i in range(2 * count)]
    repeated = nn.ModuleList(copy.copy(layers[i]) for i in order)
    names = [real_names[i] for i in order]
    watch = _ChainWatch(layer_list, names)
    for position, copied in enumerate(repeated):
        _watch(copied, position, watch)
    with watch, torch.no_grad():
        run_forward(repeated)
    if watch.ran != list(range(len(order))):
        raise RegionError(f"capture: the layers of {layer_list} did not all run once, in order, in the forward "
                          f"(ran {[names[p] for p in watch.ran]})")


__all__ = ["prove_layer_chain"]
