"""Memory analysis pass: activation and transient memory per block class, by liveness.

Works on the captured forward and backward graphs (nodes carry FakeTensor ``meta["val"]`` with
symbolic sizes) and the tensor-parallel states from the cost annotation (a value sharded by
``t`` occupies ``1/t`` of its bytes). The graphs may hold several blocks; ``blocks`` maps a
block label to the names of its nodes and every result is per block. Memory is counted per
*storage*: a view (``view``, ``transpose``, ``t``, ``detach``, an item of ``split`` ...) shares
its base's storage, which lives from the node that creates it to the last use of any view of it.
An op with several outputs allocates each (``native_dropout``'s output and mask, a norm's output and
statistics): each item is a storage of its own, so a saved mask does not keep the dropout's output.

Results per block, sympy expressions in ``b``, ``s``, ``t``:
- ``saved``: activations the forward keeps for the backward per micro-batch, charged to each
  block whose backward reads them (so a layer keeps its input, as Megatron counts), parameters
  excluded, for the attention kernel asked for: ``flash`` keeps q, k, v, out and the
  log-sum-exp (what the captured flash op saves); ``math`` keeps the ``b*h*s*s`` probabilities
  instead of the log-sum-exp (torch's math kernel: q and k scaled, scores, softmax, matmul);
- ``forward_peaks``: candidates for the peak, over the block's forward program points, of its
  saved storages created so far (its input from the start) + live non-saved storages it created
  + the op's own workspace where it has one (``mist::linear_cross_entropy``: a chunk of logits;
  the math attention kernel at its point: the scaled q and k, the scores and the probabilities);
- ``backward_peaks``: candidates for the peak, over the block's backward program points, of its
  saved storages not yet released + every live gradient-side storage (the incoming gradient,
  intermediates, each parameter gradient at the moment it is produced, before it is
  accumulated into ``.grad``) + the op's workspace (the fused loss's backward: its chunk and fp32
  weight-gradient accumulator; the math attention backward at its softmax: the probabilities,
  their gradient and the scores' gradient). A saved storage is released when the autograd node
  that saved it is done: after the last backward op with that node's ``seq_nr`` (a matmul's two
  products, a product's two factors' gradients);
- ``forward_peaks_weights_free`` / ``backward_peaks_weights_free``: the candidates of the points
  at which the block needs neither its weights nor its parameter gradients: forward points after
  its last read of a parameter (a loss after the head), backward points before its first
  parameter read or parameter gradient (the loss backward). A runtime that gathers or brings in
  weights per block, and allocates gradients when a block's backward begins, holds neither
  there; ``*_weights`` are the other points (``forward_peaks`` / ``backward_peaks`` hold all);
- ``saved_sequence``: the saved storages' sizes in the order the forward creates them;
- ``input`` / ``output``: bytes of the block's activation input (saved storages it did not
  create) and of the hidden state it hands on.
The maximum of polynomials with positive coefficients is no polynomial, so peaks stay as lists
of candidates with coefficient-wise dominated ones removed; the cost model takes their maximum
vectorised.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx

from ..ir.program import MistProgram
from ..ir.vocabulary import ATTENTION_KERNELS
from ..ops.linear_cross_entropy import workspace_points
from .cost_annotation import (
    ATTENTION_BACKWARD,
    ATTENTION_FORWARD,
    FUSED_LOSS,
    FUSED_LOSS_BACKWARD,
    B,
    ProgramCosts,
    S,
    T,
    is_view,
    op_name,
    tensor_bytes,
    tensor_shape,
    value_bytes,
)
from .manager import PassResult, transforms

MATMUL_BACKWARD_OPS = {"mm", "bmm", "addmm", "baddbmm"}


def owns_storage(node: fx.Node) -> bool:
    """An item of an op that allocates each of its outputs (``native_dropout``'s output and mask, a norm's
    output and statistics, flash attention's output and log-sum-exp): a storage of its own, not a view of
    the tuple. Items of view ops (``split``, ``unbind``) are views; the fused loss's are its own (see
    :func:`_node_bytes`)."""
    if node.op != "call_function" or node.target is not operator.getitem or not node.all_input_nodes:
        return False
    producer = node.args[0]
    return (isinstance(producer, fx.Node) and producer.op == "call_function"
            and isinstance(producer.target, torch._ops.OpOverload) and not producer.target.is_view
            and op_name(producer) not in WORKSPACE_OPS)


def _allocates(node: fx.Node) -> bool:
    """A node whose value is new storage: an op that is not a view, or an item it owns."""
    return node.op == "call_function" and (not is_view(node) or owns_storage(node))


def _storage_state(node: fx.Node, states: dict[str, str]) -> str | None:
    """The tensor-parallel state of a storage: its own, or an owned item's producer's."""
    return states.get(node.name, states.get(node.args[0].name) if owns_storage(node) else None)


def _base(node: fx.Node) -> fx.Node:
    while is_view(node) and node.all_input_nodes and not owns_storage(node):
        node = node.all_input_nodes[0]
    return node


def _scaled(size: sympy.Expr, state: str | None) -> sympy.Expr:
    return size / T if state in ("S", "Q") else size  # Q: a sequence chunk (sequence parallelism)


def _coefficients_nonnegative(expr: sympy.Expr) -> bool:
    numerator, denominator = sympy.fraction(sympy.together(sympy.expand(expr)))
    if not all(c > 0 for c in sympy.Poly(denominator, B, S, T).coeffs()):
        return False
    return all(c >= 0 for c in sympy.Poly(sympy.expand(numerator), B, S, T).coeffs())


def _laurent(expr: sympy.Expr) -> dict[tuple[int, int, int], sympy.Number] | None:
    """The coefficients of ``expr`` as a Laurent polynomial in b, s, t (integer powers, negative ones
    included: sizes sharded by t divide by it), keyed by the powers; None for anything else."""
    terms: dict[tuple[int, int, int], sympy.Number] = {}
    for monomial, coefficient in sympy.expand(expr).as_coefficients_dict().items():
        if not coefficient.is_Number:
            return None
        powers = {base: exponent for base, exponent in monomial.as_powers_dict().items() if base != 1}
        if any(base not in (B, S, T) or not exponent.is_Integer for base, exponent in powers.items()):
            return None
        key = (int(powers.get(B, 0)), int(powers.get(S, 0)), int(powers.get(T, 0)))
        terms[key] = terms.get(key, sympy.Integer(0)) + coefficient
    return terms


def _laurent_dominates(a: dict, b: dict) -> bool:
    """Every coefficient of ``a - b`` is non-negative (what the polynomial test decides, term by term:
    a Laurent polynomial over its monomial denominator has the same coefficients)."""
    return all(a.get(key, 0) - b.get(key, 0) >= 0 for key in a.keys() | b.keys())


def _dominates(a: sympy.Expr, b: sympy.Expr, a_terms: dict | None, b_terms: dict | None) -> bool:
    if a_terms is not None and b_terms is not None:
        return _laurent_dominates(a_terms, b_terms)
    return _coefficients_nonnegative(a - b)  # not Laurent polynomials: the rational-function algebra


def dominates(a: sympy.Expr, b: sympy.Expr) -> bool:
    """``a >= b`` for all positive b, s, t, decided on the coefficients of ``a - b``."""
    return _dominates(a, b, _laurent(a), _laurent(b))


def prune_candidates(candidates: list[sympy.Expr]) -> list[sympy.Expr]:
    """Drop candidates another candidate dominates coefficient-wise (keeps one of equals). Each
    candidate's coefficients are read once; pairs are compared on them (the polynomial algebra of
    :func:`dominates` only for a candidate that is not a Laurent polynomial in b, s, t)."""
    unique = list(dict.fromkeys(sympy.expand(c) for c in candidates))
    terms = {c: _laurent(c) for c in unique}

    def over(a: sympy.Expr, b: sympy.Expr) -> bool:
        return _dominates(a, b, terms[a], terms[b])

    kept: list[sympy.Expr] = []
    for candidate in unique:
        if any(over(other, candidate) for other in kept):
            continue
        kept = [other for other in kept if not over(candidate, other)] + [candidate]
    return kept or [sympy.Integer(0)]


@dataclass
class BlockMemory:
    saved: dict[str, sympy.Expr]  # attention kernel -> saved activation bytes per micro-batch
    forward_peaks: dict[str, list[sympy.Expr]]
    backward_peaks: dict[str, list[sympy.Expr]]
    input: sympy.Expr
    output: sympy.Expr
    saved_names: list[str] = field(default_factory=list)
    saved_sizes: dict[str, sympy.Expr] = field(default_factory=dict)  # saved storage (its forward base) -> bytes
    attention_probs: sympy.Expr = sympy.Integer(0)  # bytes of the b*h*s*s probabilities (math kernel)
    # sizes of the saved storages in the order the forward saves them (activation offload takes them greedily)
    saved_sequence: list[sympy.Expr] = field(default_factory=list)
    saved_offloadable: list[bool] = field(default_factory=list)  # saved as a contiguous tensor (offload moves those)
    # the same candidates split by whether the block's weights / parameter gradients are needed there
    forward_peaks_weights: dict[str, list[sympy.Expr]] = field(default_factory=dict)
    forward_peaks_weights_free: dict[str, list[sympy.Expr]] = field(default_factory=dict)
    backward_peaks_weights: dict[str, list[sympy.Expr]] = field(default_factory=dict)
    backward_peaks_weights_free: dict[str, list[sympy.Expr]] = field(default_factory=dict)


def _last_uses(graph: fx.Graph) -> dict[fx.Node, int]:
    """Index of the last node that uses each storage base."""
    order = {node: index for index, node in enumerate(graph.nodes)}
    last: dict[fx.Node, int] = {}
    for node in graph.nodes:
        for arg in node.all_input_nodes:
            base = _base(arg)
            last[base] = max(last.get(base, -1), order[node])
    return last


@dataclass
class _Attention:
    """Bytes of one attention op of a block, for the math kernel's adjustments of the flash points."""

    probs: sympy.Expr  # the b*h*s*s probabilities (one score-sized tensor)
    lse: sympy.Expr  # the flash kernel's log-sum-exp
    out: sympy.Expr  # its output
    query_key: sympy.Expr  # q + k (the math kernel scales both into new tensors)
    value: sympy.Expr

    @property
    def saved_change(self) -> sympy.Expr:
        """What math keeps instead of flash: the probabilities, no log-sum-exp (the output's storage
        becomes the contiguous copy the o-projection saves: the same bytes)."""
        return self.probs - self.lse

    @property
    def forward_point(self) -> sympy.Expr:
        """At the kernel, against flash's point there (which holds out and lse): q, k and their scaled
        copies, the scores and the probabilities at the softmax, no output yet."""
        return self.query_key + 2 * self.probs - self.out - self.lse

    @property
    def backward_point(self) -> sympy.Expr:
        """At the softmax backward, against flash's point at its backward op (saved q, k, v, out, lse and
        the q/k/v gradients): v and the output released, no q/k gradient yet; the probabilities,
        their gradient and the scores' gradient."""
        return 3 * self.probs - self.value - self.out - self.lse - self.query_key


