"""Tensor-parallel recognition: the one place that decides how a model is split over TP ranks.

A data-flow pass over the torch-level graph capture produced (the program that runs). Every
value of a layer gets a state: ``R`` (replicated: the layer input, shared tables), ``("S", d)``
(split along dimension ``d`` over the ranks: features, heads), ``P`` (a partial sum every rank
holds a share of) or ``C`` (not an activation: sizes, flags). Megatron's rules follow from it:

- a linear whose weight is a parameter and whose input is ``R`` is **column-parallel** (its
  weight and bias split along the output features, its output ``S``; the input's gradient is
  all-reduced, so it goes through ``copy_in``); with an ``S`` input it is **row-parallel** (the
  weight split along the input features, the output ``P``, its bias added once after the
  all-reduce). ``nn.Linear`` and GPT-2's ``Conv1D`` (``addmm`` with an ``[in, out]`` weight) alike;
- views, reshapes and expands of a split value move the split to the matching output dimension,
  and a head count written as a number (``view(B, T, 12, -1)``) is rewritten to the per-rank
  count (``divide_arg``); transposes, slices and pointwise code keep it; attention over split
  heads is split; a split of a column-parallel output along its split dimension (fused q/k/v)
  splits each part separately (the weight's ``segments``);
- a partial sum stays partial through additions of partial sums and is all-reduced
  (``reduce_out``) where anything else reads it, or where the layer ends;
- the token embedding (indexed by ``input_ids``) is split over the vocabulary and the head that
  only feeds the cross-entropy becomes column-parallel with a vocabulary-parallel loss; a tied
  embedding/head is split only when both sides are.
Anything else reaching a split value (a norm or a reduction over split features, a split value
meeting a replicated one of full size) makes tensor parallelism unsupported for the model, with
a message naming the layer, the op and the user's source line. The outcome
(:class:`~mist_compiler.ir.model_graph.TensorParallelPlan`, assembled by ``tp_model``) is what the
cost model prices and what ``tp_sharding`` applies; ``tp_check`` proves it on the model before any training.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field, replace

import torch
import torch.fx as fx

from ..ir.model_graph import GraphEdit, RegionSharding, ShardSpec

R, P, C = "R", "P", "C"


class NotShardable(Exception):
    """Internal: the region cannot be split; the message says where and why."""


def sharded(dim: int) -> tuple:
    return ("S", dim)


def is_sharded(state) -> bool:
    return isinstance(state, tuple)


_POINTWISE = {
    "add", "sub", "mul", "truediv", "div", "neg", "pow", "rsqrt", "sqrt", "exp", "log", "tanh", "sigmoid", "relu",
    "gelu", "silu", "dropout", "where", "masked_fill", "clamp", "abs", "erf", "float", "to", "type_as", "half",
    "bfloat16", "contiguous", "clone", "detach", "softplus", "mish", "square", "reciprocal", "sin", "cos",
    "floordiv", "mod", "sub_", "add_", "mul_", "fill_", "masked_fill_", "relu_", "leaky_relu", "elu", "logsigmoid",
    "hardtanh", "iadd", "imul", "isub", "itruediv",
}
_VIEWS = {"view", "reshape", "view_as", "flatten", "unflatten", "expand", "expand_as"}
_REDUCTIONS = {"mean", "sum", "amax", "amin", "max", "min", "norm", "var", "std", "logsumexp", "prod", "argmax", "argmin"}
_ALONG_DIM = {"softmax", "log_softmax", "cumsum"}
FUSED_LOSS = "linear_cross_entropy.default"  # op_of(torch.ops.mist.linear_cross_entropy.default)
_NORMS = {"layer_norm", "rms_norm", "group_norm", "batch_norm", "instance_norm"}
_LINEAR = {"linear"}
_SDPA = {"scaled_dot_product_attention"}
_SPLITS = {"split", "chunk", "unbind", "tensor_split", "split_with_sizes"}


def op_of(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    if node.target is operator.getitem:
        return "getitem"
    return getattr(node.target, "__name__", str(node.target))


def _is_tensor_value(value) -> bool:
    if isinstance(value, (tuple, list)):
        return any(isinstance(v, torch.Tensor) for v in value)
    return isinstance(value, torch.Tensor)


def _value(node) -> object:
    return node.meta.get("example_value") if isinstance(node, fx.Node) else node


def _shape(node) -> list[int]:
    """Concrete example sizes (dynamo's hints) of a node's tensor value."""
    value = _value(node)
    sizes = []
    for d in value.shape:
        sizes.append(int(d.node.hint) if isinstance(d, torch.SymInt) and d.node.hint is not None else int(d))
    return sizes


def source_line(node: fx.Node) -> str:
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    frames = [i for i, line in enumerate(trace) if line.strip().startswith("File ")]
    if not frames:
        return ""
    last = frames[-1]
    code = trace[last + 1].strip() if last + 1 < len(trace) else ""
    where = trace[last].strip().replace("File ", "")
    return f" ({where}: {code})" if code else f" ({where})"


def map_view_dim(in_shape: list[int], out_shape: list[int], dim: int) -> int | None:
    """The output dimension that carries a split of input dimension ``dim`` through a view (row-major
    regrouping of the sizes), or None when the split would not stay contiguous."""
    ins = [(i, s) for i, s in enumerate(in_shape) if s != 1]
    outs = [(j, s) for j, s in enumerate(out_shape) if s != 1]
    i = j = 0
    while i < len(ins) and j < len(outs):
        group_in, group_out = [ins[i]], [outs[j]]
        size_in, size_out = ins[i][1], outs[j][1]
        i, j = i + 1, j + 1
        while size_in != size_out:
            if size_in < size_out:
                if i >= len(ins):
                    return None
                group_in.append(ins[i])
                size_in *= ins[i][1]
                i += 1
            else:
                if j >= len(outs):
                    return None
                group_out.append(outs[j])
                size_out *= outs[j][1]
                j += 1
        if any(index == dim for index, _ in group_in):
            return group_out[0][0] if group_in[0][0] == dim else None
    return None


def _shape_args(node: fx.Node) -> tuple[list, tuple]:
    """The shape arguments of a view/reshape/expand and the position prefix to reach them."""
    args = node.args[1:]
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        return list(args[0]), (1,)
    if len(args) == 1 and isinstance(args[0], fx.Node) and args[0].target is torch.Size:
        return list(args[0].args[0]), ("size_node",)
    return list(args), ()


@dataclass
class _Walk:
    """One pass over one region's nodes, computing states, shards and edits."""

    graph: fx.Graph
    label: str
    params: set[str]  # parameter placeholders of this region
    states: dict[str, object] = field(default_factory=dict)
    sharding: RegionSharding = field(default_factory=RegionSharding)
    sizes: list[int] = field(default_factory=list)  # sizes split over the ranks (for the granularity)
    column_out: dict[str, str] = field(default_factory=dict)  # value -> weight of the column-parallel linear it is
    column_bias: dict[str, str] = field(default_factory=dict)  # column-parallel weight -> its bias
    copied: set[str] = field(default_factory=set)
    pending_bias: dict[str, tuple[str, ...]] = field(default_factory=dict)  # P value -> biases to add after reduce

    def state(self, arg) -> object:
        if isinstance(arg, fx.Node):
            return self.states.get(arg.name, C)
        return C

    def fail(self, node: fx.Node, why: str):
        raise NotShardable(f"{self.label}: {node.name} ({op_of(node)}) {why}{source_line(node)}")

    def edit(self, node: fx.Node, kind: str, position: tuple = (), data: tuple = ()) -> None:
        self.sharding.edits.append(GraphEdit(node.name, kind, position, data))

    def shard(self, param: fx.Node, spec: ShardSpec, size: int) -> None:
        previous = self.sharding.shards.get(param.name)
        if previous is not None and previous != spec:
            raise NotShardable(f"{self.label}: parameter {param.name} would be split two ways ({previous}, {spec})")
        self.sharding.shards[param.name] = spec
        self.sizes.extend(spec.segments or (size,))

    # ---- reductions of partial sums ----------------------------------------------------------
    def reduce(self, node: fx.Node) -> None:
        """All-reduce the partial sum ``node`` (with its deferred biases); it becomes replicated."""
        self.edit(node, "reduce_out", data=self.pending_bias.pop(node.name, ()))
        self.states[node.name] = R

    def full_inputs(self, node: fx.Node, keep_partial: bool = False) -> list:
        states = []
        for arg in node.all_input_nodes:
            if self.state(arg) == P and not keep_partial:
                self.reduce(arg)
            states.append(self.state(arg))
        return states


def _weight(node: fx.Node, params: set[str]) -> fx.Node | None:
    """The parameter a matmul multiplies by: ``linear(x, W)``, ``addmm(b, x, W)``, ``x @ W``."""
    op = op_of(node)
    if op not in _LINEAR and op not in ("addmm", "matmul", "mm"):
        return None
    position = 2 if op == "addmm" else 1
    if op in _LINEAR and len(node.args) < 2:
        candidate = node.kwargs.get("weight")
    else:
        candidate = node.args[position] if len(node.args) > position else None
    if isinstance(candidate, fx.Node) and candidate.op == "placeholder" and candidate.name in params:
        return candidate
    return None


def _dim_arg(node: fx.Node, position: int, name: str, default=None):
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, default)


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _step(walk: _Walk, node: fx.Node) -> None:
    """Set the state of ``node`` from its inputs' (the rules of the module docstring)."""
    op = op_of(node)
    tensors = [a for a in node.all_input_nodes if _is_tensor_value(_value(a))]
    states = [walk.state(a) for a in tensors]
    if not any(s in (R, P) or is_sharded(s) for s in states):
        walk.states[node.name] = C  # nothing of the activations flows here
        return
    if op in _LINEAR or op in ("addmm", "matmul", "mm") and _weight(node, walk.params) is not None:
        return _weight_matmul(walk, node, op)
    if op in ("add", "sub", "iadd", "isub") and states and all(s == P for s in states):
        walk.states[node.name] = P
        biases = tuple(b for a in tensors for b in walk.pending_bias.pop(a.name, ()))
        if biases:
            walk.pending_bias[node.name] = biases
        return
    states = walk.full_inputs(node)
    if all(s in (R, C) for s in states):
        walk.states[node.name] = R
        return
    split = {s for s in states if is_sharded(s)}
    if op in _VIEWS:
        return _view(walk, node, op)
    if op in ("transpose", "permute", "t", "unsqueeze", "squeeze", "movedim", "swapaxes"):
        return _reorder(walk, node, op)
    if op == "getitem":
        return _getitem(walk, node)
    if op in _SPLITS:
        return _split(walk, node, op)
    if op in _SDPA:
        return _attention(walk, node)
    if op in ("cat", "stack", "concat"):
        return _concat(walk, node, op)
    if op == "repeat_interleave":
        return _repeat_interleave(walk, node)
    if op == "matmul" or op == "bmm":
        return _activation_matmul(walk, node)
    if op in _NORMS:
        walk.fail(node, "normalises over tensor-parallel-split features")
    if op in _REDUCTIONS or op in _ALONG_DIM:
        return _reduction(walk, node, op)
    if op in ("size", "dim", "numel"):
        walk.states[node.name] = C
        return
    if op in _POINTWISE:
        return _pointwise(walk, node, tensors, split)
    walk.fail(node, f"is not known to the tensor-parallel rules (input states {states})")


