"""``fuse_linear_cross_entropy(gm)``: put ``mist::linear_cross_entropy`` into a dynamo torch-level graph.

The graph a dynamo backend receives computes the loss of a causal LM as

    logits = torch._C._nn.linear(hidden, weight)          # the head, no bias
    logits = logits.float()                               # optional upcasts (.float(), .to(float32))
    logits = logits.view(-1, V)                           # optional views (view/reshape/flatten/contiguous)
    loss = torch.nn.functional.cross_entropy(logits, labels, ignore_index=..., reduction=...)

(our zoo models; Hugging Face's ``ForCausalLMLoss`` / ``fixed_cross_entropy``, whose labels are
padded and shifted before, and whose head input may be a slice of the hidden states). When every
value between the head and the loss has no other user, the chain is replaced in place by

    loss = torch.ops.mist.linear_cross_entropy(hidden.reshape(-1, H), weight, labels, ignore_index, reduction)[0]

(cast back when the original loss was not fp32). Anything else is left alone: a head with a
bias, logits used elsewhere, class weights, label smoothing, ``reduction="none"``, a downcast on
the way. New nodes copy the head's ``nn_module_stack``/``stack_trace`` metadata and get fake
``example_value``s where the graph has them.
"""
from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

from . import linear_cross_entropy as _op
from .linear_cross_entropy import REDUCTIONS

LINEAR_TARGETS = (torch._C._nn.linear, F.linear)
PASS_THROUGH_METHODS = {"view", "reshape", "flatten", "contiguous", "float"}
PASS_THROUGH_FUNCTIONS = (torch.reshape, torch.flatten)
META_KEYS = ("nn_module_stack", "source_fn_stack", "stack_trace", "seq_nr")
_CROSS_ENTROPY_SIGNATURE = inspect.signature(F.cross_entropy)


@dataclass
class _Match:
    loss: fx.Node  # the cross_entropy call
    chain: list[fx.Node]  # the nodes from the loss back to the head linear (inclusive)
    hidden: fx.Node
    weight: fx.Node
    labels: fx.Node
    ignore_index: int
    reduction: str


def _example(node) -> torch.Tensor | None:
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _is_upcast(node: fx.Node) -> bool:
    """``x.to(torch.float32)`` / ``x.to(dtype=torch.float32)`` (an upcast the op's fp32 math covers)."""
    if node.op != "call_method" or node.target != "to":
        return False
    args, kwargs = node.args[1:], dict(node.kwargs)
    if set(kwargs) - {"dtype"} or len(args) + len(kwargs) != 1:
        return False
    return (args[0] if args else kwargs["dtype"]) is torch.float32


def _passes_through(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in PASS_THROUGH_METHODS or _is_upcast(node)
    return node.op == "call_function" and node.target in PASS_THROUGH_FUNCTIONS


def _loss_arguments(node: fx.Node) -> dict | None:
    try:
        bound = _CROSS_ENTROPY_SIGNATURE.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


def _match(loss: fx.Node) -> _Match | None:
    arguments = _loss_arguments(loss)
    if arguments is None or not isinstance(arguments["input"], fx.Node) or not isinstance(arguments["target"], fx.Node):
        return None
    plain = (arguments["weight"] is None and arguments["size_average"] is None and arguments["reduce"] is None
             and arguments["label_smoothing"] == 0.0 and arguments["reduction"] in REDUCTIONS
             and isinstance(arguments["ignore_index"], int))
    logits, labels = _example(arguments["input"]), _example(arguments["target"])
    if not plain or (logits is not None and logits.dim() != 2) or (labels is not None and labels.dim() != 1):
        return None
    chain, current = [loss], arguments["input"]
    while _passes_through(current) and len(current.users) == 1 and isinstance(current.args[0], fx.Node):
        chain.append(current)
        current = current.args[0]
    if not (current.op == "call_function" and current.target in LINEAR_TARGETS and len(current.users) == 1):
        return None
    hidden, weight, *rest = list(current.args) + [current.kwargs.get("bias")]
    if any(bias is not None for bias in rest) or not isinstance(hidden, fx.Node) or not isinstance(weight, fx.Node):
        return None
    head_out = _example(current)
    if head_out is not None and logits is not None and logits.dtype not in (head_out.dtype, torch.float32):
        return None  # a downcast on the way: the unfused loss sees rounded logits
    chain.append(current)
    return _Match(loss, chain, hidden, weight, arguments["target"], arguments["ignore_index"], arguments["reduction"])


def _copy_meta(new: fx.Node, source: fx.Node, value) -> None:
    for key in META_KEYS:
        if key in source.meta:
            new.meta[key] = source.meta[key]
    if value is not None:
        new.meta["example_value"] = value


def _fake_values(match: _Match, hidden_size: int):
    """Example values of the new nodes, computed under the graph's fake mode (None without one)."""
    examples = [_example(n) for n in (match.hidden, match.weight, match.labels)]
    if any(value is None for value in examples):
        return None
    fake_mode = getattr(examples[0], "fake_mode", None)  # the graph's own mode (the tracing context may hold another)
    if fake_mode is None:
        return None
    with fake_mode:
        flat = examples[0].reshape(-1, hidden_size)
        fused = torch.ops.mist.linear_cross_entropy.default(flat, examples[1], examples[2], match.ignore_index,
                                                             match.reduction)
    return flat, fused, fused[0]


def _rewrite(graph: fx.Graph, match: _Match) -> None:
    head = match.chain[-1]
    hidden_value, weight_value = _example(match.hidden), _example(match.weight)
    hidden_size = int(weight_value.shape[1]) if weight_value is not None else None
    if hidden_size is None:
        hidden_size = int(hidden_value.shape[-1]) if hidden_value is not None else -1
    values = _fake_values(match, hidden_size) or (None, None, None)
    original = _example(match.loss)
    with graph.inserting_before(match.loss):
        flat = graph.call_method("reshape", (match.hidden, -1, hidden_size))
        fused = graph.call_function(torch.ops.mist.linear_cross_entropy.default,
                                    (flat, match.weight, match.labels, match.ignore_index, match.reduction))
        loss = graph.call_function(operator.getitem, (fused, 0))
        for node, value in zip((flat, fused, loss), values):
            _copy_meta(node, head, value)
        if original is not None and original.dtype != torch.float32:
            cast = graph.call_method("to", (loss, original.dtype))
            _copy_meta(cast, head, original)
            loss = cast
    match.loss.replace_all_uses_with(loss)
    for node in match.chain:  # loss first: each node's only user is gone when it is erased
        graph.erase_node(node)


def fuse_linear_cross_entropy(gm: fx.GraphModule) -> bool:
    """Replace every head-linear -> [upcast] -> [views] -> cross_entropy chain of ``gm`` by the fused op
    (module docstring); recompile ``gm``. True when something changed."""
    matches = [m for m in (_match(n) for n in gm.graph.nodes
                           if n.op == "call_function" and n.target is F.cross_entropy) if m is not None]
    for match in matches:
        _rewrite(gm.graph, match)
    if matches:
        gm.graph.lint()
        gm.recompile()
    return bool(matches)