def _attention_of(node: fx.Node, state: str | None, symbols) -> _Attention:
    query, key, value = (arg.meta["val"] for arg in node.args[:3])
    batch, heads, seq, _ = tensor_shape(query, symbols)
    key_seq = tensor_shape(key, symbols)[2]
    outputs = node.meta.get("val")
    outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    lse = tensor_bytes(outputs[1], symbols) if len(outputs) > 1 and isinstance(outputs[1], torch.Tensor) else 0
    parts = (batch * heads * seq * key_seq * query.element_size(), lse, tensor_bytes(outputs[0], symbols),
             tensor_bytes(query, symbols) + tensor_bytes(key, symbols), tensor_bytes(value, symbols))
    return _Attention(*(_scaled(sympy.sympify(part), state) for part in parts))


def _fused_loss_workspace(node: fx.Node, states: dict[str, str], phase: str, symbols) -> list[sympy.Expr]:
    """``mist::linear_cross_entropy`` (forward / backward): the op's own transient at its point."""
    offset = 0 if phase == "forward" else 1  # the backward op takes the loss gradient first
    hidden, weight = node.args[offset], node.args[offset + 1]
    rows, width = tensor_shape(hidden.meta["val"], symbols)
    vocab = tensor_shape(weight.meta["val"], symbols)[0]
    vocab = _scaled(vocab, states.get(weight.name, states.get(_base(weight).name)))
    return [sympy.expand(w) for w in workspace_points(rows, vocab, width, hidden.meta["val"].element_size(),
                                                      weight.meta["val"].element_size(), phase)]