def _weight_matmul(walk: _Walk, node: fx.Node, op: str) -> None:
    weight = _weight(node, walk.params)
    if weight is None:
        return _activation_matmul(walk, node)
    if op in _LINEAR:
        x, bias = node.args[0], _dim_arg(node, 2, "bias")
        out_dim, in_dim = 0, 1
    elif op == "addmm":
        bias, x = node.args[0], node.args[1]
        out_dim, in_dim = 1, 0
    else:
        x, bias = node.args[0], None
        out_dim, in_dim = 1, 0
    if x is weight:
        walk.fail(node, "multiplies by a weight from the left; only x @ W and linear(x, W) can be split")
    state = walk.state(x)
    if state == P:
        walk.reduce(x)
        state = R
    rows = _shape(weight)
    if state == R:  # column-parallel
        walk.shard(weight, ShardSpec(out_dim), rows[out_dim])
        if isinstance(bias, fx.Node) and bias.name in walk.params:
            walk.shard(bias, ShardSpec(0), _shape(bias)[0])
            walk.column_bias[weight.name] = bias.name
        if x.name not in walk.copied:
            walk.edit(x, "copy_in")
            walk.copied.add(x.name)
        walk.states[node.name] = sharded(len(_shape(node)) - 1)
        walk.column_out[node.name] = weight.name
        return
    if is_sharded(state) and state[1] == len(_shape(x)) - 1:  # row-parallel
        walk.shard(weight, ShardSpec(in_dim), rows[in_dim])
        walk.states[node.name] = P
        if isinstance(bias, fx.Node):
            walk.edit(node, "defer_bias")
            walk.pending_bias[node.name] = (bias.name,)
        return
    walk.fail(node, f"reads a value split along dimension {state[1]}, not its features")


