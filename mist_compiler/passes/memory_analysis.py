"""Memory analysis pass: activation and transient memory of a block class, by liveness.

Works on a block's captured forward and backward graphs (nodes carry FakeTensor ``meta["val"]``
with sizes in the symbols ``b``, ``s``) and the tensor-parallel states from the cost
annotation (a value sharded by ``t`` occupies ``1/t`` of its bytes). Memory is counted per
*storage*: a view (``view``, ``transpose``, ``t``, ``detach``, tuple ``getitem`` ...) shares its
base's storage, a storage lives from the node that creates it to the last use of any view of it.

Results, all sympy expressions in ``b``, ``s``, ``t``:
- ``saved``: activations the forward keeps for the backward per micro-batch (parameters
  excluded), for the attention kernel asked for: ``flash`` keeps q, k, v, out and the
  log-sum-exp (what the captured flash op saves); ``math`` also keeps the ``b*h*s*s``
  probabilities (and no log-sum-exp) and needs the scores/probabilities as workspace;
- ``forward_peaks``: candidates for the peak of (saved so far + live non-saved values) over the
  forward's program points;
- ``backward_peaks``: candidates for the peak of everything alive during the backward (the
  saved tensors not yet released, the incoming gradient, gradient intermediates, each parameter
  gradient at the moment it is produced before it is accumulated into ``.grad``);
- ``input`` / ``output``: bytes of the block's activation input and output.
The maximum of polynomials with positive coefficients is not a polynomial, so peaks stay as a
list of candidates with coefficient-wise dominated ones removed; the cost model evaluates their
maximum vectorised. Parameter bytes are counted by the stage model from the parameter list.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx

from .cost_annotation import ATTENTION_FORWARD, B, S, T, BlockCosts, is_view, op_name, tensor_bytes, tensor_shape, value_bytes

ATTENTION_KERNELS = ("flash", "math")


def _base(node: fx.Node) -> fx.Node:
    while is_view(node) and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def _scaled(size: sympy.Expr, state: str | None) -> sympy.Expr:
    return size / T if state == "S" else size


def dominates(a: sympy.Expr, b: sympy.Expr) -> bool:
    """``a >= b`` for all positive b, s, t, decided on the polynomial coefficients of ``a - b``."""
    difference = sympy.expand(a - b)
    if difference == 0:
        return True
    numerator, denominator = sympy.fraction(sympy.together(difference))
    if sympy.Poly(denominator, B, S, T).coeffs() and any(c < 0 for c in sympy.Poly(denominator, B, S, T).coeffs()):
        return False
    return all(c >= 0 for c in sympy.Poly(sympy.expand(numerator), B, S, T).coeffs())


def prune_candidates(candidates: list[sympy.Expr]) -> list[sympy.Expr]:
    """Drop candidates that another candidate dominates coefficient-wise."""
    unique = list(dict.fromkeys(sympy.expand(c) for c in candidates))
    kept: list[sympy.Expr] = []
    for index, candidate in enumerate(unique):
        beaten = any(
            other is not candidate and dominates(other, candidate) and not (dominates(candidate, other) and j > index)
            for j, other in enumerate(unique) if j != index
        )
        if not beaten:
            kept.append(candidate)
    return kept


@dataclass
class BlockMemory:
    saved: dict[str, sympy.Expr]  # attention kernel -> saved activation bytes per micro-batch
    forward_peaks: dict[str, list[sympy.Expr]]  # kernel -> candidates (saved so far + live transient)
    backward_peaks: dict[str, list[sympy.Expr]]  # kernel -> candidates (all live in backward)
    input: sympy.Expr
    output: sympy.Expr
    saved_names: list[str] = field(default_factory=list)


def _last_uses(graph: fx.Graph) -> dict[fx.Node, int]:
    """Index of the last node that uses each storage base."""
    order = {node: index for index, node in enumerate(graph.nodes)}
    last: dict[fx.Node, int] = {}
    for node in graph.nodes:
        for arg in node.all_input_nodes:
            base = _base(arg)
            last[base] = max(last.get(base, -1), order[node])
    return last


def _attention_extras(forward: fx.Graph, states: dict[str, str], symbols) -> tuple[sympy.Expr, sympy.Expr]:
    """(probabilities bytes, log-sum-exp bytes) summed over attention ops, for the math kernel."""
    probs, lse = sympy.Integer(0), sympy.Integer(0)
    for node in forward.nodes:
        if op_name(node) not in ATTENTION_FORWARD:
            continue
        query = node.args[0].meta["val"]
        batch, heads, seq, _ = tensor_shape(query, symbols)
        key_seq = tensor_shape(node.args[1].meta["val"], symbols)[2]
        state = states.get(node.name)
        probs += _scaled(batch * heads * seq * key_seq * query.element_size(), state)
        values = node.meta.get("val")
        if isinstance(values, (tuple, list)) and len(values) > 1 and isinstance(values[1], torch.Tensor):
            lse += _scaled(tensor_bytes(values[1], symbols), state)
    return probs, lse


def analyse_block_memory(forward: fx.GraphModule, backward: fx.GraphModule, costs: BlockCosts,
                         params: set[str], symbols=None, backward_inputs: dict[str, str] | None = None) -> BlockMemory:
    """Liveness over one block class's forward and backward graphs (see the module docstring)."""
    fw_states = costs.forward.states
    bw_states = costs.backward.states
    fw_nodes = {node.name: node for node in forward.graph.nodes}
    mapping = backward_inputs or {}
    fw_placeholders = [n for n in forward.graph.nodes if n.op == "placeholder"]

    # saved tensors: the backward's inputs that come from forward values other than parameters
    saved_bases: dict[fx.Node, sympy.Expr] = {}
    bw_saved_placeholders: dict[str, fx.Node] = {}
    for node in backward.graph.nodes:
        if node.op != "placeholder" or node.name.startswith("tangents"):
            continue
        source = fw_nodes.get(mapping.get(node.name, node.name))
        if source is None or not isinstance(source.meta.get("val"), torch.Tensor):
            continue
        base = _base(source)
        if base.op == "placeholder" and base.name in params:
            continue
        saved_bases[base] = _scaled(value_bytes(base, symbols), fw_states.get(base.name))
        bw_saved_placeholders[node.name] = base
    saved_total = sympy.Add(*saved_bases.values())
    activation_inputs = [n for n in fw_placeholders if n.name not in params and isinstance(n.meta.get("val"), torch.Tensor)]
    input_bytes = sympy.Add(*(_scaled(value_bytes(n, symbols), fw_states.get(n.name)) for n in activation_inputs))
    fw_output = next(n for n in forward.graph.nodes if n.op == "output")
    outputs = fw_output.args[0]
    block_output = outputs[0] if isinstance(outputs, (tuple, list)) else outputs
    output_bytes = _scaled(value_bytes(block_output, symbols), fw_states.get(block_output.name))

    # forward liveness: saved-so-far + live non-saved storages at each program point
    last = _last_uses(forward.graph)
    order = {node: index for index, node in enumerate(forward.graph.nodes)}
    live: dict[fx.Node, sympy.Expr] = {}
    saved_so_far = sympy.Integer(0)
    forward_points: list[sympy.Expr] = []
    for node in forward.graph.nodes:
        if node.op != "call_function" or is_view(node):
            continue
        size = _scaled(value_bytes(node, symbols), fw_states.get(node.name))
        if node in saved_bases:
            saved_so_far += saved_bases[node]
        elif size != 0:
            live[node] = size
        forward_points.append(saved_so_far + sympy.Add(*live.values()))
        index = order[node]
        for base in [b for b in live if last.get(b, -1) <= index]:
            del live[base]

    # backward liveness: saved tensors released at their last use, gradients created and freed
    grad_outputs: set[fx.Node] = set()
    bw_output = next(n for n in backward.graph.nodes if n.op == "output")
    for position, grad in enumerate(bw_output.args[0]):
        if isinstance(grad, fx.Node) and position < len(fw_placeholders) and fw_placeholders[position].name in params:
            grad_outputs.add(_base(grad))
    bw_last = _last_uses(backward.graph)
    bw_order = {node: index for index, node in enumerate(backward.graph.nodes)}
    bw_live: dict[fx.Node, sympy.Expr] = {}
    seen_saved: set[fx.Node] = set()
    for node in backward.graph.nodes:
        if node.op != "placeholder":
            continue
        if node.name.startswith("tangents"):
            bw_live[node] = value_bytes(node, symbols)
        elif node.name in bw_saved_placeholders:
            base = bw_saved_placeholders[node.name]
            if base not in seen_saved:  # several placeholders can be views of one forward storage
                seen_saved.add(base)
                bw_live[node] = saved_bases[base]
    # a forward storage seen through several backward placeholders dies at the last use of any
    groups: dict[fx.Node, list[fx.Node]] = {}
    for name, base in bw_saved_placeholders.items():
        groups.setdefault(base, []).append(next(n for n in backward.graph.nodes if n.name == name))
    owner_last: dict[fx.Node, int] = {}
    for base, members in groups.items():
        holder = next(m for m in members if m in bw_live)
        owner_last[holder] = max(bw_last.get(m, -1) for m in members)
    backward_points: list[sympy.Expr] = [sympy.Add(*bw_live.values())]
    for node in backward.graph.nodes:
        if node.op != "call_function" or is_view(node):
            continue
        size = _scaled(value_bytes(node, symbols), bw_states.get(node.name))
        if size != 0:
            bw_live[node] = size
        backward_points.append(sympy.Add(*bw_live.values()))
        index = bw_order[node]
        for base in list(bw_live):
            end = owner_last.get(base, bw_last.get(base, -1))
            if base in grad_outputs or (end <= index and base.op != "output" and end < bw_order[bw_output]):
                del bw_live[base]

    probs, lse = _attention_extras(forward.graph, fw_states, symbols)
    saved = {"flash": saved_total, "math": saved_total + probs - lse}
    forward_peaks = {
        "flash": prune_candidates(forward_points),
        "math": prune_candidates([p + probs - lse for p in forward_points] + [saved_total + 2 * probs]),
    }
    backward_peaks = {
        "flash": prune_candidates(backward_points),
        "math": prune_candidates([p + probs - lse for p in backward_points] + [saved_total + 3 * probs]),
    }
    return BlockMemory(saved, forward_peaks, backward_peaks, input_bytes, output_bytes,
                       [base.name for base in saved_bases])
