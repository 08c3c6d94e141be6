"""Per-tensor checkpoint and offload insertion: the plan's ``activations`` in a stage's layer programs.

Input: a :class:`~mist_compiler.ir.stage.StageGraph` after ``checkpoint`` and the stage's plan. For
every layer unit that is not checkpointed as a whole, the nodes the plan recomputes and offloads
(``StagePlan.activations``; with sequence parallelism also every ``tp.sp_gather``: the gathered
sequence is gathered again in the backward instead of being kept, as Megatron does) become the
unit's :class:`~mist_compiler.ir.stage.SavedPolicy`:

- the unit graph gets ``saved_tags.enter/leave`` markers around each call, so the runtime's
  saved-tensor hooks know which node made each tensor autograd saves;
- the *replay* program: the recomputed nodes, in order, from the values they read that are not
  recomputed themselves (``held``: kept by reference from the forward; weights and what is computed
  from weights alone are read again), with the same markers (the runtime captures what each
  recomputed node saves, in order, and hands autograd those tensors);
- the offload fractions per node (a held value's too: the runtime then holds its host copy and brings
  it back for the replay, as for any offloaded saved tensor).
What is recomputed and offloaded is exactly what the plan says; the memory the runtime keeps is
what ``cost.activation_policy`` prices: the saved tensors of the other nodes, the host-side
fractions elsewhere, and the held values that autograd does not keep anyway.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch.fx as fx

from ..ir.model_graph import ModelGraph
from ..ir.plan import ActivationPolicy, Plan, PlanError
from ..ir.stage import SavedPolicy, StageGraph
from ..ops import saved_tags
from .manager import PassResult
from .saved_tensors import RANDOM_OPS
from .tp_sharding import clone_graph

MARKERS = (saved_tags.enter, saved_tags.leave)
GATHER = "tp.sp_gather"


class ActivationPolicyError(PlanError):
    """A plan's per-tensor choices that do not fit the model's layers; names the field and the node."""


def layer_node_names(model: ModelGraph) -> dict[str, fx.Node]:
    """Nodes a plan's ``activations`` may name: every layer program's nodes and its hidden input."""
    by_name = model._by_name()
    names = {}
    for region in model.regions:
        for name in region.nodes:
            names[name] = by_name[name]
        names[f"{region.carried_in}_in"] = by_name[region.carried_in]
    return names


def _random(node: fx.Node) -> bool:
    op = str(node.target) if node.op == "call_method" else getattr(node.target, "__name__", str(node.target))
    if op not in RANDOM_OPS:
        return False
    probability = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    return not (isinstance(probability, (int, float)) and probability == 0)


def check_activation_policy(model: ModelGraph, plan: Plan) -> None:
    """Refuse per-tensor choices naming nodes the layers do not have, or recomputing random ones."""
    names = layer_node_names(model)
    inputs = {f"{region.carried_in}_in" for region in model.regions}
    for index, stage in enumerate(plan.stages):
        policy = stage.activations
        if policy is None:
            continue
        where = f"plan field stages[{index}].activations"
        for position, node in enumerate(policy.recompute):
            if node not in names or node in inputs:
                raise ActivationPolicyError(f"{where}.recompute[{position}]: {node!r} is not a node of the layer program "
                                            f"(`mistc ir --after activation_policy` prints them)")
            if _random(names[node]):
                raise ActivationPolicyError(f"{where}.recompute[{position}]: {node!r} draws random numbers; running it "
                                            "again would not give the tensors it saved")
        for node, _ in policy.offload:
            if node not in names:
                raise ActivationPolicyError(f"{where}.offload.{node}: not a node of the layer program")


def mark(graph: fx.Graph) -> None:
    """In place: ``saved_tags.enter(name)`` before and ``saved_tags.leave(name, value)`` after each call."""
    for node in list(graph.nodes):
        if node.op not in ("call_function", "call_method", "call_module") or node.target in MARKERS:
            continue
        with graph.inserting_before(node):
            graph.call_function(saved_tags.enter, (node.name,))
        with graph.inserting_after(node):
            graph.call_function(saved_tags.leave, (node.name, node))


def replay_program(graph: fx.Graph, recompute: set[str]) -> tuple[fx.Graph, tuple[str, ...], tuple[str, ...]]:
    """The recomputation of ``recompute`` (node names of ``graph``, a unit graph without markers):
    ``(graph, held, replayed)``: ``held`` values in, ``replayed`` nodes' values out, in order."""
    order = [n for n in graph.nodes if n.name in recompute and n.op != "placeholder"]
    weights_only: dict[str, bool] = {}

    def from_weights(node: fx.Node) -> bool:  # computed from weights and constants alone
        if node.name not in weights_only:
            weights_only[node.name] = node.op == "get_attr" or (
                node.op in ("call_function", "call_method", "call_module") and node.name not in recompute
                and all(from_weights(a) for a in node.all_input_nodes))
        return weights_only[node.name]

    held: list[str] = []
    for node in order:
        for arg in node.all_input_nodes:
            if arg.name not in recompute and not from_weights(arg) and arg.name not in held:
                held.append(arg.name)
    replay = fx.Graph()
    env: dict[str, fx.Node] = {}
    by_name = {n.name: n for n in graph.nodes}
    for name in held:
        env[name] = replay.placeholder(name)
        env[name].meta.update(by_name[name].meta)

    def value(arg: fx.Node) -> fx.Node:
        if arg.name not in env:  # a weight, or computed from weights alone: computed again
            env[arg.name] = replay.node_copy(arg, value)
        return env[arg.name]

    for node in order:
        replay.call_function(saved_tags.enter, (node.name,))
        env[node.name] = replay.node_copy(node, value)
        replay.call_function(saved_tags.leave, (node.name, env[node.name]))
    replayed = tuple(node.name for node in order)
    replay.output(tuple(env[name] for name in replayed))
    replay.lint()
    return replay, tuple(held), replayed


