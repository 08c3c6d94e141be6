"""Memory analysis pass: activation and transient memory per block class, by liveness.

Works on the captured forward and backward graphs (nodes carry FakeTensor ``meta["val"]`` with
symbolic sizes) and the tensor-parallel states from the cost annotation (a value sharded by
``t`` occupies ``1/t`` of its bytes). The graphs may hold several blocks; ``blocks`` maps a
block label to the names of its nodes and every result is per block. Memory is counted per
*storage*: a view (``view``, ``transpose``, ``t``, ``detach``, tuple ``getitem`` ...) shares
its base's storage, which lives from the node that creates it to the last use of any view of it.

Results per block, sympy expressions in ``b``, ``s``, ``t``:
- ``saved``: activations the forward keeps for the backward per micro-batch, charged to each
  block whose backward reads them (so a layer keeps its input, as Megatron counts), parameters
  excluded, for the attention kernel asked for: ``flash`` keeps q, k, v, out and the
  log-sum-exp (what the captured flash op saves); ``math`` also keeps the ``b*h*s*s``
  probabilities (no log-sum-exp) and needs scores/probabilities as workspace;
- ``forward_peaks``: candidates for the peak, over the block's forward program points, of its
  saved storages created so far (its input from the start) + live non-saved storages it created;
- ``backward_peaks``: candidates for the peak, over the block's backward program points, of its
  saved storages not yet released + every live gradient-side storage (the incoming gradient,
  intermediates, each parameter gradient at the moment it is produced, before it is
  accumulated into ``.grad``);
- ``input`` / ``output``: bytes of the block's activation input (saved storages it did not
  create) and of the hidden state it hands on.
The maximum of polynomials with positive coefficients is no polynomial, so peaks stay as lists
of candidates with coefficient-wise dominated ones removed; the cost model takes their maximum
vectorised.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx

from .cost_annotation import ATTENTION_FORWARD, B, S, T, ProgramCosts, is_view, op_name, tensor_bytes, tensor_shape, value_bytes

ATTENTION_KERNELS = ("flash", "math")


def _base(node: fx.Node) -> fx.Node:
    while is_view(node) and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def _scaled(size: sympy.Expr, state: str | None) -> sympy.Expr:
    return size / T if state == "S" else size


def _coefficients_nonnegative(expr: sympy.Expr) -> bool:
    numerator, denominator = sympy.fraction(sympy.together(sympy.expand(expr)))
    if not all(c > 0 for c in sympy.Poly(denominator, B, S, T).coeffs()):
        return False
    return all(c >= 0 for c in sympy.Poly(sympy.expand(numerator), B, S, T).coeffs())


def dominates(a: sympy.Expr, b: sympy.Expr) -> bool:
    """``a >= b`` for all positive b, s, t, decided on the coefficients of ``a - b``."""
    return _coefficients_nonnegative(a - b)


def prune_candidates(candidates: list[sympy.Expr]) -> list[sympy.Expr]:
    """Drop candidates another candidate dominates coefficient-wise (keeps one of equals)."""
    unique = list(dict.fromkeys(sympy.expand(c) for c in candidates))
    kept: list[sympy.Expr] = []
    for candidate in unique:
        if any(dominates(other, candidate) for other in kept):
            continue
        kept = [other for other in kept if not dominates(candidate, other)] + [candidate]
    return kept or [sympy.Integer(0)]


@dataclass
class BlockMemory:
    saved: dict[str, sympy.Expr]  # attention kernel -> saved activation bytes per micro-batch
    forward_peaks: dict[str, list[sympy.Expr]]
    backward_peaks: dict[str, list[sympy.Expr]]
    input: sympy.Expr
    output: sympy.Expr
    saved_names: list[str] = field(default_factory=list)
    attention_probs: sympy.Expr = sympy.Integer(0)  # bytes of the b*h*s*s probabilities (math kernel)


def _last_uses(graph: fx.Graph) -> dict[fx.Node, int]:
    """Index of the last node that uses each storage base."""
    order = {node: index for index, node in enumerate(graph.nodes)}
    last: dict[fx.Node, int] = {}
    for node in graph.nodes:
        for arg in node.all_input_nodes:
            base = _base(arg)
            last[base] = max(last.get(base, -1), order[node])
    return last


def _attention_extras(forward: fx.Graph, names: set[str], states: dict[str, str], symbols) -> tuple[sympy.Expr, sympy.Expr]:
    """(probabilities bytes, log-sum-exp bytes) of a block's attention ops, for the math kernel."""
    probs, lse = sympy.Integer(0), sympy.Integer(0)
    for node in forward.nodes:
        if node.name not in names or op_name(node) not in ATTENTION_FORWARD:
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