WORKSPACE_OPS = {FUSED_LOSS: "forward", FUSED_LOSS_BACKWARD: "backward"}


def _node_bytes(node: fx.Node, states: dict[str, str], symbols, transient: frozenset[str] = frozenset()) -> sympy.Expr:
    """Bytes of a node's outputs on one device (``1/t`` of a sharded value; nothing for a value a fused
    kernel keeps in registers, named in ``transient``). The fused loss's backward returns the
    replicated hidden's gradient and the weight shard's."""
    if node.name in transient:
        return sympy.Integer(0)
    if owns_storage(node):  # its producer's output of that index (none where a fused kernel keeps it)
        producer = node.args[0]
        if producer.name in transient:
            return sympy.Integer(0)
        return _scaled(value_bytes(node, symbols), _storage_state(node, states))
    if any(owns_storage(user) for user in node.users):  # its items own the storages
        return sympy.Integer(0)
    if op_name(node) == FUSED_LOSS_BACKWARD:
        grad_hidden, grad_weight = node.meta["val"]
        weight = node.args[2]
        return tensor_bytes(grad_hidden, symbols) + _scaled(tensor_bytes(grad_weight, symbols),
                                                             states.get(weight.name, states.get(_base(weight).name)))
    return _scaled(value_bytes(node, symbols), states.get(node.name))


