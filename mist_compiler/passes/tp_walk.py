"""The state of one tensor-parallel recognition walk over a region (see ``tp_recognition``).

Every value of the region gets a state: ``R`` (replicated), ``("S", d)`` / ``("S", d, outer)``
(split along dimension ``d``; ``outer`` > 1 when ``d`` merges a leading factor, e.g. Bloom's
``batch * heads``, with the split inside each of its ``outer`` blocks), ``P`` (a partial sum) or
``C`` (not an activation). The walk also records what the rules decided (parameter splits,
graph edits, the sizes split over the ranks) and, for the search over choices
(``tp_recognition.recognise_region``), which choices each value depends on: a failure names
them, so the search knows what to try next.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..ir.model_graph import GraphEdit, RegionSharding, ShardSpec

R, P, C = "R", "P", "C"
COLUMN, REPLICATE = 0, 1  # the options of a linear that reads a replicated input


class NotShardable(Exception):
    """The region cannot be split as the current choices say; names where and why, and the
    choices (``blame``: node names) the failing values depend on."""

    def __init__(self, message: str, blame: frozenset = frozenset()) -> None:
        super().__init__(message)
        self.blame = blame


def sharded(dim: int, outer: int = 1) -> tuple:
    return ("S", dim) if outer == 1 else ("S", dim, outer)


def is_sharded(state) -> bool:
    return isinstance(state, tuple)


def split_dim(state) -> int:
    return state[1]


def split_outer(state) -> int:
    return state[2] if len(state) > 2 else 1


def op_of(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    if node.target is operator.getitem:
        return "getitem"
    return getattr(node.target, "__name__", str(node.target))


def value_of(node) -> object:
    return node.meta.get("example_value") if isinstance(node, fx.Node) else node


def is_tensor_value(value) -> bool:
    if isinstance(value, (tuple, list)):
        return any(isinstance(v, torch.Tensor) for v in value)
    return isinstance(value, torch.Tensor)


def shape_of(node) -> list[int]:
    """Concrete example sizes (dynamo's hints) of a node's tensor value."""
    value = value_of(node)
    sizes = []
    for d in value.shape:
        sizes.append(int(d.node.hint) if isinstance(d, torch.SymInt) and d.node.hint is not None else int(d))
    return sizes


def requires_grad(node) -> bool:
    value = value_of(node)
    return isinstance(value, torch.Tensor) and bool(value.requires_grad)


def norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def source_line(node: fx.Node) -> str:
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    frames = [i for i, line in enumerate(trace) if line.strip().startswith("File ")]
    if not frames:
        return ""
    last = frames[-1]
    code = trace[last + 1].strip() if last + 1 < len(trace) else ""
    where = trace[last].strip().replace("File ", "")
    return f" ({where}: {code})" if code else f" ({where})"


@dataclass
class Walk:
    """One pass over one region's nodes under fixed ``choices`` (node name -> option index)."""

    graph: fx.Graph
    label: str
    params: set[str]  # parameter placeholders of this region
    choices: dict[str, int] = field(default_factory=dict)
    states: dict[str, object] = field(default_factory=dict)
    sharding: RegionSharding = field(default_factory=RegionSharding)
    sizes: list[int] = field(default_factory=list)  # sizes split over the ranks (for the granularity)
    column_out: dict[str, tuple[str, int]] = field(default_factory=dict)  # value -> (column weight, rows per index)
    column_bias: dict[str, str] = field(default_factory=dict)  # column-parallel weight -> its bias
    copied: dict[str, GraphEdit] = field(default_factory=dict)  # value -> its copy edit (gradient all-reduce)
    pending_bias: dict[str, tuple[str, ...]] = field(default_factory=dict)  # P value -> biases to add after reduce
    means: set[str] = field(default_factory=set)  # P values that are means over the split (divided by t)
    read_partial: set[str] = field(default_factory=set)  # P values some node already read as partial
    origin: dict[str, frozenset] = field(default_factory=dict)  # value -> choices it depends on
    reduced: set[str] = field(default_factory=set)  # values computed from an all-reduce of this region
    local_sizes: set[str] = field(default_factory=set)  # sizes read from a split dimension (local, not global)
    options: dict[str, int] = field(default_factory=dict)  # choice point -> number of options, in walk order
    costs: dict[str, int] = field(default_factory=dict)  # choice point -> cost of its non-default option
    replicated: dict[str, str] = field(default_factory=dict)  # weight placeholder -> linear node replicating it
    decided: set[str] = field(default_factory=set)  # nodes a rule set the state of ahead of the walk

    def state(self, arg) -> object:
        if isinstance(arg, fx.Node):
            return self.states.get(arg.name, C)
        return C

    def choose(self, node: fx.Node, count: int, cost: int = 1) -> int:
        """The option this walk takes at choice point ``node`` (``count`` options; ``cost``: how much
        taking any but the first gives up, for the search's order)."""
        self.options[node.name] = count
        self.costs[node.name] = cost
        return min(self.choices.get(node.name, 0), count - 1)

    def blame_of(self, nodes) -> frozenset:
        found: frozenset = frozenset()
        for arg in nodes:
            if isinstance(arg, fx.Node):
                found |= self.origin.get(arg.name, frozenset())
        return found

    def fail(self, node: fx.Node, why: str, blame: frozenset | None = None):
        if blame is None:
            blame = self.blame_of(node.all_input_nodes)
        raise NotShardable(f"{self.label}: {node.name} ({op_of(node)}) {why}{source_line(node)}", blame)

    def edit(self, node: fx.Node, kind: str, position: tuple = (), data: tuple = ()) -> GraphEdit:
        edit = GraphEdit(node.name, kind, position, data)
        self.sharding.edits.append(edit)
        return edit

    def shard(self, param: fx.Node, spec: ShardSpec, size: int) -> None:
        previous = self.sharding.shards.get(param.name)
        if previous is not None and previous != spec:
            raise NotShardable(f"{self.label}: parameter {param.name} would be split two ways ({previous}, {spec})",
                               self.blame_of([param]))
        self.sharding.shards[param.name] = spec
        self.sizes.extend(spec.segments or (size,))

    # ---- collectives -------------------------------------------------------------------------
    def reduce(self, node: fx.Node) -> None:
        """All-reduce the partial sum ``node`` (with its deferred biases); it becomes replicated."""
        if node.name in self.read_partial:
            raise NotShardable(f"{self.label}: the partial sum {node.name} is read both before and after its "
                               "all-reduce", self.blame_of([node]))
        kind = "reduce_mean" if node.name in self.means else "reduce_out"
        self.edit(node, kind, data=self.pending_bias.pop(node.name, ()))
        self.states[node.name] = R
        self.reduced.add(node.name)

    def full_inputs(self, node: fx.Node) -> list:
        """The states of ``node``'s inputs after all-reducing the partial sums among them."""
        for arg in node.all_input_nodes:
            if self.state(arg) == P:
                self.reduce(arg)
        return [self.state(arg) for arg in node.all_input_nodes]

    def copy_for(self, value: fx.Node, user: fx.Node) -> None:
        """``value`` (replicated) feeds split computation of ``user``: its gradient there is partial
        on every rank, so it reaches ``user`` through Megatron's *f* (all-reduce of the gradient)."""
        edit = self.copied.get(value.name)
        if edit is None:
            self.copied[value.name] = self.edit(value, "copy_in", data=(user.name,))
        elif user.name not in edit.data:
            index = self.sharding.edits.index(edit)
            self.copied[value.name] = self.sharding.edits[index] = GraphEdit(edit.node, edit.kind, edit.position,
                                                                              (*edit.data, user.name))

    def scatter(self, value: fx.Node, user: fx.Node, dim: int, outer: int = 1, segments: tuple = ()) -> None:
        """``value`` (replicated, full size along dimension ``dim`` where ``user`` reads it with split
        values) is read as this rank's part of it (its gradient all-gathered back). Allowed only for
        values every rank computes from the layer's inputs: after an all-reduce of this region it
        would mean computing a split value twice over."""
        if value.name in self.reduced:
            self.fail(user, f"meets {value.name}, which is replicated after an all-reduce, with a split value",
                      self.blame_of([value]) | self.blame_of(user.all_input_nodes))
        block = shape_of(value)[dim] // outer  # per block of a merged dimension: static (not the batch)
        self.edit(value, "scatter", position=(dim, block), data=(user.name, segments))


__all__ = ["C", "COLUMN", "NotShardable", "P", "R", "REPLICATE", "Walk", "is_sharded", "is_tensor_value",
           "norm_dim", "op_of", "requires_grad", "shape_of", "sharded", "source_line", "split_dim", "split_outer",
           "value_of"]
