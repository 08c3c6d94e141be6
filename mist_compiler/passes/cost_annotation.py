"""Cost annotation pass: FLOPs, bytes moved, op class and tensor-parallel sharding per IR node.

For every node of a block's captured forward and backward ATen graphs this pass derives
- ``flops``: sympy expression in ``b``, ``s``, ``t`` (formulas of ``torch.utils.flop_counter``'s
  ``flop_registry`` where it has one; our own for the attention ops it misses, e.g.
  ``_scaled_dot_product_flash_attention_for_cpu`` and its backward, which it counts as 0).
  Causal attention is counted at the **full** ``s^2`` (the MFU convention, and what the
  registry does for the CUDA kernels), not halved;
- ``bytes``: bytes read + written (inputs + outputs; metadata-only views move nothing);
- ``op_class``: ``matmul``, ``attention``, ``norm``, ``softmax`` (log-softmax / loss),
  ``embedding``, ``elementwise`` or ``view``, the key of the hardware profile's efficiency table;
- ``tp``: the node's tensor-parallel state, ``R`` replicated, ``S`` sharded by ``t``, ``P``
  partial sum (needs an all-reduce before any consumer but an add); priced with sequence
  parallelism (``sp_pricing``), ``Q``: split along the sequence by ``t``.

Tensor parallelism is *priced* here, not decided: ``tp_recognition`` (one recogniser, on the
torch-level graph that runs) says which parameters are split, and those are seeded ``S`` here.
The state then propagates over the ATen graphs: ``mm(S, S) -> P`` (the contraction runs over
the split dim: row-parallel forward, column-parallel input gradient), ``mm(S, R) -> S``, views
and pointwise ops keep ``S``, ``add(P, P) -> P``, and a ``P`` value consumed by anything else
gets an **all-reduce** (an IR collective with its byte count). That yields the forward
all-reduce after each row-parallel linear, the backward all-reduce of the column-parallel input
gradients (q+k+v summed first, then one all-reduce), the vocab-parallel embedding's all-reduce
and the small all-reduces of the parallel cross-entropy (max, sum of exponentials, target
logit), and those of the fused head + loss (``mist::linear_cross_entropy`` with a split weight,
run by ``ops.vocab_parallel``: two small all-reduces forward, the hidden gradient's backward).
A split value reaching an op that needs all features means pricing and the plan
disagree: tensor parallelism is then marked unsupported with a message, never priced wrong.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Iterable

import sympy
import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from ..ir.program import MistProgram
from ..ir.vocabulary import SYMBOLS, B, S, T
from .manager import PassResult, transforms

CANONICAL_SYMBOLS = SYMBOLS

aten = torch.ops.aten

ATTENTION_FORWARD = {
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "scaled_dot_product_attention", "_flash_attention_forward", "_efficient_attention_forward",
}
ATTENTION_BACKWARD = {f"{name}_backward" for name in ATTENTION_FORWARD} | {
    "_flash_attention_backward", "_efficient_attention_backward",
}
# the LM head fused with its loss (mist_compiler.ops): its FLOPs are the head's matmuls
FUSED_LOSS, FUSED_LOSS_BACKWARD = "linear_cross_entropy", "linear_cross_entropy_backward"
# grouped GEMMs of mixture-of-experts layers (torch's, and transformers' fallback op): no formula in
# torch's flop registry, so ours (``grouped_matmul_flops``)
GROUPED_MATMULS = {"_grouped_mm", "_scaled_grouped_mm", "grouped_mm_fallback"}
GROUPED_MATMUL_BACKWARDS = {"grouped_mm_fallback_backward"}
MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", FUSED_LOSS, FUSED_LOSS_BACKWARD} | GROUPED_MATMULS \
    | GROUPED_MATMUL_BACKWARDS
NORMS = {"native_layer_norm", "native_layer_norm_backward", "_fused_rms_norm", "_fused_rms_norm_backward"}
SOFTMAX_LOSS = {"_log_softmax", "_log_softmax_backward_data", "_softmax", "_softmax_backward_data",
                "nll_loss_forward", "nll_loss_backward", "logsumexp"}
EMBEDDINGS = {"embedding", "embedding_dense_backward"}
# ops that move no data (views, aliases, tuple access)
VIEW_NAMES = {"_unsafe_view", "detach", "alias", "lift_fresh"}
# reductions of a vocabulary-sharded tensor that Megatron's parallel cross-entropy all-reduces
VOCAB_REDUCTIONS = {"_log_softmax": 2, "logsumexp": 2, "nll_loss_forward": 1}
KEEPS_PARTIAL = {"add"}


class TensorParallelError(ValueError):
    """A block whose structure the tensor-parallel sharding rules do not recognise, used with t > 1."""


def op_name(node: fx.Node) -> str:
    """``aten.mm.default`` -> ``mm``; non-aten callables by their ``__name__``."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[-1]
    return getattr(target, "__name__", str(target))