@dataclass
class _Saved:
    """Saved storages: forward base -> bytes, and which blocks' backward reads each."""

    size: dict[fx.Node, sympy.Expr]
    readers: dict[fx.Node, set[str]]
    holders: dict[fx.Node, list[fx.Node]]  # forward base -> backward placeholders viewing it
    contiguous: dict[fx.Node, bool] = field(default_factory=dict)  # some saved view of it is contiguous


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
        saved.size[base] = _scaled(value_bytes(base, symbols), _storage_state(base, states))
        readers = {block_of[user.name] for user in node.users if user.name in block_of}
        saved.readers.setdefault(base, set()).update(readers or {block_of.get(base.name, "")})
        saved.holders.setdefault(base, []).append(node)
        saved.contiguous[base] = saved.contiguous.get(base, False) or _is_contiguous(source.meta["val"])
    return saved


def analyse_memory(forward: fx.GraphModule, backward: fx.GraphModule, costs: ProgramCosts, params: set[str],
                   blocks: dict[str, set[str]], symbols=None,
                   backward_inputs: dict[str, str] | None = None,
                   transient: frozenset[str] = frozenset(), block_nodes: bool = False) -> dict[str, BlockMemory]:
    """Liveness over the forward and backward graphs, results per block (module docstring).
    ``transient``: nodes whose values are never stored (intermediates of a fused kernel);
    ``block_nodes``: each block's backward is one autograd node (a compiled unit), which returns the
    block's parameter gradients together when it is done (its saved tensors are still freed as the
    compiled backward uses them: AOTAutograd clears them from the node early)."""
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
    forward_points: dict[str, list[_Point]] = {label: [] for label in blocks}
    param_nodes = {n for n in fw_placeholders if n.name in params}
    last_weight_read = _last_param_reads(forward.graph, param_nodes, block_of)
    output_bytes = {label: sympy.Integer(0) for label in blocks}
    attentions: dict[str, list[_Attention]] = {label: [] for label in blocks}
    math_change = {label: sympy.Integer(0) for label in blocks}  # math - flash after the attentions so far
    for node in forward.graph.nodes:
        if not _allocates(node):
            continue
        label = block_of.get(node.name)
        size = _node_bytes(node, fw_states, symbols, transient)
        if label is not None:
            if node in saved.size and label in saved.readers[node]:
                saved_so_far[label] += saved.size[node]
            elif size != 0:
                live[node] = size
                live_total[label] += size
            here = saved_so_far[label] + live_total[label]
            needs = order[node] <= last_weight_read.get(label, -1)
            math = here + math_change[label]
            if op_name(node) in ATTENTION_FORWARD:
                attention = _attention_of(node, fw_states.get(node.name), symbols)
                attentions[label].append(attention)
                math = here + math_change[label] + attention.forward_point
                math_change[label] += attention.saved_change
            forward_points[label].append(_Point(here, math, needs))
            for extra in _workspace(node, fw_states, symbols):
                forward_points[label].append(_Point(here + extra, math + extra, needs))
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
    bw_nodes = list(backward.graph.nodes)
    next_op = _next_ops(bw_nodes)
    node_done = _autograd_node_ends(bw_nodes)
    block_done = _block_ends(bw_nodes, block_of) if block_nodes else {}
    for base, holders in saved.holders.items():
        end = max(bw_last.get(h, -1) for h in holders)
        # autograd frees a node's saved tensors when the node is done: every op of its backward (same
        # ``seq_nr``: a matmul's weight and input gradients, a product's two factors' gradients) runs first
        done = node_done.get(end)
        if done is not None:
            release[base] = done
            continue
        follower = next_op.get(end)  # no seq_nr: a matmul's backward is its two products
        paired = (0 <= end and follower is not None and op_name(bw_nodes[end]) in MATMUL_BACKWARD_OPS
                  and op_name(bw_nodes[follower]) in MATMUL_BACKWARD_OPS)
        release[base] = follower if paired else end
    alive_saved = {label: sympy.Add(*(saved.size[b] for b in saved_of[label])) for label in blocks}
    released: set[fx.Node] = set()
    grad_live: dict[fx.Node, sympy.Expr] = {}
    grad_total = sympy.Integer(0)
    for node in backward.graph.nodes:
        if node.op == "placeholder" and node.name.startswith("tangents"):
            grad_live[node] = value_bytes(node, symbols)
            grad_total += grad_live[node]
    produced_at: dict[fx.Node, int] = {}  # parameter gradient -> index of the op that produced it
    backward_points: dict[str, list[_Point]] = {label: [] for label in blocks}
    pending = {label: list(attentions[label]) for label in blocks}  # attentions whose backward is to come
    fw_by_name = {n.name: n for n in forward.graph.nodes}
    mapping = backward_inputs or {}
    bw_param_nodes = {n for n in backward.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")
                      and _base(fw_by_name.get(mapping.get(n.name, n.name), n)).name in params
                      and mapping.get(n.name, n.name) in fw_by_name}
    first_weight_use = _first_param_uses(backward.graph, bw_param_nodes, grad_outputs, block_of)
    for index, node in enumerate(backward.graph.nodes):
        if not _allocates(node):
            continue
        label = block_of.get(node.name)
        if block_nodes:  # a finished node's gradients were added to ``.grad`` before the next node runs
            for dead in [g for g in grad_live if g in grad_outputs and produced_at.get(g, index) < index]:
                grad_total -= grad_live.pop(dead)
        size = _node_bytes(node, bw_states, symbols, transient)
        if size != 0:
            grad_live[node] = size
            grad_total += size
        if label is not None:
            here = alive_saved[label] + grad_total
            needs = index >= first_weight_use.get(label, len(backward.graph.nodes))
            change = sympy.Add(*(attention.saved_change for attention in pending[label]))
            math = here + change
            if op_name(node) in ATTENTION_BACKWARD and pending[label]:
                attention = pending[label].pop()
                math = here + change - attention.saved_change + attention.backward_point
            backward_points[label].append(_Point(here, math, needs))
            for extra in _workspace(node, bw_states, symbols):
                backward_points[label].append(_Point(here + extra, math + extra, needs))
        for base, end in release.items():
            if end <= index and base not in released:
                released.add(base)
                for reader in saved.readers[base]:
                    if reader in alive_saved:
                        alive_saved[reader] -= saved.size[base]
        # a parameter gradient is accumulated into ``.grad`` once its autograd node has finished, so it
        # lives through the node's next op (a matmul's input gradient after its weight gradient)
        for dead in [g for g in grad_live
                     if (g in grad_outputs and produced_at.get(g, index) < index) or
                     (g not in grad_outputs and bw_last.get(g, -1) <= index)]:
            grad_total -= grad_live.pop(dead)
        if node in grad_outputs or _base(node) in grad_outputs:
            produced_at[node] = block_done.get(index, index)

    results: dict[str, BlockMemory] = {}
    for label, names in blocks.items():
        saved_total = sympy.expand(sympy.Add(*(saved.size[b] for b in saved_of[label])))
        input_bytes = sympy.expand(sympy.Add(*(saved.size[b] for b in saved_of[label] if block_of.get(b.name) != label)))
        change = sympy.Add(*(attention.saved_change for attention in attentions[label]))
        fallback = [_Point(saved_total, saved_total + change, True)]
        fw = forward_points[label] or fallback
        bw = backward_points[label] or fallback
        save_order = _save_order(saved_of[label], names, order)

        def by_kernel(points: list[_Point], needs: bool | None = None, default: list[_Point] = ()) -> dict:
            chosen = [p for p in points if needs is None or p.needs_weights == needs] or list(default)
            if not chosen:
                return {"flash": [], "math": []}
            return {"flash": prune_candidates([p.flash for p in chosen]),
                    "math": prune_candidates([p.math for p in chosen])}

        results[label] = BlockMemory(
            saved={"flash": saved_total, "math": sympy.expand(saved_total + change)},
            forward_peaks=by_kernel(fw), backward_peaks=by_kernel(bw),
            input=input_bytes, output=sympy.expand(output_bytes[label]),
            saved_names=[b.name for b in saved_of[label]],
            saved_sizes={b.name: sympy.expand(saved.size[b]) for b in saved_of[label]},
            saved_sequence=[sympy.expand(saved.size[b]) for b in save_order],
            saved_offloadable=[saved.contiguous[b] for b in save_order],
            attention_probs=sympy.expand(sympy.Add(*(attention.probs for attention in attentions[label]))),
            forward_peaks_weights=by_kernel(fw, True, fallback), forward_peaks_weights_free=by_kernel(fw, False),
            backward_peaks_weights=by_kernel(bw, True, fallback), backward_peaks_weights_free=by_kernel(bw, False),
        )
    return results


