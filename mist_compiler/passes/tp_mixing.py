"""Tensor-parallel rules for ops that combine or reduce values: attention, products of
activations, joins, reductions, normalisations and sizes read from split values (see
``tp_recognition``)."""
from __future__ import annotations

import torch.fx as fx

from ..ir.model_graph import ShardSpec
from .tp_rules import _dim_arg, _meet_replicated, segments_of
from .tp_walk import C, P, R, Walk, is_sharded, norm_dim, op_of, requires_grad, shape_of, sharded, split_dim, split_outer


def attention(walk: Walk, node: fx.Node) -> None:
    """Attention over heads split over the ranks (key/value of one replicated head, multi-query style,
    are read whole: their gradient is all-reduced; a per-head mask is read as this rank's heads)."""
    kwargs = {**dict(zip(("query", "key", "value", "attn_mask"), node.args)), **node.kwargs}
    q = kwargs["query"]
    heads = len(shape_of(q)) - 3
    if walk.state(q) != sharded(heads):
        walk.fail(node, f"attends with a query that is not split by heads ({walk.state(q)})")
    for name in ("key", "value"):
        other = kwargs[name]
        if walk.state(other) == sharded(heads):
            continue
        if walk.state(other) in (R, C) and shape_of(other)[heads] == 1:
            if requires_grad(other):
                walk.copy_for(other, node)
            continue
        walk.fail(node, f"attends over a {name} that is not split by heads like the query ({walk.state(other)})")
    mask = kwargs.get("attn_mask")
    if isinstance(mask, fx.Node):
        if is_sharded(walk.state(mask)) and walk.state(mask) != sharded(heads):
            walk.fail(node, "takes an attention mask split other than by heads")
        if walk.state(mask) in (R, C) and len(shape_of(mask)) > heads and shape_of(mask)[heads] != 1:
            walk.scatter(mask, node, heads)
    if op_of(node) == "counter_attention":  # dropout on the probabilities [batch, heads, q, k]
        walk.edit(node, "split_dropout", position=(heads, shape_of(q)[heads]), data=("attention",))
    walk.states[node.name] = sharded(heads)