def _activation_matmul(walk: _Walk, node: fx.Node) -> None:
    a, b = node.args[0], node.args[1]
    sa, sb = walk.state(a), walk.state(b)
    na, nb = len(_shape(a)), len(_shape(b))
    if is_sharded(sa) and is_sharded(sb) and sa[1] < na - 2 and sa[1] - na == sb[1] - nb:
        walk.states[node.name] = sharded(sa[1] + len(_shape(node)) - na)
        return
    walk.fail(node, "multiplies split values in a way the rules cannot split (only over split heads)")


def _pointwise(walk: _Walk, node: fx.Node, tensors: list[fx.Node], split: set) -> None:
    if len(split) > 1:
        walk.fail(node, f"combines values split along different dimensions {sorted(split)}")
    out = _shape(node)
    (_, dim), = split
    source = next(a for a in tensors if is_sharded(walk.state(a)))
    from_end = dim - len(_shape(source))
    for arg in tensors:
        if walk.state(arg) in (R, C):
            shape = _shape(arg)
            position = len(shape) + from_end
            if 0 <= position < len(shape) and shape[position] != 1:
                walk.fail(node, f"combines a split value with the replicated {arg.name} of full size along the "
                                "split dimension")
    walk.states[node.name] = sharded(len(out) + from_end)
    if source.name in walk.column_out and op_of(node) in ("float", "to", "contiguous", "type_as", "dropout"):
        walk.column_out[node.name] = walk.column_out[source.name]


