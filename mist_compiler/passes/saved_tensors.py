"""Saved-tensor table: what each node of a layer's program keeps for the backward, and what re-running it costs.

The per-tensor checkpoint/offload MILP (``tuner.activation_milp``) decides, for every node of a
layer's torch-level program (the program the runtime runs, ``ModelGraph`` region), whether the
tensors autograd keeps for it stay on the device, go to host memory (a fraction of their bytes),
or are dropped and recomputed in the backward by running the node again. This analysis pass gives
it, per node (a :class:`LayerTensor`, symbolic in ``b``, ``s``, ``t``):

- ``saved``: the bytes of the saved storages it creates (its outputs other nodes' backward reads, and
  what its own ops keep inside, e.g. a norm's statistics), from ``memory_analysis`` per storage and
  mapped to the node through the ATen nodes' ``from_node`` provenance; the layer's inputs (its
  hidden state) get their own row;
- ``output``: the bytes of its output, what keeping it around for a recomputation costs when
  autograd does not keep it anyway (``output_saved``);
- ``cost``: the (op class, FLOPs, bytes) of its ATen ops, what running it again costs (priced by the
  stage model's op-time rules);
- ``inputs``: the nodes (and layer inputs) whose outputs it reads: a recomputation needs them;
- whether it may be recomputed (not random; not a partial sum the tensor-parallel lowering reduces,
  nor reading one) and offloaded.

Tables are made for the program priced without and with sequence parallelism (``sp_pricing``), as
``program.analysis.tensors``: ``{"tp": LayerTensors, "sp": LayerTensors | None}``.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

import sympy
import torch
import torch.fx as fx

from ..ir.model_graph import PARAMETER, LayerRegion, ModelGraph
from ..ir.program import MistProgram
from .cost_annotation import T, is_view, tensor_bytes, value_bytes
from .manager import PassResult, transforms
from .memory_analysis import owns_storage

MATMUL_OPS = {"linear", "matmul", "mm", "addmm", "bmm", "baddbmm", "einsum"}
ATTENTION_OPS = {"scaled_dot_product_attention"}
ACTIVATIONS = {"gelu", "silu", "relu", "tanh", "sigmoid", "softplus", "mish", "leaky_relu", "elu"}
RANDOM_OPS = {"dropout", "dropout_", "alpha_dropout", "feature_alpha_dropout", "rand", "randn", "rand_like",
              "randn_like", "bernoulli"}


@dataclass(frozen=True)
class LayerTensor:
    """One node of a layer's program (or one of its inputs) as the activation MILP sees it."""

    tag: str  # its name in the layer's unit graph (a layer input: its placeholder, "<name>_in")
    kind: str  # "input", "matmul", "attention", "norm", "activation", "residual", "dropout", "elementwise"
    module: str  # module path inside the layer ("attn_norm", "mlp.up"); "" for the layer's own code
    saved: sympy.Expr  # bytes autograd keeps for it per micro-batch (one device)
    output: sympy.Expr  # bytes of its output (one device)
    output_saved: bool  # autograd keeps its output (so keeping it costs nothing more)
    cost: tuple[tuple[str, sympy.Expr, sympy.Expr], ...] = ()  # (op class, FLOPs, bytes) of its ops
    ops: int = 0  # kernels its ops launch
    inputs: tuple[str, ...] = ()  # tags of the activations it reads
    recomputable: bool = False  # with one tensor-parallel rank (see ``tp_reduced``)
    offloadable: bool = False
    tp_reduced: bool = False  # a row-parallel output all-reduced under TP, or reads one: not recomputed when tp > 1


@dataclass
class LayerTensors:
    """The saved-tensor table of one layer class, nodes in forward order."""

    tensors: dict[str, LayerTensor] = field(default_factory=dict)

    @property
    def saved(self) -> sympy.Expr:
        return sympy.Add(*(t.saved for t in self.tensors.values()))

    def kinds(self) -> dict[str, str]:
        return {tag: t.kind for tag, t in self.tensors.items()}


def _op(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target))