def is_view(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    target = node.target
    if isinstance(target, torch._ops.OpOverload) and target.is_view:
        return True
    return op_name(node) in VIEW_NAMES


def is_pointwise(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags


def to_expr(value: Any, symbols: dict[str, sympy.Symbol] | None = None) -> sympy.Expr:
    """An int / SymInt / sympy value as a sympy expression over the canonical symbols."""
    if isinstance(value, torch.SymInt):
        expr = value.node.expr
    elif isinstance(value, (int, sympy.Basic)):
        expr = sympy.sympify(value)
    else:
        raise TypeError(f"cannot turn {value!r} into a size expression")
    if symbols:
        expr = expr.xreplace({sym: symbols[sym.name] for sym in expr.free_symbols if sym.name in symbols})
    return expr


def tensor_values(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [item for item in value if isinstance(item, torch.Tensor)]
    return []


def tensor_shape(tensor: torch.Tensor, symbols: dict[str, sympy.Symbol] | None) -> tuple[sympy.Expr, ...]:
    return tuple(to_expr(size, symbols) for size in tensor.shape)


def tensor_bytes(tensor: torch.Tensor, symbols: dict[str, sympy.Symbol] | None) -> sympy.Expr:
    return sympy.Mul(*tensor_shape(tensor, symbols)) * tensor.element_size()


def value_bytes(node: fx.Node, symbols: dict[str, sympy.Symbol] | None) -> sympy.Expr:
    return sympy.Add(*(tensor_bytes(v, symbols) for v in tensor_values(node.meta.get("val"))))


def op_class(node: fx.Node) -> str:
    name = op_name(node)
    if is_view(node):
        return "view"
    if name in MATMULS:
        return "matmul"
    if name in ATTENTION_FORWARD or name in ATTENTION_BACKWARD:
        return "attention"
    if name in NORMS:
        return "norm"
    if name in SOFTMAX_LOSS:
        return "softmax"
    if name in EMBEDDINGS:
        return "embedding"
    return "elementwise"


def _shape_args(args: Iterable[Any], symbols: dict[str, sympy.Symbol] | None) -> list[Any]:
    shaped = []
    for arg in args:
        value = arg.meta.get("val") if isinstance(arg, fx.Node) else arg
        if isinstance(value, torch.Tensor):
            shaped.append(tensor_shape(value, symbols))
        elif isinstance(value, torch.SymInt):
            shaped.append(to_expr(value, symbols))
        else:
            shaped.append(value)
    return shaped


def grouped_matmul_flops(first: tuple, out: tuple) -> sympy.Expr:
    """FLOPs of a grouped GEMM from its first operand's and its output's shapes: every output element
    is a dot product over the first operand's last dimension, except when two 2-D operands are split
    along that dimension into the output's groups (``[M, K] x [K, N] -> [E, M, N]``, the weight
    gradient of an expert layer), where each group sums over its own part of ``K``."""
    out_elements = sympy.Mul(*out)
    if len(first) == 2 and len(out) == 3:
        return 2 * out_elements / out[0] * first[-1]
    return 2 * out_elements * first[-1]


def node_flops(node: fx.Node, symbols: dict[str, sympy.Symbol] | None = None) -> sympy.Expr:
    """FLOPs of one node (0 for ops without a formula: pointwise work is counted in bytes)."""
    if node.op != "call_function":
        return sympy.Integer(0)
    name = op_name(node)
    args = _shape_args(node.args, symbols)
    if name in GROUPED_MATMULS or name in GROUPED_MATMUL_BACKWARDS:
        outputs = [tensor_shape(v, symbols) for v in tensor_values(node.meta.get("val"))]
        if not outputs or not isinstance(args[0], tuple):
            return sympy.Integer(0)
        forward = grouped_matmul_flops(args[0], outputs[0] if name in GROUPED_MATMULS else
                                       tensor_shape(node.args[-1].meta["val"], symbols))
        return sympy.sympify(forward if name in GROUPED_MATMULS else 2 * forward)
    if name in ATTENTION_FORWARD:
        return sympy.sympify(sdpa_flop_count(args[0], args[1], args[2]))
    if name in ATTENTION_BACKWARD:
        return sympy.sympify(sdpa_backward_flop_count(args[0], args[1], args[2], args[3]))
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    if packet is None or packet not in flop_registry:
        return sympy.Integer(0)
    out = node.meta.get("val")
    out_shape = tuple(tensor_shape(v, symbols) for v in tensor_values(out)) if isinstance(out, (tuple, list)) else (
        tensor_shape(out, symbols) if isinstance(out, torch.Tensor) else None)
    kwargs = {k: (tensor_shape(v.meta["val"], symbols) if isinstance(v, fx.Node) else v) for k, v in node.kwargs.items()}
    return sympy.sympify(flop_registry[packet].__wrapped__(*args, out_shape=out_shape, **kwargs))


def node_bytes(node: fx.Node, symbols: dict[str, sympy.Symbol] | None = None) -> sympy.Expr:
    """Bytes read and written by one node; metadata-only views move nothing."""
    if node.op != "call_function" or is_view(node):
        return sympy.Integer(0)
    seen: set[fx.Node] = set()
    total = value_bytes(node, symbols)
    for arg in node.all_input_nodes:
        if arg not in seen:
            seen.add(arg)
            total += value_bytes(arg, symbols)
    return total


@dataclass
class Sharding:
    """The tensor-parallel split being priced: decided by ``tp_recognition`` (the one recogniser),
    given here as the joint graph's parameter placeholders it splits."""

    sharded_params: set[str] = field(default_factory=set)  # placeholder names seeded S
    supported: bool = True
    message: str = ""


# ---------------------------------------------------------------------------------------------
# per-node costs and state propagation


@dataclass(frozen=True)
class NodeCost:
    name: str
    op: str
    op_class: str
    flops: sympy.Expr  # with tensor-parallel sharding applied (divided by t where sharded)
    bytes: sympy.Expr
    tp: str  # "R" | "S" | "P"


@dataclass(frozen=True)
class Collective:
    """A collective implied by the sharding, inserted after node ``after``."""

    kind: str  # "all_reduce"
    bytes: sympy.Expr  # payload per rank
    after: str
    reason: str


@dataclass
class GraphCosts:
    nodes: list[NodeCost]
    collectives: list[Collective]
    states: dict[str, str]  # node name -> tensor-parallel state of its value

    def flops_by_class(self) -> dict[str, sympy.Expr]:
        totals: dict[str, sympy.Expr] = {}
        for cost in self.nodes:
            totals[cost.op_class] = totals.get(cost.op_class, sympy.Integer(0)) + cost.flops
        return totals

    def bytes_by_class(self) -> dict[str, sympy.Expr]:
        totals: dict[str, sympy.Expr] = {}
        for cost in self.nodes:
            totals[cost.op_class] = totals.get(cost.op_class, sympy.Integer(0)) + cost.bytes
        return totals

    @property
    def total_flops(self) -> sympy.Expr:
        return sympy.Add(*(cost.flops for cost in self.nodes))

    def restrict(self, names: set[str]) -> "GraphCosts":
        """The nodes named in ``names`` and the collectives after them."""
        return GraphCosts([c for c in self.nodes if c.name in names],
                          [c for c in self.collectives if c.after in names], self.states)

    def collective_bytes(self, kind: str = "all_reduce") -> sympy.Expr:
        return sympy.Add(*(c.bytes for c in self.collectives if c.kind == kind))


def _scaled_bytes(node: fx.Node, states: dict[str, str], symbols) -> sympy.Expr:
    if node.op != "call_function" or is_view(node):
        return sympy.Integer(0)
    on_chunks = states.get(node.name) in ("Q", "P")  # a sequence chunk's op reads chunks; others the gathered value
    def part(value_node: fx.Node) -> sympy.Expr:
        size = value_bytes(value_node, symbols)
        state = states.get(value_node.name)
        return size / T if state == "S" or (state == "Q" and (on_chunks or value_node is node)) else size
    total = part(node)
    for arg in set(node.all_input_nodes):
        total += part(arg)
    return total


def propagate_costs(graph: fx.Graph, initial: dict[str, str], symbols: dict[str, sympy.Symbol] | None,
                    phase: str, sequence: Any = None) -> GraphCosts:
    """Walk a graph in order, assigning tensor-parallel states, costs and collectives. ``sequence``
    (``sp_pricing.SequencePricing``): price sequence parallelism (state ``Q``: split along the sequence)."""
    states: dict[str, str] = {}
    costs: list[NodeCost] = []
    collectives: list[Collective] = []

    def reduce_partial(producer: fx.Node, reason: str, consumer: fx.Node | None = None) -> None:
        kind, state = ("all_reduce", "R") if sequence is None else sequence.reduction(producer, consumer, symbols)
        collectives.append(Collective(kind, value_bytes(producer, symbols), producer.name, reason))
        if state == "R":
            # the all-reduce runs in place: the storage and every view of it hold the full value from here on
            base = producer
            while is_view(base) and base.all_input_nodes:
                base = base.all_input_nodes[0]
            pending = [base]
            while pending:
                node = pending.pop()
                if states.get(node.name) == "P":
                    states[node.name] = "R"
                pending.extend(user for user in node.users if is_view(user) and user.name in states)
        states[producer.name] = state

    for node in graph.nodes:
        if node.op == "placeholder":
            states[node.name] = initial.get(node.name, "R")
            continue
        if node.op == "output":
            for arg in node.all_input_nodes:
                if states.get(arg.name) == "P":
                    reduce_partial(arg, f"{phase} output {arg.name} is a partial sum")
            continue
        if node.op != "call_function":
            states[node.name] = "R"
            continue
        name = op_name(node)
        inputs = [arg for arg in node.all_input_nodes if isinstance(arg.meta.get("val"), torch.Tensor)
                  or isinstance(arg.meta.get("val"), (tuple, list))]
        in_states = [states.get(arg.name, "R") for arg in inputs]
        keeps_partial = is_view(node) or (name in KEEPS_PARTIAL and in_states and all(s == "P" for s in in_states))
        if not keeps_partial:
            for arg, state in zip(inputs, in_states):
                if state == "P":
                    reduce_partial(arg, f"{phase}: {node.name} ({name}) needs the full value of {arg.name}", node)
            in_states = [states.get(arg.name, "R") for arg in inputs]
        if keeps_partial and "P" in in_states:
            state = "P"
        elif name in ("mm", "addmm"):
            matrices = [states.get(arg.name, "R") for arg in node.args[-2:] if isinstance(arg, fx.Node)]
            state = "P" if matrices.count("S") == 2 else ("S" if "S" in matrices else "R")
        elif name == "embedding" and in_states and in_states[0] == "S":
            state = "P"  # vocab-parallel lookup: rows outside this rank's range are zero
        elif name == FUSED_LOSS and "S" in in_states:
            rows = tensor_shape(inputs[0].meta["val"], symbols)[0]
            for what, payload in (("max of the log-sum-exps", 4), ("sums of exponentials and target logits", 8)):
                collectives.append(Collective("all_reduce", rows * payload, node.name,
                                              f"{phase}: vocab-parallel fused loss ({what})"))
            state = "R"
        elif node.target is operator.getitem and op_name(node.args[0]) == FUSED_LOSS_BACKWARD \
                and "S" in in_states:
            state = "P" if node.args[1] == 0 else "S"  # this shard's part of grad_hidden; the weight shard's gradient
        elif name in VOCAB_REDUCTIONS and in_states and in_states[0] == "S":
            rows = sympy.Mul(*tensor_shape(inputs[0].meta["val"], symbols)[:-1]) if inputs[0].meta["val"].dim() > 1 else sympy.Integer(1)
            collectives.append(Collective("all_reduce", rows * 4 * VOCAB_REDUCTIONS[name], node.name,
                                          f"{phase}: parallel cross-entropy reduction in {name}"))
            state = "R" if name == "nll_loss_forward" else "S"
        elif "S" in in_states:
            state = "S"
        else:
            state = "R"
        if sequence is not None:
            state = sequence.state(node, state, inputs, in_states, collectives, symbols, phase)
        states[node.name] = state
        flops = node_flops(node, symbols)
        if state in ("S", "P", "Q") or "S" in in_states:
            flops = flops / T
        costs.append(NodeCost(node.name, name, op_class(node), sympy.expand(flops),
                              sympy.expand(_scaled_bytes(node, states | {node.name: state}, symbols)), state))
    return GraphCosts(costs, collectives, states)


NEEDS_FULL_FEATURES = {"native_layer_norm", "mean", "_fused_rms_norm", "var_mean", "softmax", "_softmax"}


@dataclass
class ProgramCosts:
    """Costs of a captured forward/backward graph pair, and the sharding found."""

    forward: GraphCosts
    backward: GraphCosts
    sharding: Sharding
    param_states: dict[str, str]

    def restrict(self, names: set[str]) -> "ProgramCosts":
        """The costs of the nodes named in ``names`` (one block)."""
        return ProgramCosts(self.forward.restrict(names), self.backward.restrict(names), self.sharding, self.param_states)


BlockCosts = ProgramCosts  # a block's costs are a restricted ProgramCosts


def _check_sharded_consumers(graph: fx.Graph, states: dict[str, str]) -> str:
    """A message if a sharded value reaches an op that needs all features (unrecognised structure)."""
    for node in graph.nodes:
        if node.op == "call_function" and op_name(node) in NEEDS_FULL_FEATURES:
            for arg in node.all_input_nodes:
                if states.get(arg.name) == "S":
                    return f"{node.name} ({op_name(node)}) would read the sharded value {arg.name}"
    return ""


def annotate_graphs(forward: fx.GraphModule, backward: fx.GraphModule, params: set[str],
                    symbols: dict[str, sympy.Symbol] | None = None,
                    backward_inputs: dict[str, str] | None = None, sharding: Sharding | None = None,
                    sequence: Any = None) -> ProgramCosts:
    """Annotate a captured forward/backward graph pair (a whole model or one block).

    ``params``: names of the forward graph's parameter placeholders. ``sharding``: which of them
    the tensor-parallel plan splits (default: none, tensor parallelism unsupported).
    ``sequence`` prices sequence parallelism (``sp_pricing``).
    ``backward_inputs`` maps backward placeholder names to the forward node they receive (default:
    same name, which is what AOTAutograd's partitioners produce); tangents are replicated.
    """
    if sharding is None:
        sharding = Sharding(set(), False, "no tensor-parallel plan was given")
    sharding = Sharding(set(sharding.sharded_params), sharding.supported, sharding.message)
    seeds = {name: "S" for name in sharding.sharded_params} if sharding.supported else {}
    forward_costs = propagate_costs(forward.graph, seeds, symbols, "forward", sequence)
    if sharding.supported:
        problem = _check_sharded_consumers(forward.graph, forward_costs.states)
        if problem:
            sharding.supported = False
            sharding.message = f"the priced program disagrees with the tensor-parallel plan: {problem}"
    if not sharding.supported:
        forward_costs = propagate_costs(forward.graph, {}, symbols, "forward")
    mapping = backward_inputs or {}
    initial = {}
    for node in backward.graph.nodes:
        if node.op == "placeholder":
            source = mapping.get(node.name, node.name)
            initial[node.name] = "R" if node.name.startswith("tangents") else forward_costs.states.get(source, "R")
    backward_costs = propagate_costs(backward.graph, initial, symbols, "backward", sequence)
    param_states = {name: ("S" if name in sharding.sharded_params and sharding.supported else "R") for name in params}
    return ProgramCosts(forward_costs, backward_costs, sharding, param_states)



# ---------------------------------------------------------------------------------------------
# the pass over a captured MistProgram


@dataclass
class ProgramGraphs:
    """A captured program's live forward/backward graphs and what their placeholders are."""

    forward: fx.GraphModule
    backward: fx.GraphModule
    params: set[str]  # forward placeholders that are trainable parameters
    symbols: dict[str, sympy.Symbol]  # graph size symbols (s72 ...) -> canonical b, s
    blocks: dict[int, set[str]]  # block class id -> names of its graph nodes
    sharding: Sharding = field(default_factory=Sharding)  # the tensor-parallel plan, on these graphs


def parameter_placeholders(forward: fx.GraphModule, backward: fx.GraphModule) -> set[str]:
    """Forward placeholders that receive a gradient (the backward's outputs follow the primals)."""
    placeholders = [n for n in forward.graph.nodes if n.op == "placeholder"]
    output = next(n for n in backward.graph.nodes if n.op == "output")
    grads = output.args[0] if isinstance(output.args[0], (tuple, list)) else output.args
    return {placeholders[i].name for i, grad in enumerate(grads)
            if isinstance(grad, fx.Node) and i < len(placeholders)
            and isinstance(placeholders[i].meta.get("val"), torch.Tensor)
            and placeholders[i].meta["val"].dtype.is_floating_point
            and all(isinstance(d, int) for d in placeholders[i].meta["val"].shape)}


def _symbol_names(program, forward: fx.GraphModule) -> dict[str, sympy.Symbol]:
    """Graph size symbols -> canonical ``b``/``s``, matched against the IR's symbolic shapes."""
    values = {n.name: n.meta.get("val") for n in forward.graph.nodes}
    mapping: dict[str, sympy.Symbol] = {}
    for block_class in program.block_classes.values():
        for ir_node in block_class.forward_nodes:
            value = values.get(ir_node.name)
            if not isinstance(value, torch.Tensor) or not ir_node.outputs:
                continue
            for size, ir_size in zip(value.shape, ir_node.outputs[0].shape):
                ir_size = sympy.sympify(ir_size)
                if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol) \
                        and isinstance(ir_size, sympy.Symbol) and ir_size.name in CANONICAL_SYMBOLS:
                    mapping[size.node.expr.name] = CANONICAL_SYMBOLS[ir_size.name]
    return {**CANONICAL_SYMBOLS, **mapping}


def _block_node_sets(program, backward: fx.GraphModule) -> dict[int, set[str]]:
    """Node names per block class, with backward nodes no module issued (gradient-accumulation
    adds) moved to the block of their users: the capture cannot place them by module."""
    classes = program.block_classes
    blocks = {cid: set(c.graphs["nodes"]) for cid, c in classes.items()}
    unsourced = {node.name for c in classes.values() for node in c.backward_nodes if not node.source}
    block_of = {name: cid for cid, names in blocks.items() for name in names}
    nodes = list(backward.graph.nodes)
    order = {node: index for index, node in enumerate(nodes)}
    for node in reversed(nodes):
        if node.name not in unsourced:
            continue
        targets = {block_of.get(user.name) for user in node.users} - {None}
        if not targets and node.all_input_nodes:  # a shared weight's gradient, complete when its last use's is
            targets = {block_of.get(max(node.all_input_nodes, key=order.__getitem__).name)} - {None}
        if len(targets) == 1:
            target = targets.pop()
            blocks[block_of[node.name]].discard(node.name)
            blocks[target].add(node.name)
            block_of[node.name] = target
    return blocks


@dataclass
class PricedGraphs:
    """What the analysis passes attach to a program (``MistProgram.analysis``): its live graphs,
    their costs (``cost_annotation``) and each block class's memory (``memory_analysis``)."""

    graphs: ProgramGraphs
    costs: ProgramCosts
    memory: dict[int, Any] = field(default_factory=dict)  # block class id -> memory_analysis.BlockMemory
    transient: frozenset = frozenset()  # values no kernel stores (intermediates of fused kernels, cost.compiled)
    # each block's backward is one autograd node (a compiled unit, cost.compiled): the parameter
    # gradients it returns are handed over when the whole block's backward is done, not op by op
    block_nodes: bool = False
    weight_split: dict[int, Any] = field(default_factory=dict)  # block class id -> weight_gradients.WeightSplit
    sequence: Any = None  # the same priced with sequence parallelism (``sp_pricing.SequencePriced``), if it applies
    tensors: Any = None  # the layer's saved-tensor tables (``saved_tensors``: {"tp": ..., "sp": ...})
    # costs re-annotated later (sequence parallelism) priced as what runs: ProgramCosts -> (ProgramCosts,
    # transient); ``cost.compiled`` sets it to its fusion of elementwise regions, None prices them op by op
    refine: Any = None


def program_graphs(program, partition=None) -> ProgramGraphs:
    """The live graphs of a freshly captured program (a program read back from JSON has none).

    ``partition``: a function from the captured joint forward+backward graph to a (forward, backward)
    pair to use instead of the captured ones (which save what eager autograd saves), e.g. the
    partition a compiler makes (``cost.compiled``)."""
    graphs = next(iter(program.block_classes.values())).graphs or {}
    forward, backward = graphs.get("forward"), graphs.get("backward")
    if forward is None or backward is None or any("nodes" not in (c.graphs or {}) for c in program.block_classes.values()):
        raise ValueError("the program carries no live forward/backward graphs; analyse a freshly captured "
                         "program, not one loaded from JSON")
    if partition is not None:
        if graphs.get("joint") is None:
            raise ValueError("the program carries no joint graph to partition")
        forward, backward = partition(graphs["joint"])
    return ProgramGraphs(forward, backward, parameter_placeholders(forward, backward), _symbol_names(program, forward),
                         _block_node_sets(program, backward), program_sharding(program))


def program_sharding(program) -> Sharding:
    """The captured program's tensor-parallel plan as seeds for pricing (what the lowering applies)."""
    graph = getattr(program, "model_graph", None)
    if graph is None or graph.tp is None:
        return Sharding(set(), False, "the model has no list of layers to split")
    return Sharding(graph.sharded_primals(), graph.tp.supported, graph.tp.reason)


def _annotated_nodes(ir_nodes, costs: dict[str, NodeCost], collectives: dict[str, list[Collective]], ir_node_type,
                     phase: str) -> list:
    annotated = []
    for node in ir_nodes:
        cost = costs.get(node.name)
        attrs = dict(node.attrs)
        if cost is not None and cost.op_class != "view":
            attrs.update(op_class=cost.op_class, flops=cost.flops, bytes=cost.bytes, tp=cost.tp)
        annotated.append(ir_node_type(node.name, node.op, list(node.inputs), list(node.outputs), node.phase, attrs,
                                      node.source))
        for index, collective in enumerate(collectives.get(node.name, [])):
            annotated.append(ir_node_type(f"{node.name}_{collective.kind}{index or ''}", collective.kind, [node.name],
                                          [], phase, {"group": "tp", "bytes": collective.bytes, "reason": collective.reason},
                                          node.source))
    return annotated


@transforms(MistProgram)
def cost_annotation(program: MistProgram) -> PassResult:
    """Pass: every IR node gets ``op_class``, ``flops``, ``bytes`` and ``tp`` attributes
    (expressions in b, s, t); the collectives the tensor-parallel sharding implies become IR
    nodes (``all_reduce`` with its ``bytes``) right after the node they reduce; the costs are
    kept as ``program.analysis`` for the passes after it and the stage cost model. Pure: returns
    a new program; the input is not modified."""
    import copy

    graphs = program_graphs(program)
    costs = annotate_graphs(graphs.forward, graphs.backward, graphs.params, graphs.symbols, sharding=graphs.sharding)
    annotated = copy.copy(program)
    annotated.analysis = PricedGraphs(graphs, costs)
    annotated.block_classes = {}
    from ..ir.program import IRNode

    node_costs = {phase: {c.name: c for c in graph_costs.nodes}
                  for phase, graph_costs in (("forward", costs.forward), ("backward", costs.backward))}
    by_after: dict[str, dict[str, list[Collective]]] = {"forward": {}, "backward": {}}
    for phase, graph_costs in (("forward", costs.forward), ("backward", costs.backward)):
        for collective in graph_costs.collectives:  # placed after the IR node they reduce, wherever it lives
            by_after[phase].setdefault(collective.after, []).append(collective)
    for class_id, block_class in program.block_classes.items():
        new_class = copy.copy(block_class)
        new_class.forward_nodes = _annotated_nodes(block_class.forward_nodes, node_costs["forward"], by_after["forward"],
                                                   IRNode, "forward")
        new_class.backward_nodes = _annotated_nodes(block_class.backward_nodes, node_costs["backward"],
                                                    by_after["backward"], IRNode, "backward")
        annotated.block_classes[class_id] = new_class
    annotated.tensor_parallel = {"supported": costs.sharding.supported, "message": costs.sharding.message,
                                 "sharded": sorted(costs.sharding.sharded_params)}
    return PassResult(annotated, True)