def _view(walk: _Walk, node: fx.Node, op: str) -> None:
    source = node.args[0]
    state = walk.state(source)
    out_dim = map_view_dim(_shape(source), _shape(node), state[1])
    if out_dim is None:
        walk.fail(node, "regroups a split dimension so that the split would not stay contiguous")
    walk.sizes.append(_shape(node)[out_dim])
    if op in ("view", "reshape", "expand"):
        values, prefix = _shape_args(node)
        if out_dim >= len(values) and op != "expand":
            walk.fail(node, "has a shape argument the rules cannot read")
        offset = len(values) - len(_shape(node)) if op == "expand" else 0
        entry = values[out_dim + offset] if 0 <= out_dim + offset < len(values) else -1
        if isinstance(entry, int) and entry != -1:
            if prefix == ("size_node",):
                size_node = node.args[1]
                if len(size_node.users) != 1:
                    walk.fail(node, "takes a shape other values share")
                walk.edit(size_node, "divide_arg", (0, out_dim + offset))
            else:
                walk.edit(node, "divide_arg", (*prefix, out_dim + offset) if prefix else (1 + out_dim + offset,))
        elif isinstance(entry, fx.Node):
            walk.fail(node, f"takes a computed size ({entry.name}) for the split dimension")
    elif op == "unflatten":
        walk.fail(node, "unflattens a split dimension")
    walk.states[node.name] = sharded(out_dim)
    if source.name in walk.column_out:
        walk.column_out[node.name] = walk.column_out[source.name]


