"""How a captured model reads its labels: whether it shifts them itself, and which label it ignores.

A causal LM's loss pairs the prediction at position t with token t+1. Hugging Face causal LMs do
the pairing inside (the convention is ``labels = input_ids``: their loss pads the labels with the
ignore index and drops the first column); the zoo and nanoGPT-style models take labels already
shifted (``labels[t] = tokens[t + 1]``). Data fed to a model must follow the model's own
convention (DESIGN.md section 1), or it trains to predict token t+2.

:func:`label_convention` reads the convention from the captured torch-level graph: the model
shifts inside when, on the way from its ``labels`` input to the loss, the labels are sliced along
their last dimension from a start of 1 or more (``labels[..., 1:]``, ``F.pad`` then a slice, or
``narrow``). The loss's ``ignore_index`` (-100 unless the model says otherwise) is read there too.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..ir.program import MistProgram

DEFAULT_IGNORE_INDEX = -100
# what labels go through on their way to the loss without becoming something else
_CARRY_METHODS = {"view", "reshape", "flatten", "contiguous", "to", "clone", "long", "int", "type", "narrow",
                  "masked_fill", "roll"}
_CARRY_FUNCTIONS = {operator.getitem, F.pad, torch._C._nn.pad, torch.reshape, torch.flatten, torch.narrow, torch.where,
                    torch.roll}


@dataclass(frozen=True)
class LabelConvention:
    """``shifted_inside``: the model pairs position t with label t+1 itself (feed ``labels =
    input_ids``); else labels are the next tokens. ``ignore_index``: a label the loss skips."""

    shifted_inside: bool = False
    ignore_index: int = DEFAULT_IGNORE_INDEX

    def counted(self, labels: torch.Tensor) -> torch.Tensor:
        """How many labels of each row of ``labels`` [batch, seq] the model's loss averages over."""
        used = labels[:, 1:] if self.shifted_inside else labels
        return (used != self.ignore_index).sum(dim=1)

    def share_weights(self, labels: torch.Tensor, shares: list[tuple[int, int]], parts: int) -> list[float]:
        """Weights making the mean of per-share mean losses the loss of the whole batch.

        The batch ``labels`` is cut into ``parts`` equal shares (micro-batches times data-parallel
        ranks), each trained on its own mean loss; where shares count different numbers of labels
        (ignored ones, padding) share ``[a, b)`` is weighted by ``parts * its count / the batch's``,
        so the step minimises the mean over every counted label, as the model's loss on the whole
        batch does. All 1.0 when every row counts the same (or nothing is counted)."""
        counts = self.counted(labels)
        if counts.device.type != "cpu":  # labels on a device: one copy (one wait), the rest is host arithmetic
            counts = counts.cpu()
        total = int(counts.sum())
        if total == 0 or bool((counts == counts[0]).all()):
            return [1.0] * len(shares)
        return [parts * int(counts[a:b].sum()) / total for a, b in shares]


def _is_loss(node: fx.Node) -> bool:
    target = node.target
    return node.op == "call_function" and (target is F.cross_entropy or getattr(target, "__name__", "") in (
        "linear_cross_entropy.default", "linear_cross_entropy"))


def _ignore_index(node: fx.Node) -> int:
    if node.target is F.cross_entropy:
        value = node.kwargs.get("ignore_index", node.args[4] if len(node.args) > 4 else DEFAULT_IGNORE_INDEX)
    else:  # mist::linear_cross_entropy(hidden, weight, labels, ignore_index, reduction)
        value = node.args[3] if len(node.args) > 3 else node.kwargs.get("ignore_index", DEFAULT_IGNORE_INDEX)
    return value if isinstance(value, int) else DEFAULT_IGNORE_INDEX


def _drops_leading_labels(node: fx.Node) -> bool:
    """``x[..., k:]`` / ``x[:, k:]`` (k >= 1) on the labels' sequence axis, or ``x.narrow(-1 | 1, k, n)``."""
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[1], (tuple, slice)):
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        parts = [part for part in index if part is not Ellipsis]
        sliced = [part for part in parts if isinstance(part, slice)]
        return bool(sliced) and isinstance(sliced[-1].start, int) and sliced[-1].start >= 1
    if (node.op == "call_method" and node.target == "narrow") or node.target is torch.narrow:
        start = node.args[2] if len(node.args) > 2 else node.kwargs.get("start")
        return isinstance(start, int) and start >= 1
    return False


def convention_of_graph(graph: fx.Graph, labels: fx.Node) -> LabelConvention:
    """The convention of a torch-level graph whose labels input is ``labels``."""
    shifted, ignore_index = False, DEFAULT_IGNORE_INDEX
    todo, seen = [labels], {labels}
    while todo:
        node = todo.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if _is_loss(user):
                ignore_index = _ignore_index(user)
            elif (user.op == "call_method" and user.target in _CARRY_METHODS) or (
                    user.op == "call_function" and user.target in _CARRY_FUNCTIONS):
                shifted = shifted or _drops_leading_labels(user)
                todo.append(user)
    return LabelConvention(shifted, ignore_index)


def label_convention(program: MistProgram) -> LabelConvention:
    """The convention of a captured program (the zoo's, shifted labels, when it has no ``labels`` input)."""
    graph = program.model_graph
    if graph is None:
        return LabelConvention()
    by_name = {node.name: node for node in graph.graph.graph.nodes}
    labels = next((by_name[name] for name, role in graph.batch_inputs.items() if role == "labels" and name in by_name),
                  None)
    return LabelConvention() if labels is None else convention_of_graph(graph.graph.graph, labels)