@dataclass(frozen=True)
class _Point:
    """One program point of a block: live bytes with the flash and with the math attention kernel."""

    flash: sympy.Expr
    math: sympy.Expr
    needs_weights: bool


def _workspace(node: fx.Node, states: dict[str, str], symbols) -> list[sympy.Expr]:
    """Extra candidates at an op's point for the transient it holds inside (none for most ops): the
    fused loss's chunk, and with sequence parallelism the whole sequence gathered for an op that is not
    on a chunk (a column-parallel matmul reading the gathered norm output)."""
    phase = WORKSPACE_OPS.get(op_name(node))
    if phase is not None:
        return _fused_loss_workspace(node, states, phase, symbols)
    if states.get(node.name) not in ("Q", "P"):
        gathered = {_base(a) for a in node.all_input_nodes if states.get(a.name) == "Q"}
        if gathered:
            return [sympy.expand(sympy.Add(*(value_bytes(base, symbols) for base in gathered)))]
    return []


def _is_contiguous(value: torch.Tensor) -> bool:
    try:
        return bool(value.is_contiguous())
    except Exception:  # symbolic strides that cannot be decided: count it as offloadable
        return True


def _save_order(bases: list[fx.Node], names: set[str], order: dict[fx.Node, int]) -> list[fx.Node]:
    """Saved storages in the order the block's forward saves them: autograd saves a tensor when the
    first of the block's ops that reads it (directly or through a view) runs."""
    def first_reader(base: fx.Node) -> int:
        holders = [base, *(user for user in base.users if is_view(user))]
        readers = [order[user] for holder in holders for user in holder.users
                   if user.name in names and user in order and not is_view(user)]
        return min(readers, default=order.get(base, -1))
    return sorted(bases, key=first_reader)