def _reorder(walk: _Walk, node: fx.Node, op: str) -> None:
    source = node.args[0]
    dim = walk.state(source)[1]
    ndim_in, ndim_out = len(_shape(source)), len(_shape(node))
    if op in ("transpose", "swapaxes"):
        a, b = (_norm_dim(int(d), ndim_in) for d in node.args[1:3])
        new = b if dim == a else a if dim == b else dim
    elif op == "t":
        new = 1 - dim if ndim_in == 2 else dim
    elif op == "permute":
        order = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
        new = [_norm_dim(int(d), ndim_in) for d in order].index(dim)
    elif op == "movedim":
        src, dst = _norm_dim(int(node.args[1]), ndim_in), _norm_dim(int(node.args[2]), ndim_in)
        order = [d for d in range(ndim_in) if d != src]
        order.insert(dst, src)
        new = order.index(dim)
    elif op == "unsqueeze":
        at = _norm_dim(int(node.args[1]), ndim_out)
        new = dim + 1 if at <= dim else dim
    else:  # squeeze
        removed = [i for i in range(ndim_in) if _shape(source)[i] == 1 and i not in (dim,)]
        if len(node.args) > 1:
            removed = [_norm_dim(int(d), ndim_in) for d in (node.args[1] if isinstance(node.args[1], (tuple, list))
                                                           else [node.args[1]])]
            removed = [d for d in removed if _shape(source)[d] == 1]
        new = dim - sum(1 for r in removed if r < dim)
    walk.states[node.name] = sharded(new)


def _getitem(walk: _Walk, node: fx.Node) -> None:
    source, index = node.args
    state = walk.state(source)
    if isinstance(_value(source), (tuple, list)):  # an item of a split
        walk.states[node.name] = walk.states.get(f"{source.name}[{index}]", state)
        return
    dim = state[1]
    items = list(index) if isinstance(index, tuple) else [index]
    ndim = len(_shape(source))
    if any(isinstance(i, fx.Node) and isinstance(_value(i), torch.Tensor) for i in items):
        walk.fail(node, "indexes a split value with a tensor")
    explicit = sum(1 for i in items if i is not None and i is not Ellipsis)
    expanded: list = []
    for item in items:
        if item is Ellipsis:
            expanded += [slice(None)] * (ndim - explicit)
        else:
            expanded.append(item)
    expanded += [slice(None)] * (ndim - sum(1 for i in expanded if i is not None))
    out, in_dim = 0, 0
    for item in expanded:
        if item is None:
            out += 1
            continue
        if in_dim == dim:
            if not (isinstance(item, slice) and item == slice(None)):
                walk.fail(node, "slices the split dimension")
            walk.states[node.name] = sharded(out)
            return
        if not isinstance(item, (int, fx.Node)):
            out += 1
        in_dim += 1
    walk.fail(node, "indexing the rules cannot follow")


def _split(walk: _Walk, node: fx.Node, op: str) -> None:
    source = node.args[0]
    dim = walk.state(source)[1]
    ndim = len(_shape(source))
    axis = _norm_dim(int(_dim_arg(node, 2, "dim", 0)), ndim) if op != "unbind" else _norm_dim(int(_dim_arg(node, 1, "dim", 0)), ndim)
    parts = _value(node)
    if axis != dim:
        for position in range(len(parts)):
            walk.states[f"{node.name}[{position}]"] = sharded(dim)
        walk.states[node.name] = sharded(dim)
        return
    weight = walk.column_out.get(source.name)
    if weight is None or op == "unbind":
        walk.fail(node, "splits a split dimension that does not come straight from a column-parallel linear")
    sizes = tuple(int(p.shape[axis]) for p in parts)
    spec = walk.sharding.shards[weight]
    walk.sharding.shards[weight] = replace(spec, segments=sizes)
    bias = walk.column_bias.get(weight)
    if bias is not None:
        walk.sharding.shards[bias] = ShardSpec(0, sizes)
    walk.sizes.extend(sizes)
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


