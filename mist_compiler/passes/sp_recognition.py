"""Sequence-parallel recognition: can a layer's code outside its tensor-parallel regions run on a
chunk of the sequence, and where are the edges to rewrite?

Megatron's sequence parallelism (Korthikanti et al. 2023) splits the values *between* the
tensor-parallel regions (layer norms, dropout, residual adds: replicated on every TP rank without
it) along the sequence. That is only right when that code works token by token. A data-flow pass
over each layer region of the torch-level graph, after ``tp_recognition``:

- the hidden state entering the layer is *sequence-split* (``Q``) along its sequence dimension
  (the dimension whose size is the batch input's sequence length);
- a value the tensor-parallel plan copies into a column-parallel linear (``copy_in``) is gathered
  there (its column-parallel readers read the whole sequence); a partial sum it all-reduces
  (``reduce_out``) is reduce-scattered instead and becomes ``Q``;
- any other op reading a ``Q`` value must be token-wise: pointwise code, a norm or a reduction
  over other dimensions than the sequence, casts, dropout. Its other tensor inputs may be weights,
  scalars or values without a whole-sequence dimension lined up with the split one; its output is
  ``Q`` (the sequence dimension followed through broadcasting and kept-dim reductions);
- the layer's output must be ``Q``.
Anything else (a view or slice of a split value, attention over it, a value spanning the whole
sequence meeting a split one) makes sequence parallelism unsupported for the model, with a
message naming the layer, the op and the user's source line. The outcome
(:class:`~mist_compiler.ir.model_graph.SequenceParallelPlan`) is what the ``sequence_parallel``
lowering pass applies and what the stage cost model prices.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..ir.model_graph import (
    PARAMETER,
    LayerRegion,
    ModelGraph,
    SequenceParallelPlan,
    SequenceRegion,
    TensorParallelPlan,
)
from .tp_walk import op_of, source_line

# torch-level ops that work position by position along every dimension they do not reduce over
POINTWISE = {
    "add", "sub", "mul", "truediv", "div", "neg", "pow", "rsqrt", "sqrt", "exp", "log", "tanh", "sigmoid", "relu",
    "gelu", "silu", "where", "masked_fill", "clamp", "abs", "erf", "softplus", "mish", "square", "reciprocal",
    "leaky_relu", "elu", "logsigmoid", "hardtanh", "iadd", "imul", "isub", "itruediv", "add_", "mul_", "sub_",
    "float", "to", "type_as", "half", "bfloat16", "contiguous", "clone", "detach", "dropout", "dropout_",
    "alpha_dropout", "feature_alpha_dropout",
}
NORMS = {"layer_norm", "rms_norm", "group_norm"}
REDUCTIONS = {"mean", "sum", "amax", "amin", "norm", "var", "std", "logsumexp", "prod"}
ALONG_DIM = {"softmax", "log_softmax"}
COLUMN_MATMULS = {"linear": 0, "addmm": 1, "matmul": 1, "mm": 1}  # op -> the weight dim a column split uses


class NotSequenceParallel(Exception):
    """Internal: the region cannot run sequence-parallel; the message says where and why."""


def _value(node) -> object:
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def sequence_symbol(model: ModelGraph):
    """The sympy symbol of the sequence length (the batch input's dimension 1), or None."""
    for placeholder, (source, dim) in model.sizes.items():
        if source == "input_ids" and dim == 1:
            value = model.node(placeholder).meta.get("example_value")
            if isinstance(value, torch.SymInt):
                return value.node.expr
    return None


def sequence_dim(node: fx.Node, symbol) -> int | None:
    """The dimension of ``node``'s tensor whose size is the sequence length itself, or None."""
    value = _value(node)
    if not isinstance(value, torch.Tensor) or symbol is None:
        return None
    dims = [d for d, size in enumerate(value.shape) if isinstance(size, torch.SymInt) and size.node.expr == symbol]
    return dims[0] if len(dims) == 1 else None


def _is_column_matmul(node: fx.Node, source: fx.Node, tp: TensorParallelPlan, region: str) -> bool:
    """``node`` multiplies ``source`` by a weight the tensor-parallel plan splits by columns."""
    op = op_of(node)
    if node.op == "call_method" or op not in COLUMN_MATMULS:
        return False
    position_x, position_w = (1, 2) if op == "addmm" else (0, 1)
    if len(node.args) <= position_x or node.args[position_x] is not source:
        return False
    weight = node.args[position_w] if len(node.args) > position_w else node.kwargs.get("weight")
    spec = tp.regions.get(region)
    spec = spec.shards.get(weight.name) if spec is not None and isinstance(weight, fx.Node) else None
    return spec is not None and spec.dim == COLUMN_MATMULS[op]


class _Walk:
    """One pass over one layer region, following the sequence-split values."""

    def __init__(self, model: ModelGraph, region: LayerRegion, symbol) -> None:
        self.model, self.region, self.symbol = model, region, symbol
        self.label = f"layer {model.layer_list}.{region.layers[0]}"
        tp = model.tp.regions.get(region.label)
        self.copy_in = {e.node for e in tp.edits if e.kind == "copy_in"} if tp is not None else set()
        self.reduce_out = {e.node for e in tp.edits if e.kind == "reduce_out"} if tp is not None else set()
        self.split: dict[str, int] = {}  # Q value -> its sequence dimension
        self.params = {p for p in region.params if model.tensors.get(p, ("", ""))[0] == PARAMETER}

    def fail(self, node: fx.Node, why: str):
        raise NotSequenceParallel(f"{self.label}: {node.name} ({op_of(node)}) {why}{source_line(node)}")

    def dim_of(self, reader: fx.Node, arg) -> int | None:
        """The sequence dimension of ``arg`` as ``reader`` reads it, if it is split."""
        if not isinstance(arg, fx.Node):
            return None
        if arg.name == self.region.carried_in:
            return self.split.get(arg.name) if reader.name in self.region.hidden_users else None
        return self.split.get(arg.name)

    def walk(self) -> SequenceRegion:
        by_name = self.model._by_name()
        hidden = by_name[self.region.carried_in]
        hidden_dim = sequence_dim(hidden, self.symbol)
        if hidden_dim is None:
            raise NotSequenceParallel(f"{self.label}: its hidden state {tuple(_value(hidden).shape)} has no dimension "
                                      "of the sequence's length")
        self.split[hidden.name] = hidden_dim
        sequence = SequenceRegion(hidden_dim)
        for name in self.region.nodes:
            self.step(by_name[name], sequence)
        out = self.region.carried_out
        if out not in self.split:
            raise NotSequenceParallel(f"{self.label}: its output {out} would not be split along the sequence")
        sequence.split_values = tuple(name for name in self.region.nodes if name in self.split)
        return sequence

    def step(self, node: fx.Node, sequence: SequenceRegion) -> None:
        split_inputs = [(arg, self.dim_of(node, arg)) for arg in node.all_input_nodes]
        split_inputs = [(arg, dim) for arg, dim in split_inputs if dim is not None]
        if node.name in self.reduce_out:  # the partial sum is reduce-scattered: split from here on
            dim = sequence_dim(node, self.symbol)
            if dim is None:
                self.fail(node, "is a partial sum without a dimension of the sequence's length to reduce-scatter along")
            sequence.scatters[node.name] = dim
            self.split[node.name] = dim
            return
        if not split_inputs:
            return
        if all(_is_column_matmul(node, arg, self.model.tp, self.region.label) and arg.name in self.copy_in
               for arg, _ in split_inputs):
            for arg, dim in split_inputs:
                sequence.gathers[arg.name] = dim  # its column-parallel readers read the whole sequence
            return
        op = op_of(node)
        (first, dim), *rest = split_inputs
        if any(d - len(_value(a).shape) != dim - len(_value(first).shape) for a, d in rest):
            self.fail(node, "combines values split along different dimensions")
        out = _value(node)
        if not isinstance(out, torch.Tensor):
            self.fail(node, "turns a sequence-split value into something else than a tensor (a size or a tuple)")
        offset = dim - len(_value(first).shape)  # the split dimension counted from the end
        if op in POINTWISE:
            self.check_partners(node, {a.name for a, _ in split_inputs}, offset)
            self.split[node.name] = len(out.shape) + offset
        elif op in NORMS:
            self.check_norm(node, first, dim)
            self.check_partners(node, {a.name for a, _ in split_inputs}, offset)
            self.split[node.name] = len(out.shape) + offset
        elif op in REDUCTIONS or op in ALONG_DIM:
            self.split[node.name] = self.reduced_dim(node, first, dim, op)
        else:
            self.fail(node, "reads a sequence-split value but is not a token-wise op (pointwise, norm, reduction)")

    def check_partners(self, node: fx.Node, split: set[str], offset: int) -> None:
        """The other tensor inputs must not span the whole sequence along the split dimension."""
        for arg in node.all_input_nodes:
            value = _value(arg)
            if arg.name in split and self.dim_of(node, arg) is not None or not isinstance(value, torch.Tensor):
                continue
            position = len(value.shape) + offset
            if 0 <= position < len(value.shape) and not (isinstance(value.shape[position], int) and value.shape[position] == 1):
                self.fail(node, f"combines the sequence-split value with {arg.name} {tuple(value.shape)}, which spans the "
                                "whole sequence")

    def check_norm(self, node: fx.Node, source: fx.Node, dim: int) -> None:
        shape = node.args[1] if len(node.args) > 1 else node.kwargs.get("normalized_shape")
        count = len(shape) if isinstance(shape, (tuple, list)) else 1
        if op_of(node) == "group_norm" or dim >= len(_value(source).shape) - count:
            self.fail(node, "normalises over the sequence dimension")

    def reduced_dim(self, node: fx.Node, source: fx.Node, dim: int, op: str) -> int:
        ndim = len(_value(source).shape)
        axis = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        axes = [] if axis is None else [a + ndim if a < 0 else a for a in (axis if isinstance(axis, (tuple, list)) else [axis])]
        if not all(isinstance(a, int) for a in axes) or not axes or dim in axes:
            self.fail(node, "reduces over the sequence dimension")
        keep = op in ALONG_DIM or bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
        return dim if keep else dim - sum(1 for a in axes if a < dim)


def recognise_sequence_parallel(model: ModelGraph) -> SequenceParallelPlan:
    """The sequence-parallel plan of a captured model (see the module docstring)."""
    if model.tp is None or not model.tp.supported:
        return SequenceParallelPlan(False, "sequence parallelism needs tensor parallelism, which this model cannot use"
                                    + (f": {model.tp.reason}" if model.tp is not None and model.tp.reason else ""))
    symbol = sequence_symbol(model)
    if symbol is None:
        return SequenceParallelPlan(False, "the model's sequence length is not a symbolic size of its input_ids")
    regions = {}
    try:
        for region in model.regions:
            regions[region.label] = _Walk(model, region, symbol).walk()
    except NotSequenceParallel as error:
        return SequenceParallelPlan(False, str(error))
    return SequenceParallelPlan(True, "", regions)


__all__ = ["NotSequenceParallel", "recognise_sequence_parallel", "sequence_dim", "sequence_symbol"]