def _module(node: fx.Node, layer: str) -> tuple[str, str]:
    """(path inside the layer, class name) of the deepest module that issued ``node``; ``layer`` is the
    layer's own path suffix (``blocks.0``): dynamo writes paths as ``L['model'].blocks.0.attn_norm``."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", ""
    path, kind = list(stack.values())[-1]
    kind = getattr(kind, "__name__", str(kind)).rsplit(".", 1)[-1]
    path = str(path)
    _, found, rest = path.partition(layer)
    return (rest.lstrip(".") if found else path), kind


def kind_of(node: fx.Node, module_kind: str, module_path: str) -> str:
    op = _op(node)
    if op in MATMUL_OPS:
        return "matmul"
    if op in ATTENTION_OPS:
        return "attention"
    if op in RANDOM_OPS:
        return "dropout"
    if "norm" in module_kind.lower() or "norm" in op:
        return "norm"
    if op in ACTIVATIONS:
        return "activation"
    if op in ("add", "iadd") and module_path == "":
        return "residual"
    return "elementwise"


def _random(node: fx.Node) -> bool:
    if _op(node) not in RANDOM_OPS:
        return False
    probability = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    return not (isinstance(probability, (int, float)) and probability == 0)


def _is_tensor(node: fx.Node) -> bool:
    """A tensor, or a tuple of tensors (a chunk's parts), as a value of the program."""
    value = node.meta.get("example_value")
    return isinstance(value, torch.Tensor) or (isinstance(value, (tuple, list)) and bool(value)
                                               and all(isinstance(v, torch.Tensor) for v in value))


def _input_tag(region: LayerRegion, reader: fx.Node, arg: fx.Node) -> str | None:
    if arg.name == region.carried_in and reader.name in region.hidden_users:
        return f"{region.carried_in}_in"
    if arg.name in region.glue:
        return f"{arg.name}_glue" if arg.name == region.carried_in else f"{arg.name}_in"
    return None


def layer_tensors(model: ModelGraph, region: LayerRegion, forward: fx.GraphModule, names: set[str], costs,
                  memory, symbols: dict | None = None, sequence: bool = False) -> LayerTensors:
    """The table of ``region`` from the priced ATen forward graph (``names``: the layer block's nodes,
    ``symbols``: the graph's size symbols -> b, s), its costs (``cost_annotation.ProgramCosts``) and its
    memory (``memory_analysis.BlockMemory``); ``sequence``: priced with sequence parallelism."""
    by_name = model._by_name()
    prefix = f"{model.layer_list.rsplit('.', 1)[-1]}.{region.traced}" if model.layer_list else str(region.traced)
    states = costs.forward.states
    aten = {n.name: n for n in forward.graph.nodes}
    issued: dict[str, list[fx.Node]] = {}
    for node in forward.graph.nodes:
        sources = node.meta.get("from_node") or []
        if node.name in names and node.op == "call_function" and sources:
            issued.setdefault(sources[0].name, []).append(node)
    node_costs = {c.name: c for c in costs.forward.nodes}
    tp_region = model.tp.regions.get(region.label) if model.tp is not None and model.tp.supported else None
    reduced = {e.node for e in tp_region.edits if e.kind == "reduce_out"} if tp_region is not None else set()
    hidden = f"{region.carried_in}_in"
    glue = {g: (f"{g}_glue" if g == region.carried_in else f"{g}_in") for g in region.glue}
    members = set(region.nodes)
    saved_by: dict[str, sympy.Expr] = {}
    saved_bases: set[str] = set()
    for base, size in memory.saved_sizes.items():
        sources = aten[base].meta.get("from_node") if base in aten else None
        source = sources[0].name if sources else ""
        tag = source if source in members else glue.get(source, hidden if source == region.carried_in else OTHER)
        saved_by[tag] = saved_by.get(tag, sympy.Integer(0)) + size
        saved_bases.add(base)

    def output_of(nodes: list[fx.Node]) -> tuple[sympy.Expr, bool]:
        last = next((n for n in reversed(nodes) if isinstance(n.meta.get("val"), (torch.Tensor, tuple, list))), None)
        if last is None:
            return sympy.Integer(0), False
        base = last
        while is_view(base) and base.all_input_nodes and base.all_input_nodes[0].name in names:
            base = base.all_input_nodes[0]
        size = value_bytes(base, symbols)
        saved_here = base.name in saved_bases or any(owns_storage(item) and item.name in saved_bases for item in base.users)
        return sympy.expand(size / T if states.get(base.name) in ("S", "Q") else size), saved_here

    def example_bytes(node: fx.Node) -> sympy.Expr:
        value = node.meta.get("example_value")
        values = value if isinstance(value, (tuple, list)) else [value]
        return sympy.Add(*(tensor_bytes(v, symbols) for v in values if isinstance(v, torch.Tensor)))

    table = LayerTensors()
    for source, tag in [(region.carried_in, hidden), *glue.items()]:
        node = by_name[source]
        if not isinstance(node.meta.get("example_value"), torch.Tensor) or not node.meta["example_value"].is_floating_point():
            continue
        kept = sympy.expand(saved_by.get(tag, 0))
        output = example_bytes(node) / (T if sequence and tag == hidden else 1)
        table.tensors[tag] = LayerTensor(tag, "input", "", kept, sympy.expand(output), kept != 0,
                                         offloadable=tag == hidden and kept != 0)
    if saved_by.get(OTHER, 0) != 0:  # storages of no known node: kept as they are
        table.tensors[OTHER] = LayerTensor(OTHER, "input", "", sympy.expand(saved_by[OTHER]), sympy.Integer(0), True)
    params = {p for p in region.params if model.tensors.get(p, ("", ""))[0] == PARAMETER}
    for name in region.nodes:
        node = by_name[name]
        if node.op not in ("call_function", "call_method", "call_module") or not _is_tensor(node):
            continue
        path, module_kind = _module(node, prefix)
        ops = issued.get(name, [])
        output, output_saved = output_of(ops) if ops else (example_bytes(node), False)
        cost = tuple((node_costs[n.name].op_class, node_costs[n.name].flops, node_costs[n.name].bytes)
                     for n in ops if n.name in node_costs and node_costs[n.name].op_class != "view")
        reads = []
        for arg in node.all_input_nodes:
            if arg.name in params or not _is_tensor(arg):
                continue
            if arg.name in members:
                reads.append(arg.name)
            elif arg.name == region.carried_in and name in region.hidden_users:
                reads.append(hidden)
            elif arg.name in glue:
                reads.append(glue[arg.name])
        tp_reduced = name in reduced or any(r in reduced for r in reads)
        saved = sympy.expand(saved_by.get(name, 0))
        table.tensors[name] = LayerTensor(name, kind_of(node, module_kind, path), path, saved, output, output_saved,
                                          cost, len(cost), tuple(dict.fromkeys(reads)), not _random(node), saved != 0,
                                          tp_reduced)
    return table


OTHER = "<other>"  # saved storages the provenance does not place (kept)


def _program_tables(program: MistProgram, costs, memory: dict, sequence: bool) -> LayerTensors | None:
    graphs = program.analysis.graphs
    model = program.model_graph
    layer_ids = sorted({block.class_id for block in program.blocks if block.kind == "layer"})
    if model is None or len(layer_ids) != 1 or len(model.regions) != 1 and len({r.traced for r in model.regions}) != 1:
        return None
    class_id = layer_ids[0]
    return layer_tensors(model, model.regions[0], graphs.forward, graphs.blocks[class_id], costs, memory[class_id],
                         graphs.symbols, sequence)


@transforms(MistProgram)
def saved_tensor_table(program: MistProgram) -> PassResult:
    """Pass: the layer's saved-tensor table (module docstring) without and with sequence parallelism,
    as ``program.analysis.tensors``. Needs the cost annotation, the memory analysis and
    ``sequence_parallel_pricing`` before it."""
    priced = program.analysis
    tables = {"tp": _program_tables(program, priced.costs, priced.memory, False), "sp": None}
    if priced.sequence is not None:
        tables["sp"] = _program_tables(program, priced.sequence.costs, priced.sequence.memory, True)
    analysed = copy.copy(program)
    analysed.analysis = replace(priced, tensors=tables)
    return PassResult(analysed, False)


__all__ = ["LayerTensor", "LayerTensors", "kind_of", "layer_tensors", "saved_tensor_table"]