@dataclass
class ActivationPolicyInsertion:
    """The pass for one stage: its plan's per-tensor choices (and sequence parallelism's re-gathers)."""

    policy: ActivationPolicy | None
    sequence_parallel: bool = False
    name: str = "activation_policy"
    input_type = output_type = StageGraph

    def __call__(self, stage: StageGraph) -> PassResult:
        if self.policy is None and not self.sequence_parallel:
            return PassResult(stage, False)
        wanted = set(self.policy.recompute) if self.policy is not None else set()
        offload = self.policy.offload_fractions if self.policy is not None else {}
        done: dict[int, tuple[fx.Graph, SavedPolicy]] = {}
        units, changed = [], False
        for unit in stage.units:
            if unit.kind != "layer" or unit.checkpointed:
                units.append(unit)
                continue
            if id(unit.graph) not in done:
                names = {n.name for n in unit.graph.nodes}
                gathers = {n.name for n in unit.graph.nodes if n.op == "call_module" and n.target == GATHER}
                recompute = (wanted & names) | gathers
                replay, held, replayed = replay_program(unit.graph, recompute)
                marked = clone_graph(unit.graph)
                mark(marked)
                marked.lint()
                inputs = tuple(n.name for n in unit.graph.nodes if n.op == "placeholder")
                fractions = {k: v for k, v in offload.items() if k in names}
                policy = SavedPolicy(frozenset(recompute), fractions, held, replay if replayed else None, replayed, inputs,
                                     plain_offload=self.policy is None)
                done[id(unit.graph)] = (marked, policy)
            graph, policy = done[id(unit.graph)]
            if policy.recompute or policy.offload:
                unit = replace(unit, graph=graph, saved=policy)
                changed = True
            units.append(unit)
        return PassResult(replace(stage, units=units), changed)


__all__ = ["ActivationPolicyError", "ActivationPolicyInsertion", "check_activation_policy", "layer_node_names",
           "mark", "replay_program"]