def _autograd_node_ends(nodes: list[fx.Node]) -> dict[int, int]:
    """Index of each backward op -> index of the last op of the same autograd node (same ``seq_nr``,
    consecutive in the graph), for ops that carry one."""
    ends: dict[int, int] = {}
    run: list[int] = []
    current = None
    for index, node in enumerate(nodes):
        if node.op != "call_function" or is_view(node):
            continue
        seq = node.meta.get("seq_nr")
        if seq is None or seq != current:
            for member in run:
                ends[member] = run[-1]
            run, current = ([index] if seq is not None else []), seq
        else:
            run.append(index)
    for member in run:
        ends[member] = run[-1]
    return ends


def _block_ends(nodes: list[fx.Node], block_of: dict[str, str]) -> dict[int, int]:
    """Index of each backward op -> index of the op that ends its block's backward (one autograd node
    per block). The blocks' backwards run one after another, in the order their first ops appear; a
    block's is done when the next one's starts. An op labelled with a block whose backward is already
    done (the add of the residual's gradient: labelled with the block above, run inside the layer's
    backward) belongs to the node running then: it does not keep the earlier block's gradients alive."""
    started: set[str] = set()
    current: str | None = None  # the block whose backward runs now: the last one to start
    last: dict[str, int] = {}
    for index, node in enumerate(nodes):
        label = block_of.get(node.name) if node.op == "call_function" else None
        if label is not None and label not in started:
            started.add(label)
            current = label
        if label is not None and label == current:
            last[label] = index
    return {index: max(index, last[block_of[node.name]]) for index, node in enumerate(nodes)
            if node.op == "call_function" and node.name in block_of}