@dataclass
class _Saved:
    """Saved storages: forward base -> bytes, and which blocks' backward reads each."""

    size: dict[fx.Node, sympy.Expr]
    readers: dict[fx.Node, set[str]]
    holders: dict[fx.Node, list[fx.Node]]  # forward base -> backward placeholders viewing it


def _saved_storages(forward: fx.GraphModule, backward: fx.GraphModule, params: set[str], states: dict[str, str],
                    block_of: dict[str, str], symbols, mapping: dict[str, str]) -> _Saved:
    fw_nodes = {node.name: node for node in forward.graph.nodes}
    saved = _Saved({}, {}, {})
    for node in backward.graph.nodes:
        if node.op != "placeholder" or node.name.startswith("tangents"):
            continue
        source = fw_nodes.get(mapping.get(node.name, node.name))
        if source is None or not isinstance(source.meta.get("val"), torch.Tensor):
            continue
        base = _base(source)
        if base.op == "placeholder" and base.name in params:
            continue
        saved.size[base] = _scaled(value_bytes(base, symbols), states.get(base.name))
        readers = {block_of[user.name] for user in node.users if user.name in block_of}
        saved.readers.setdefault(base, set()).update(readers or {block_of.get(base.name, "")})
        saved.holders.setdefault(base, []).append(node)
    return saved