def dropout(walk: Walk, node: fx.Node) -> None:
    """``counter_dropout`` of a split value: the whole value's mask, this rank's part of it."""
    x = node.args[0]
    state = walk.state(x)
    dim, outer = split_dim(state), split_outer(state)
    walk.edit(node, "split_dropout", position=(dim, shape_of(x)[dim] // outer), data=("dropout", segments_of(walk, x)))
    walk.states[node.name] = state
    if x.name in walk.column_out:
        walk.column_out[node.name] = walk.column_out[x.name]


def activation_matmul(walk: Walk, node: fx.Node) -> None:
    """``a @ b`` of activations (``bmm``, ``matmul``, ``baddbmm(input, a, b)``): split alike along a
    batch dimension (heads), or both along the contracted dimension (a partial sum)."""
    op = op_of(node)
    names = ("input", "batch1", "batch2") if op == "baddbmm" else ("input", "other") if op == "matmul" else \
        ("input", "mat2")
    kwargs = {**dict(zip(names, node.args)), **node.kwargs}
    added = kwargs["input"] if op == "baddbmm" else None
    a, b = (kwargs["batch1"], kwargs["batch2"]) if op == "baddbmm" else (kwargs["input"], kwargs[names[1]])
    sa, sb = walk.state(a), walk.state(b)
    na, nb, nout = len(shape_of(a)), len(shape_of(b)), len(shape_of(node))
    if is_sharded(sa) and is_sharded(sb) and split_dim(sa) == na - 1 and split_dim(sb) == nb - 2 and added is None:
        walk.states[node.name] = P
        return
    split = [(x, s, n) for x, s, n in ((a, sa, na), (b, sb, nb)) if is_sharded(s)]
    if not split or any(split_dim(s) >= n - 2 for _, s, n in split):
        walk.fail(node, "multiplies split values in a way the rules cannot split (only over split heads)")
    from_end = {(split_dim(s) - n, split_outer(s)) for _, s, n in split}
    if len(from_end) != 1:
        walk.fail(node, "multiplies values split along different batch dimensions")
    (offset, outer), = from_end
    source = split[0][0]
    for x in (a, b):
        if walk.state(x) in (R, C):
            _meet_replicated(walk, node, x, source, offset, outer)
    if isinstance(added, fx.Node):
        if is_sharded(walk.state(added)) and walk.state(added) != sharded(len(shape_of(added)) + offset, outer):
            walk.fail(node, "adds a value split otherwise to a product of split values")
        if walk.state(added) in (R, C):
            _meet_replicated(walk, node, added, source, offset, outer)
    walk.states[node.name] = sharded(nout + offset, outer)


def concat(walk: Walk, node: fx.Node, op: str) -> None:
    parts = list(node.args[0])
    split = {(split_dim(walk.state(p)), split_outer(walk.state(p))) for p in parts if is_sharded(walk.state(p))}
    if len(split) != 1:
        walk.fail(node, f"joins values split differently ({sorted(split)})")
    (dim, outer), = split
    axis = norm_dim(int(_dim_arg(node, 1, "dim", 0)), len(shape_of(parts[0])) + (op == "stack"))
    if op in ("cat", "concat") and axis == dim:
        walk.fail(node, "concatenates along the split dimension")
    source = next(p for p in parts if is_sharded(walk.state(p)))
    for part in parts:
        if walk.state(part) in (R, C):
            if not isinstance(part, fx.Node):
                walk.fail(node, "joins a split value with a constant")
            walk.scatter(part, node, dim, outer, segments_of(walk, source))
    walk.states[node.name] = sharded(dim if op != "stack" or axis > dim else dim + 1, outer)


def reduction(walk: Walk, node: fx.Node, op: str, along: bool) -> None:
    """Over other dimensions the split stays; a sum over the split is a partial sum (all-reduced
    where read), a mean the same divided by the degree; anything else over the split is refused."""
    source = node.args[0]
    state = walk.state(source)
    dim, ndim = split_dim(state), len(shape_of(source))
    axis = _dim_arg(node, 1, "dim")
    axes = list(range(ndim)) if axis is None else \
        [norm_dim(int(a), ndim) for a in (axis if isinstance(axis, (tuple, list)) else [axis])]
    if dim not in axes:
        keep = along or bool(_dim_arg(node, 2, "keepdim", False))
        walk.states[node.name] = sharded(dim if keep else dim - sum(1 for a in axes if a < dim), split_outer(state))
        return
    if op not in ("sum", "mean") or along:
        walk.fail(node, "reduces over tensor-parallel-split features")
    walk.states[node.name] = P
    if op == "mean":
        walk.means.add(node.name)


def normalisation(walk: Walk, node: fx.Node, op: str) -> None:
    """``layer_norm``/``rms_norm`` of a split value: over unsplit trailing dimensions (per head) it
    stays split and its weight's gradient is all-reduced; over the split features it becomes the
    tensor-parallel norm (statistics all-reduced) with its weight split like the features."""
    x = node.args[0]
    state = walk.state(x)
    ndim = len(shape_of(x))
    shape = _dim_arg(node, 1, "normalized_shape")
    first = ndim - len(shape if isinstance(shape, (tuple, list)) else [shape])
    affine = [a for a in (_dim_arg(node, 2, "weight"), _dim_arg(node, 3, "bias") if op == "layer_norm" else None)
              if isinstance(a, fx.Node)]
    dim = split_dim(state)
    if dim < first:
        for param in affine:
            if requires_grad(param):
                walk.copy_for(param, node)
        walk.states[node.name] = state
        return
    if split_outer(state) != 1 or segments_of(walk, x):
        walk.fail(node, "normalises over features split in parts")
    for param in affine:
        if param.name not in walk.params:
            walk.fail(node, f"normalises with {param.name}, which is not a parameter of the layer")
        walk.shard(param, ShardSpec(dim - first), shape_of(param)[dim - first])
    walk.edit(node, "tp_norm", data=(op,))
    walk.states[node.name] = state


def size(walk: Walk, node: fx.Node) -> None:
    """``x.size(d)`` / ``x.shape`` of a split value: this rank's size of the split dimension."""
    source = node.args[0]
    dim = _dim_arg(node, 1, "dim")
    if dim is None or norm_dim(int(dim), len(shape_of(source))) == split_dim(walk.state(source)):
        walk.local_sizes.add(node.name)
    walk.states[node.name] = C


def size_arithmetic(walk: Walk, node: fx.Node) -> bool:
    """A size of the split dimension divided by a number (Bloom's ``(batch * heads) // heads``): the
    number is per rank too. Returns whether ``node`` was such a division."""
    op = op_of(node)
    args = node.args
    if op == "getitem" and isinstance(args[0], fx.Node) and args[0].name in walk.local_sizes:
        source = args[0].args[0]
        if isinstance(args[1], int) and norm_dim(args[1], len(shape_of(source))) == split_dim(walk.state(source)):
            walk.local_sizes.add(node.name)
        walk.states[node.name] = C
        return True
    if op not in ("floordiv", "truediv") or len(args) != 2 or not isinstance(args[0], fx.Node) or \
            args[0].name not in walk.local_sizes or not isinstance(args[1], int):
        return False
    walk.edit(node, "divide_arg", (1,))
    walk.states[node.name] = C
    return True


__all__ = ["activation_matmul", "attention", "concat", "dropout", "normalisation", "reduction", "size", "size_arithmetic"]