def _attention(walk: _Walk, node: fx.Node) -> None:
    kwargs = {**dict(zip(("query", "key", "value", "attn_mask"), node.args)), **node.kwargs}
    q, k, v = kwargs["query"], kwargs["key"], kwargs["value"]
    states = {walk.state(t) for t in (q, k, v)}
    heads = len(_shape(q)) - 3
    if states != {sharded(heads)}:
        walk.fail(node, f"attends over query/key/value that are not all split by heads ({states})")
    mask = kwargs.get("attn_mask")
    if isinstance(mask, fx.Node) and is_sharded(walk.state(mask)):
        walk.fail(node, "takes a split attention mask")
    if isinstance(mask, fx.Node) and _shape(mask)[heads] != 1:
        walk.fail(node, "takes a per-head attention mask")
    walk.states[node.name] = sharded(heads)


def _concat(walk: _Walk, node: fx.Node, op: str) -> None:
    parts = node.args[0]
    states = {walk.state(p) for p in parts}
    split = {s for s in states if is_sharded(s)}
    if len(split) != 1 or states - split - {C}:
        walk.fail(node, f"joins split and replicated values ({states})")
    (_, dim), = split
    axis = _norm_dim(int(_dim_arg(node, 1, "dim", 0)), len(_shape(parts[0])))
    if op == "cat" and axis == dim:
        walk.fail(node, "concatenates along the split dimension")
    walk.states[node.name] = sharded(dim if op == "cat" or axis > dim else dim + 1)


def _repeat_interleave(walk: _Walk, node: fx.Node) -> None:
    walk.states[node.name] = walk.state(node.args[0])


def _reduction(walk: _Walk, node: fx.Node, op: str) -> None:
    source = node.args[0]
    dim = walk.state(source)[1]
    ndim = len(_shape(source))
    axis = _dim_arg(node, 1, "dim")
    axes = [] if axis is None else [_norm_dim(int(a), ndim) for a in (axis if isinstance(axis, (tuple, list)) else [axis])]
    if not axes or dim in axes:
        walk.fail(node, "reduces over tensor-parallel-split features")
    keep = op in _ALONG_DIM or bool(_dim_arg(node, 2, "keepdim", False))
    walk.states[node.name] = sharded(dim if keep else dim - sum(1 for a in axes if a < dim))


def recognise_region(graph: fx.Graph, nodes: list[fx.Node], inputs: list[str], params: set[str], label: str,
                     output: str) -> tuple[RegionSharding, list[int]]:
    """Walk one layer region from replicated inputs; its output must end replicated."""
    walk = _Walk(graph, label, params)
    for name in inputs:
        walk.states[name] = R
    for node in nodes:
        _step(walk, node)
    out = next(n for n in nodes if n.name == output) if output in walk.states else None
    if out is not None and walk.state(out) == P:
        walk.reduce(out)
    if out is not None and is_sharded(walk.state(out)):
        raise NotShardable(f"{label}: its output {output} would be split over the ranks")
    unused = sorted(p for p in params if p not in walk.sharding.shards and _used_as_weight(graph, p, params))
    if unused:
        raise NotShardable(f"{label}: weights {unused} are on no column/row-parallel path")
    return walk.sharding, walk.sizes


def _used_as_weight(graph: fx.Graph, name: str, params: set[str]) -> bool:
    node = next((n for n in graph.nodes if n.name == name), None)
    return node is not None and any(_weight(u, params) is node for u in node.users)


__all__ = ["map_view_dim", "recognise_region"]