def analyse_memory(forward: fx.GraphModule, backward: fx.GraphModule, costs: ProgramCosts, params: set[str],
                   blocks: dict[str, set[str]], symbols=None,
                   backward_inputs: dict[str, str] | None = None) -> dict[str, BlockMemory]:
    """Liveness over the forward and backward graphs, results per block (module docstring)."""
    fw_states, bw_states = costs.forward.states, costs.backward.states
    block_of = {name: label for label, names in blocks.items() for name in names}
    saved = _saved_storages(forward, backward, params, fw_states, block_of, symbols, backward_inputs or {})
    fw_placeholders = [n for n in forward.graph.nodes if n.op == "placeholder"]

    saved_of: dict[str, list[fx.Node]] = {label: [] for label in blocks}
    for base, readers in saved.readers.items():
        for label in readers:
            if label in saved_of:
                saved_of[label].append(base)

    # ---- forward ----
    last = _last_uses(forward.graph)
    order = {node: index for index, node in enumerate(forward.graph.nodes)}
    live: dict[fx.Node, sympy.Expr] = {}
    live_total = {label: sympy.Integer(0) for label in blocks}
    saved_so_far = {label: sympy.Add(*(saved.size[b] for b in saved_of[label] if block_of.get(b.name) != label))
                    for label in blocks}
    forward_points: dict[str, list[sympy.Expr]] = {label: [] for label in blocks}
    output_bytes = {label: sympy.Integer(0) for label in blocks}
    for node in forward.graph.nodes:
        if node.op != "call_function" or is_view(node):
            continue
        label = block_of.get(node.name)
        size = _scaled(value_bytes(node, symbols), fw_states.get(node.name))
        if label is not None:
            if node in saved.size and label in saved.readers[node]:
                saved_so_far[label] += saved.size[node]
            elif size != 0:
                live[node] = size
                live_total[label] += size
            forward_points[label].append(saved_so_far[label] + live_total[label])
            if any(block_of.get(user.name) not in (label, None) and not is_view(user) for user in node.users) \
                    or any(block_of.get(u.name) not in (label, None) for v in node.users if is_view(v) for u in v.users):
                output_bytes[label] = size  # the value handed to the next block
        index = order[node]
        for dead in [b for b in live if last.get(b, -1) <= index]:
            live_total[block_of[dead.name]] -= live.pop(dead)

    # ---- backward ----
    grad_outputs: set[fx.Node] = set()
    bw_output = next(n for n in backward.graph.nodes if n.op == "output")
    for position, grad in enumerate(bw_output.args[0]):
        if isinstance(grad, fx.Node) and position < len(fw_placeholders) and fw_placeholders[position].name in params:
            grad_outputs.add(_base(grad))
    bw_last = _last_uses(backward.graph)
    release: dict[fx.Node, int] = {}  # forward saved base -> index of its last backward use
    for base, holders in saved.holders.items():
        release[base] = max(bw_last.get(h, -1) for h in holders)
    alive_saved = {label: sympy.Add(*(saved.size[b] for b in saved_of[label])) for label in blocks}
    released: set[fx.Node] = set()
    grad_live: dict[fx.Node, sympy.Expr] = {}
    grad_total = sympy.Integer(0)
    for node in backward.graph.nodes:
        if node.op == "placeholder" and node.name.startswith("tangents"):
            grad_live[node] = value_bytes(node, symbols)
            grad_total += grad_live[node]
    backward_points: dict[str, list[sympy.Expr]] = {label: [] for label in blocks}
    for index, node in enumerate(backward.graph.nodes):
        if node.op != "call_function" or is_view(node):
            continue
        label = block_of.get(node.name)
        size = _scaled(value_bytes(node, symbols), bw_states.get(node.name))
        if size != 0:
            grad_live[node] = size
            grad_total += size
        if label is not None:
            backward_points[label].append(alive_saved[label] + grad_total)
        for base, end in release.items():
            if end <= index and base not in released:
                released.add(base)
                for reader in saved.readers[base]:
                    if reader in alive_saved:
                        alive_saved[reader] -= saved.size[base]
        for dead in [g for g in grad_live if g in grad_outputs or bw_last.get(g, -1) <= index]:
            grad_total -= grad_live.pop(dead)

    results: dict[str, BlockMemory] = {}
    for label, names in blocks.items():
        saved_total = sympy.expand(sympy.Add(*(saved.size[b] for b in saved_of[label])))
        input_bytes = sympy.expand(sympy.Add(*(saved.size[b] for b in saved_of[label] if block_of.get(b.name) != label)))
        probs, lse = _attention_extras(forward.graph, names, fw_states, symbols)
        fw = forward_points[label] or [saved_total]
        bw = backward_points[label] or [saved_total]
        results[label] = BlockMemory(
            saved={"flash": saved_total, "math": sympy.expand(saved_total + probs - lse)},
            forward_peaks={"flash": prune_candidates(fw),
                           "math": prune_candidates([p + probs - lse for p in fw] + [saved_total + 2 * probs])},
            backward_peaks={"flash": prune_candidates(bw),
                            "math": prune_candidates([p + probs - lse for p in bw] + [saved_total + 3 * probs])},
            input=input_bytes, output=sympy.expand(output_bytes[label]),
            saved_names=[b.name for b in saved_of[label]],
            attention_probs=sympy.expand(probs),
        )
    return results


def memory_analysis(program):
    """Pass: per block class memory (saved activations per attention kernel, forward/backward
    peak candidates, input/output bytes), attached to a copy of the program as
    ``program.memory`` (class id -> :class:`BlockMemory`). IR nodes are unchanged."""
    import copy

    from .cost_annotation import annotate_graphs, program_graphs
    from .manager import PassResult

    graphs = program_graphs(program)
    costs = annotate_graphs(graphs.forward, graphs.backward, graphs.params, graphs.symbols)
    blocks = {str(class_id): names for class_id, names in graphs.blocks.items()}
    results = analyse_memory(graphs.forward, graphs.backward, costs, graphs.params, blocks, graphs.symbols)
    analysed = copy.copy(program)
    analysed.memory = {int(label): memory for label, memory in results.items()}
    return PassResult(analysed, False)
