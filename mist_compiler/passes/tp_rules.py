"""Tensor-parallel rules: how each kind of op moves a split (the rules ``tp_recognition`` lists).

Each rule reads its inputs' states from the :class:`~.tp_walk.Walk`, sets the state of the node
it handles, records parameter splits and graph edits, and raises ``NotShardable`` (through
``walk.fail``) where no split of the current choices is correct.
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.fx as fx

from ..ir.model_graph import ShardSpec
from .tp_walk import (C, P, R, REPLICATE, Walk, is_sharded, norm_dim, op_of, requires_grad, shape_of, sharded,
                      split_dim, split_outer, value_of)

POINTWISE = {
    "add", "sub", "mul", "truediv", "div", "neg", "pow", "rsqrt", "sqrt", "exp", "log", "tanh", "sigmoid", "relu",
    "gelu", "silu", "dropout", "where", "masked_fill", "clamp", "abs", "erf", "float", "to", "type_as", "half",
    "bfloat16", "contiguous", "clone", "detach", "softplus", "mish", "square", "reciprocal", "sin", "cos",
    "floordiv", "mod", "sub_", "add_", "mul_", "fill_", "masked_fill_", "relu_", "leaky_relu", "elu", "logsigmoid",
    "hardtanh", "iadd", "imul", "isub", "itruediv", "log1p", "expm1", "clamp_min", "clamp_max", "minimum", "maximum",
    "silu_", "gelu_", "tanh_", "sign", "copy_", "type",
}
CASTS = {"float", "to", "contiguous", "type_as", "dropout", "half", "bfloat16", "clone", "type"}
LIKE = {"empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like"}
NEW = {"new_empty", "new_zeros", "new_ones", "new_full"}
VIEWS = {"view", "reshape", "view_as", "flatten", "unflatten"}
EXPANDS = {"expand", "expand_as", "broadcast_to"}
REORDERS = {"transpose", "permute", "t", "unsqueeze", "squeeze", "movedim", "swapaxes"}
REDUCTIONS = {"mean", "sum", "amax", "amin", "max", "min", "norm", "var", "std", "logsumexp", "prod", "argmax",
              "argmin"}
ALONG_DIM = {"softmax", "log_softmax", "cumsum"}
NORMS = {"layer_norm", "rms_norm"}
LINEAR = {"linear"}
SDPA = {"scaled_dot_product_attention"}
SPLITS = {"split", "chunk", "unbind", "tensor_split", "split_with_sizes"}
_TRANSPOSED = {"T", "mT", "t"}


# ---- parameters used as matmul weights -------------------------------------------------------
def _param(node, params: set[str]) -> fx.Node | None:
    return node if isinstance(node, fx.Node) and node.op == "placeholder" and node.name in params else None


def _transposed_param(node, params: set[str]) -> fx.Node | None:
    """``W.T``, ``W.t()``, ``W.transpose(0, 1)`` of a 2-D parameter ``W``, else None."""
    if not isinstance(node, fx.Node) or not node.args:
        return None
    op, base = op_of(node), _param(node.args[0], params)
    if base is None or len(shape_of(base)) != 2:
        return None
    if (op == "getattr" and node.args[1] in _TRANSPOSED) or op == "t":
        return base
    if op in ("transpose", "swapaxes") and {norm_dim(int(d), 2) for d in node.args[1:3]} == {0, 1}:
        return base
    return None


def weight_of(node: fx.Node, params: set[str]) -> tuple[fx.Node, fx.Node, int, int] | None:
    """``(activation, weight, out_dim, in_dim)`` of ``linear(x, W)``, ``addmm(b, x, W)``, ``x @ W`` and
    ``x @ W.T`` (FalconLinear), the dimensions of ``W`` holding the output and input features."""
    op = op_of(node)
    if op in LINEAR:
        weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
        found = _param(weight, params)
        return (node.args[0], found, 0, 1) if found is not None else None
    if op == "addmm" and len(node.args) >= 3:
        found = _param(node.args[2], params)
        return (node.args[1], found, 1, 0) if found is not None else None
    if op in ("matmul", "mm") and len(node.args) >= 2:
        found = _param(node.args[1], params)
        if found is not None:
            return node.args[0], found, 1, 0
        found = _transposed_param(node.args[1], params)
        if found is not None:
            return node.args[0], found, 0, 1
    return None


def _dim_arg(node: fx.Node, position: int, name: str, default=None):
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, default)


def segments_of(walk: Walk, value: fx.Node) -> tuple[int, ...]:
    """The parts (in units of the split dimension) ``value`` is split by separately, when it comes
    straight from a fused column-parallel projection."""
    if value.name not in walk.column_out:
        return ()
    weight, unit = walk.column_out[value.name]
    spec = walk.sharding.shards.get(weight)
    if spec is None or not spec.segments or any(s % unit for s in spec.segments):
        return ()
    return tuple(s // unit for s in spec.segments)


def set_segments(walk: Walk, node: fx.Node, weight: str, segments: tuple[int, ...]) -> None:
    """Split the fused projection ``weight`` part by part (``segments``: weight rows per part)."""
    spec = walk.sharding.shards[weight]
    if spec.segments and spec.segments != segments:
        walk.fail(node, f"splits a fused projection into parts {segments} already split as {spec.segments}")
    walk.sharding.shards[weight] = replace(spec, segments=segments)
    bias = walk.column_bias.get(weight)
    if bias is not None:
        walk.sharding.shards[bias] = replace(walk.sharding.shards[bias], segments=segments)
    walk.sizes.extend(segments)


# ---- linears -----------------------------------------------------------------------------------
def weight_matmul(walk: Walk, node: fx.Node) -> None:
    """Column-parallel (replicated input; or replicated, a choice), row-parallel (input split along
    its features)."""
    x, weight, out_dim, in_dim = weight_of(node, walk.params)
    op = op_of(node)
    bias = _dim_arg(node, 2, "bias") if op in LINEAR else node.args[0] if op == "addmm" else None
    if x is weight:
        walk.fail(node, "multiplies by a weight from the left; only x @ W and linear(x, W) can be split")
    state = walk.state(x)
    if state == P:
        walk.reduce(x)
        state = R
    rows = shape_of(weight)
    out_ndim = len(shape_of(node))
    if state == R:
        if walk.choose(node, 2, cost=math.prod(rows)) == REPLICATE:
            walk.replicated[weight.name] = node.name
            walk.states[node.name] = R
            return
        walk.shard(weight, ShardSpec(out_dim), rows[out_dim])
        if isinstance(bias, fx.Node) and bias.name in walk.params:
            walk.shard(bias, ShardSpec(0), shape_of(bias)[0])
            walk.column_bias[weight.name] = bias.name
        walk.copy_for(x, node)
        walk.states[node.name] = sharded(out_ndim - 1)
        walk.column_out[node.name] = (weight.name, 1)
        return
    if is_sharded(state) and split_dim(state) == len(shape_of(x)) - 1 and split_outer(state) == 1:
        walk.shard(weight, ShardSpec(in_dim, tuple(s for s in segments_of(walk, x))), rows[in_dim])
        walk.states[node.name] = P
        if isinstance(bias, fx.Node):
            walk.edit(node, "defer_bias")
            walk.pending_bias[node.name] = (bias.name,)
        return
    walk.fail(node, f"reads a value split along dimension {split_dim(state)}, not its features")


# ---- elementwise code --------------------------------------------------------------------------
def _meet_replicated(walk: Walk, node: fx.Node, arg: fx.Node, source: fx.Node, from_end: int, outer: int) -> None:
    """A replicated operand of elementwise code on a split value: broadcast along the split (its
    gradient is partial: all-reduced), or of full size (a parameter is split like the value, any
    other value read as this rank's part)."""
    shape = shape_of(arg)
    position = len(shape) + from_end
    if 0 <= position < len(shape) and shape[position] != 1:
        full = shape_of(source)[len(shape_of(source)) + from_end]
        if shape[position] != full:
            walk.fail(node, f"combines a split value with {arg.name} of another size along the split dimension")
        segments = segments_of(walk, source)
        if arg.name in walk.params and outer == 1:
            if len(arg.users) > 1:
                walk.fail(node, f"would split {arg.name} like its features, but other code reads it whole")
            walk.shard(arg, ShardSpec(position, segments), shape[position])
            if source.name in walk.column_out and walk.column_out[source.name][1] == 1 and len(shape) == 1:
                walk.column_bias.setdefault(walk.column_out[source.name][0], arg.name)
        else:
            walk.scatter(arg, node, position, outer, segments)
    elif requires_grad(arg):
        walk.copy_for(arg, node)


def pointwise(walk: Walk, node: fx.Node, tensors: list[fx.Node]) -> None:
    split = {(split_dim(walk.state(a)) - len(shape_of(a)), split_outer(walk.state(a)))
             for a in tensors if is_sharded(walk.state(a))}
    if len(split) > 1:
        walk.fail(node, f"combines values split along different dimensions {sorted(split)}")
    (from_end, outer), = split
    source = next(a for a in tensors if is_sharded(walk.state(a)))
    for arg in tensors:
        if walk.state(arg) in (R, C):
            _meet_replicated(walk, node, arg, source, from_end, outer)
    out = value_of(node)
    if isinstance(out, (tuple, list)):  # a higher-order call returns its outputs as a tuple
        ndim = len(out[0].shape)
        for position in range(len(out)):
            walk.states[f"{node.name}[{position}]"] = sharded(ndim + from_end, outer)
    walk.states[node.name] = sharded((ndim if isinstance(out, (tuple, list)) else len(shape_of(node))) + from_end,
                                     outer)
    if source.name in walk.column_out and op_of(node) in CASTS:
        walk.column_out[node.name] = walk.column_out[source.name]


def factory(walk: Walk, node: fx.Node, op: str) -> None:
    """A new tensor made from a split one (``x.new_empty(...)``, ``zeros_like(x)``): split like it
    when it has its shape up to the split dimension (the size there becomes the per-rank one)."""
    source = node.args[0]
    state = walk.state(source)
    dim, shape = split_dim(state), shape_of(node)
    if op in LIKE:
        walk.states[node.name] = state
        return
    if len(shape) <= dim or shape[:dim + 1] != shape_of(source)[:dim + 1]:
        walk.fail(node, "makes a tensor from a split value with another shape")
    values, prefix = shape_args(node) if op != "new_full" else (list(node.args[1]), (1,))
    if len(values) != len(shape):
        walk.fail(node, "has a shape argument the rules cannot read")
    _divide_shape_entry(walk, node, dim, values, prefix)
    walk.states[node.name] = state


def pointwise_body(walk: Walk, node: fx.Node) -> bool:
    """Whether a higher-order call (``autograd_function_apply``: a custom autograd.Function, as
    Bloom's GeLU) runs only elementwise code forward and backward."""
    module = walk.graph.owning_module
    bodies = [a for a in node.args[:2] if isinstance(a, fx.Node) and a.op == "get_attr"]
    if module is None or len(bodies) != 2:
        return False
    for body in bodies:
        for inner in getattr(module, body.target).graph.nodes:
            if inner.op == "call_function" and inner.target is not torch._C._set_grad_enabled and \
                    op_of(inner) not in POINTWISE:
                return False
    return True


# ---- views and reorders ------------------------------------------------------------------------
def _groups(in_shape: list[int], out_shape: list[int], dim: int) -> tuple[list[int], list[int]] | None:
    """The input and output dimensions (size-1 ones left out) regrouping the same elements as ``dim``."""
    ins = [i for i, s in enumerate(in_shape) if s != 1]
    outs = [j for j, s in enumerate(out_shape) if s != 1]
    i = j = 0
    while i < len(ins) and j < len(outs):
        group_in, group_out = [ins[i]], [outs[j]]
        size_in, size_out = in_shape[ins[i]], out_shape[outs[j]]
        i, j = i + 1, j + 1
        while size_in != size_out:
            if size_in < size_out:
                if i >= len(ins):
                    return None
                group_in.append(ins[i])
                size_in *= in_shape[ins[i]]
                i += 1
            else:
                if j >= len(outs):
                    return None
                group_out.append(outs[j])
                size_out *= out_shape[outs[j]]
                j += 1
        if dim in group_in:
            return group_in, group_out
    return None


def view_candidates(in_shape: list[int], out_shape: list[int], dim: int, outer: int = 1,
                    fused: bool = False) -> list[tuple[int, int, int, int]]:
    """Where a split of input dimension ``dim`` (``outer`` blocks) can go through a view:
    ``(out dim, its outer blocks, rows split, parts)``. Natural places first (the split stays one
    contiguous range per block); with ``fused`` (a fresh column-parallel output) also places
    reached by splitting the projection into ``parts`` equal parts (``view(B, T, 3, h, d)``)."""
    found = _groups(in_shape, out_shape, dim)
    if found is None:
        return []
    group_in, group_out = found
    before = math.prod(in_shape[i] for i in group_in[:group_in.index(dim)])
    after = math.prod(in_shape[i] for i in group_in[group_in.index(dim) + 1:])
    blocks, extent = before * outer, in_shape[dim] // outer * after
    natural, parts = [], []
    for position, j in enumerate(group_out):
        out_before = math.prod(out_shape[k] for k in group_out[:position])
        inner = math.prod(out_shape[k] for k in group_out[position + 1:])
        size = out_shape[j]
        if blocks % out_before == 0:
            new_outer = blocks // out_before
            if size * inner == new_outer * extent and extent % inner == 0 and size % new_outer == 0 \
                    and size // new_outer > 1:
                natural.append((j, new_outer, extent // inner, 1))
        if fused and blocks == 1 and out_before > 1 and size * inner * out_before == extent and size > 1:
            parts.append((j, 1, size, out_before))
    return natural + parts


def map_view_dim(in_shape: list[int], out_shape: list[int], dim: int) -> int | None:
    """The output dimension that carries a contiguous split of input dimension ``dim`` through a view,
    or None when the split would not stay one contiguous range."""
    return next((j for j, outer, _, _ in view_candidates(in_shape, out_shape, dim) if outer == 1), None)


def shape_args(node: fx.Node) -> tuple[list, tuple]:
    """The shape arguments of a view/reshape/expand and the position prefix to reach them."""
    args = node.args[1:]
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        return list(args[0]), (1,)
    if len(args) == 1 and isinstance(args[0], fx.Node) and args[0].target is torch.Size:
        return list(args[0].args[0]), ("size_node",)
    return list(args), ()


def _divide_shape_entry(walk: Walk, node: fx.Node, index: int, values: list, prefix: tuple) -> None:
    """Make the size the view asks for at ``index`` (the split dimension) the per-rank one."""
    entry = values[index] if 0 <= index < len(values) else -1
    if isinstance(entry, int):
        if entry == -1:
            return
        if prefix == ("size_node",):
            size_node = node.args[1]
            if len(size_node.users) != 1:
                walk.fail(node, "takes a shape other values share")
            walk.edit(size_node, "divide_arg", (0, index))
        else:
            walk.edit(node, "divide_arg", (*prefix, index) if prefix else (1 + index,))
    elif isinstance(entry, fx.Node):
        if entry.name in walk.local_sizes:
            return  # read from a split value: already this rank's size
        ints = [k for k, a in enumerate(entry.args) if isinstance(a, int)]
        if op_of(entry) == "mul" and len(ints) == 1:  # batch * heads: the head count divided (once)
            if not any(e.node == entry.name and e.kind == "divide_arg" for e in walk.sharding.edits):
                walk.edit(entry, "divide_arg", (ints[0],))
            return
        walk.fail(node, f"takes a computed size ({entry.name}) for the split dimension")


def view(walk: Walk, node: fx.Node, op: str) -> None:
    source = node.args[0]
    state = walk.state(source)
    in_shape, out_shape = shape_of(source), shape_of(node)
    dim, outer = split_dim(state), split_outer(state)
    fused = source.name in walk.column_out and walk.column_out[source.name][1] == 1 and outer == 1
    candidates = view_candidates(in_shape, out_shape, dim, outer, fused)
    if not candidates:
        walk.fail(node, "regroups a split dimension so that the split would not stay contiguous")
    pick = walk.choose(node, len(candidates)) if len(candidates) > 1 else 0
    new_dim, new_outer, rows, parts = candidates[pick]
    if parts > 1:
        weight, _ = walk.column_out[source.name]
        set_segments(walk, node, weight, (in_shape[dim] // parts,) * parts)
    walk.sizes.append(rows)
    if op in ("view", "reshape"):
        values, prefix = shape_args(node)
        if len(values) != len(out_shape):
            walk.fail(node, "has a shape argument the rules cannot read")
        _divide_shape_entry(walk, node, new_dim, values, prefix)
    elif op == "unflatten":
        at = norm_dim(int(node.args[1]), len(in_shape))
        if at <= new_dim < at + len(node.args[2]):
            _divide_shape_entry(walk, node, new_dim - at, list(node.args[2]), (2,))
    walk.states[node.name] = sharded(new_dim, new_outer)
    if source.name in walk.column_out and outer == new_outer == 1 and parts == 1 and \
            in_shape[dim] % out_shape[new_dim] == 0:  # e.g. features -> heads: a head is head_dim weight rows
        weight, unit = walk.column_out[source.name]
        walk.column_out[node.name] = (weight, unit * (in_shape[dim] // out_shape[new_dim]))


def expand(walk: Walk, node: fx.Node, op: str) -> None:
    source = node.args[0]
    state = walk.state(source)
    from_end = split_dim(state) - len(shape_of(source))
    new_dim = len(shape_of(node)) + from_end
    if op == "expand":
        values, prefix = shape_args(node)
        _divide_shape_entry(walk, node, len(values) + from_end, values, prefix)
    elif op == "broadcast_to":
        target = node.args[1]
        if isinstance(target, (tuple, list)):
            _divide_shape_entry(walk, node, len(target) + from_end, list(target), (1,))
        elif isinstance(target, fx.Node) and target.name not in walk.local_sizes:
            walk.fail(node, "broadcasts to a shape the rules cannot read")
    walk.states[node.name] = sharded(new_dim, split_outer(state))


def reorder(walk: Walk, node: fx.Node, op: str) -> None:
    source = node.args[0]
    dim = split_dim(walk.state(source))
    ndim_in, ndim_out = len(shape_of(source)), len(shape_of(node))
    if op in ("transpose", "swapaxes"):
        a, b = (norm_dim(int(d), ndim_in) for d in node.args[1:3])
        new = b if dim == a else a if dim == b else dim
    elif op == "t":
        new = 1 - dim if ndim_in == 2 else dim
    elif op == "permute":
        order = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
        new = [norm_dim(int(d), ndim_in) for d in order].index(dim)
    elif op == "movedim":
        src, dst = norm_dim(int(node.args[1]), ndim_in), norm_dim(int(node.args[2]), ndim_in)
        order = [d for d in range(ndim_in) if d != src]
        order.insert(dst, src)
        new = order.index(dim)
    elif op == "unsqueeze":
        at = norm_dim(int(node.args[1]), ndim_out)
        new = dim + 1 if at <= dim else dim
    else:  # squeeze
        removed = [i for i in range(ndim_in) if shape_of(source)[i] == 1 and i != dim]
        if len(node.args) > 1:
            removed = [norm_dim(int(d), ndim_in) for d in (node.args[1] if isinstance(node.args[1], (tuple, list))
                                                          else [node.args[1]])]
            removed = [d for d in removed if shape_of(source)[d] == 1]
        new = dim - sum(1 for r in removed if r < dim)
    walk.states[node.name] = sharded(new, split_outer(walk.state(source)))
    if source.name in walk.column_out:
        walk.column_out[node.name] = walk.column_out[source.name]


# ---- indexing and splitting --------------------------------------------------------------------
def _expanded_index(index, ndim: int) -> list:
    items = list(index) if isinstance(index, tuple) else [index]
    explicit = sum(1 for i in items if i is not None and i is not Ellipsis)
    expanded: list = []
    for item in items:
        expanded += [slice(None)] * (ndim - explicit) if item is Ellipsis else [item]
    return expanded + [slice(None)] * (ndim - sum(1 for i in expanded if i is not None))


def _slice_on(index, ndim: int, dim: int) -> tuple[int, object] | None:
    """``(position in the index, item)`` of what ``index`` does to dimension ``dim``."""
    items = list(index) if isinstance(index, tuple) else [index]
    in_dim = 0
    for position, item in enumerate(items):
        if item is Ellipsis:
            in_dim += ndim - sum(1 for i in items if i is not None and i is not Ellipsis)
            continue
        if item is None:
            continue
        if in_dim == dim:
            return position, item
        in_dim += 1
    return None


def getitem(walk: Walk, node: fx.Node) -> None:
    source, index = node.args
    state = walk.state(source)
    if isinstance(value_of(source), (tuple, list)):  # an item of a split
        walk.states[node.name] = walk.states.get(f"{source.name}[{index}]", state)
        return
    dim, ndim = split_dim(state), len(shape_of(source))
    items = list(index) if isinstance(index, tuple) else [index]
    if any(isinstance(i, fx.Node) and isinstance(value_of(i), torch.Tensor) for i in items):
        walk.fail(node, "indexes a split value with a tensor")
    out, in_dim = 0, 0
    for item in _expanded_index(index, ndim):
        if item is None:
            out += 1
            continue
        if in_dim == dim:
            if not (isinstance(item, slice) and item == slice(None)):
                return fused_slices(walk, node, source, dim)
            walk.states[node.name] = sharded(out, split_outer(state))
            return
        if not isinstance(item, (int, fx.Node)):
            out += 1
        in_dim += 1
    walk.fail(node, "indexing the rules cannot follow")


def fused_slices(walk: Walk, node: fx.Node, source: fx.Node, dim: int) -> None:
    """Slices of a fused column-parallel projection along its features (Phi-3's ``qkv[..., :q]``,
    ``qkv[..., q:q + kv]``, ``qkv[..., q + kv:]``): the projection is split part by part and each
    slice's bounds become the per-rank ones."""
    if source.name not in walk.column_out or split_outer(walk.state(source)) != 1:
        walk.fail(node, "slices the split dimension")
    weight, unit = walk.column_out[source.name]
    ndim, full = len(shape_of(source)), shape_of(source)[dim]
    ranges = []
    for user in source.users:
        found = _slice_on(user.args[1], ndim, dim) if op_of(user) == "getitem" and len(user.args) == 2 else None
        item = found[1] if found else None
        if not isinstance(item, slice) or item.step not in (None, 1) or \
                not all(b is None or isinstance(b, int) for b in (item.start, item.stop)):
            walk.fail(user, "reads a fused projection other than by constant slices of its features")
        start, stop, _ = item.indices(full)
        ranges.append((start, stop, user, found[0]))
    ranges.sort(key=lambda r: r[0])
    if [r[0] for r in ranges] != [0] + [r[1] for r in ranges[:-1]] or ranges[-1][1] != full:
        walk.fail(node, "slices a fused projection into parts that do not tile its features")
    set_segments(walk, node, weight, tuple((stop - start) * unit for start, stop, _, _ in ranges))
    for start, stop, user, position in ranges:
        walk.edit(user, "divide_slice", (1, position) if isinstance(user.args[1], tuple) else (1,))
        walk.states[user.name] = walk.state(source)
        walk.decided.add(user.name)


def split(walk: Walk, node: fx.Node, op: str) -> None:
    source = node.args[0]
    state = walk.state(source)
    dim, ndim = split_dim(state), len(shape_of(source))
    axis = norm_dim(int(_dim_arg(node, 1 if op == "unbind" else 2, "dim", 0)), ndim)
    parts = value_of(node)
    if axis != dim:
        new = dim if op != "unbind" else dim - (1 if axis < dim else 0)
        for position in range(len(parts)):
            walk.states[f"{node.name}[{position}]"] = sharded(new, split_outer(state))
        walk.states[node.name] = sharded(new, split_outer(state))
        return
    if source.name not in walk.column_out or op == "unbind" or split_outer(state) != 1:
        walk.fail(node, "splits a split dimension that does not come straight from a column-parallel linear")
    weight, unit = walk.column_out[source.name]
    sizes = tuple(int(p.shape[axis]) for p in parts)
    set_segments(walk, node, weight, tuple(s * unit for s in sizes))
    if op in ("split", "split_with_sizes"):
        size_arg = node.args[1]
        if isinstance(size_arg, int):
            walk.edit(node, "divide_arg", (1,))
        else:
            for position in range(len(size_arg)):
                walk.edit(node, "divide_arg", (1, position))
    for position in range(len(parts)):
        walk.states[f"{node.name}[{position}]"] = sharded(dim)
    walk.states[node.name] = sharded(dim)


__all__ = ["ALONG_DIM", "CASTS", "EXPANDS", "LIKE", "NEW", "factory", "LINEAR", "NORMS", "POINTWISE", "REDUCTIONS", "REORDERS", "SDPA",
           "SPLITS", "VIEWS", "expand", "getitem", "map_view_dim", "pointwise", "pointwise_body", "reorder",
           "segments_of", "shape_args", "split", "view", "view_candidates", "weight_matmul", "weight_of"]