def _next_ops(nodes: list[fx.Node]) -> dict[int, int]:
    """Index of each node -> index of the next op that computes (not a view, not a placeholder)."""
    following: dict[int, int] = {}
    upcoming = None
    for index in range(len(nodes) - 1, -1, -1):
        following[index] = upcoming
        if nodes[index].op == "call_function" and not is_view(nodes[index]):
            upcoming = index
    return following


def _reads_param(node: fx.Node, param_nodes: set[fx.Node]) -> bool:
    return any(_base(arg) in param_nodes for arg in node.all_input_nodes)


def _last_param_reads(graph: fx.Graph, param_nodes: set[fx.Node], block_of: dict[str, str]) -> dict[str, int]:
    """Per block: index of its last forward node that reads a parameter."""
    last: dict[str, int] = {}
    for index, node in enumerate(graph.nodes):
        label = block_of.get(node.name)
        if label is not None and node.op == "call_function" and _reads_param(node, param_nodes):
            last[label] = index
    return last


def _first_param_uses(graph: fx.Graph, param_nodes: set[fx.Node], grad_outputs: set[fx.Node],
                      block_of: dict[str, str]) -> dict[str, int]:
    """Per block: index of its first backward node that reads a parameter or produces a parameter gradient."""
    first: dict[str, int] = {}
    for index, node in enumerate(graph.nodes):
        label = block_of.get(node.name)
        if label is None or label in first or node.op != "call_function":
            continue
        if _reads_param(node, param_nodes) or _base(node) in grad_outputs or node in grad_outputs:
            first[label] = index
    return first


@transforms(MistProgram)
def memory_analysis(program: MistProgram) -> PassResult:
    """Pass: per block class memory (saved activations per attention kernel, forward/backward
    peak candidates, input/output bytes), attached to a copy of the program as
    ``program.analysis.memory`` (class id -> :class:`BlockMemory`; the costs of ``cost_annotation``
    are reused when it ran before). IR nodes are unchanged."""
    import copy
    from dataclasses import replace

    from .cost_annotation import PricedGraphs, annotate_graphs, program_graphs

    priced = program.analysis
    if priced is None:
        graphs = program_graphs(program)
        costs = annotate_graphs(graphs.forward, graphs.backward, graphs.params, graphs.symbols, sharding=graphs.sharding)
        priced = PricedGraphs(graphs, costs)
    graphs = priced.graphs
    blocks = {str(class_id): names for class_id, names in graphs.blocks.items()}
    results = analyse_memory(graphs.forward, graphs.backward, priced.costs, graphs.params, blocks, graphs.symbols,
                             transient=priced.transient, block_nodes=priced.block_nodes)
    analysed = copy.copy(program)
    analysed.analysis = replace(priced, memory={int(label): memory for label, memory in results.items()})
    return PassResult(analysed, False)
