"""Pipeline partitioning: the captured torch-level program -> one stage's program.

Input: the :class:`~mist_compiler.ir.model_graph.ModelGraph` capture produced (the graph the cost
model priced, cut into pre / layer / post regions), a plan and a stage index (an entry of the
plan's ``stages``: a virtual stage when stages share devices). Output: a
:class:`~mist_compiler.ir.stage.StageGraph`:

- every node of the pre and post regions that depends on the batch alone (positions, masks,
  rotary tables, shifted labels: *free* values) is recomputed, in the top-level graph, by every
  stage that needs it, never sent;
- the rest of the pre region is the ``pre`` unit (first stage), the rest of the post region the
  ``post`` unit (last stage); layer ``k`` is a unit running its group representative's region
  with layer ``k``'s own tensors (the region graph is built once per group and shared);
- the hidden state crosses every cut; a pre value that later layers read (anything but a free
  value) crosses every cut up to the last stage that reads it.
Dynamo's batch and sequence size inputs become ``input_ids.size(d)``.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from ..ir.model_graph import BUFFER, CONSTANT, LAYER_CONSTANT, PARAMETER, LayerRegion, ModelGraph
from ..ir.plan import Plan
from ..ir.stage import BoundaryValue, StageGraph, StageInterface, Unit
from .block_discovery import module_paths
from .manager import PassResult

HIDDEN = "hidden"  # name of the carried hidden state in stage interfaces
_GRAD_MODE = {torch._C._set_grad_enabled}
_DROPPED = {torch._C._log_api_usage_once}


class PartitionError(ValueError):
    """A model or plan that cannot be cut into pipeline stages; the message says why."""


def _is_side_effect(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _GRAD_MODE


def free_values(graph: ModelGraph) -> set[str]:
    """Names of the pre/post nodes computed from the batch alone (no parameter, no hidden state)."""
    free: set[str] = set()
    layer_nodes = {name for region in graph.regions for name in region.nodes}
    for node in graph.graph.graph.nodes:
        if node.op == "placeholder":
            kind = graph.tensors.get(node.name, ("input", ""))[0]
            if kind != PARAMETER:
                free.add(node.name)
        elif node.op == "get_attr":
            free.add(node.name)
        elif node.op in ("call_function", "call_method") and node.name not in layer_nodes \
                and not _is_side_effect(node) and node.target not in _DROPPED:
            if all(arg.name in free for arg in node.all_input_nodes):
                free.add(node.name)
    return free


def _external_inputs(nodes: list[fx.Node], inside: set[str]) -> list[fx.Node]:
    found: list[fx.Node] = []
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg.name not in inside and arg not in found:
                found.append(arg)
    return found


def _copy_into(graph: fx.Graph, nodes: list[fx.Node], env: dict[str, fx.Node],
               tensors: dict[str, tuple[str, str]]) -> None:
    for node in nodes:
        if node.op == "get_attr":  # a constant or sub-program read inside the unit: one of its attributes
            tensors[node.target] = (CONSTANT, node.target)
        env[node.name] = graph.node_copy(node, lambda arg: env[arg.name])


@dataclass
class _UnitGraph:
    graph: fx.Graph
    inputs: list[str]  # source node names passed as arguments, in order
    outputs: list[str]  # source node names returned (a tuple when more than one)
    tensors: dict[str, tuple[str, str]]


def _unit_graph(model: ModelGraph, nodes: list[fx.Node], outputs: list[str], tensor_name) -> _UnitGraph:
    """A standalone graph running ``nodes``: outside values become arguments, tensors attributes."""
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    inside = {n.name for n in nodes}
    inputs, tensors = [], {}
    for arg in _external_inputs(nodes, inside):
        if arg.op == "placeholder" and arg.name in model.tensors:
            kind, name = model.tensors[arg.name]
            attr = tensor_name(arg.name, name)
            if attr is not None:
                tensors[attr] = (kind, name)
                env[arg.name] = graph.get_attr(attr)
                env[arg.name].meta.update(arg.meta)
                continue
        if arg.op == "get_attr":
            tensors[arg.target] = (CONSTANT, arg.target)
            env[arg.name] = graph.get_attr(arg.target)
            env[arg.name].meta.update(arg.meta)
            continue
        placeholder = graph.placeholder(arg.name)
        placeholder.meta.update(arg.meta)
        env[arg.name] = placeholder
        inputs.append(arg.name)
    _copy_into(graph, nodes, env, tensors)
    result = [env[name] for name in outputs]
    graph.output(result[0] if len(result) == 1 else tuple(result))
    return _UnitGraph(graph, inputs, outputs, tensors)


def layer_graph(model: ModelGraph, region: LayerRegion) -> _UnitGraph:
    """The program of one layer group: ``(hidden, *glue) -> hidden`` with the layer's tensors as
    attributes named by their path inside the layer. Nodes that read the layer's input *as its
    hidden state* read the first argument; a read of the same value as anything else (a model
    that passes its embedding to every layer) is glue."""
    by_name = model._by_name()
    graph = fx.Graph()
    hidden = graph.placeholder(f"{region.carried_in}_in")
    hidden.meta.update(by_name[region.carried_in].meta)
    glue = {}
    for name in region.glue:
        glue[name] = graph.placeholder(f"{name}_glue" if name == region.carried_in else f"{name}_in")
        glue[name].meta.update(by_name[name].meta)
    env: dict[str, fx.Node] = {}
    tensors: dict[str, tuple[str, str]] = {}
    attributes: dict[str, fx.Node] = {}

    def attribute(target: str, source: fx.Node, kind: str, name: str) -> fx.Node:
        if target not in attributes:
            attributes[target] = graph.get_attr(target)
            attributes[target].meta.update(source.meta)
            tensors[target] = (kind, name)
        return attributes[target]

    def argument(reader: fx.Node, arg: fx.Node) -> fx.Node:
        if arg.name in env:
            return env[arg.name]
        if arg.name == region.carried_in and reader.name in region.hidden_users:
            return hidden
        if arg.name in glue:
            return glue[arg.name]
        if arg.name in region.params:
            return attribute(region.params[arg.name], arg, model.tensors[arg.name][0], region.params[arg.name])
        if arg.op == "get_attr":
            return attribute(arg.target, arg, CONSTANT, arg.target)
        raise PartitionError(f"layer {model.layer_list}.{region.layers[0]} reads {arg.name}, which is neither its "
                             "hidden state, a value shared by all layers, nor one of its own tensors")

    for name in region.nodes:
        node = by_name[name]
        if node.op == "get_attr":  # a sub-program the layer calls (an autograd.Function's bodies)
            env[name] = attribute(node.target, node, CONSTANT, node.target)
            continue
        env[name] = graph.node_copy(node, lambda arg, node=node: argument(node, arg))
    graph.output(env.get(region.carried_out, hidden))
    return _UnitGraph(graph, [region.carried_in, *region.glue], [region.carried_out], tensors)


def _symbol_values(model: ModelGraph, micro_batch: int, seq_len: int) -> tuple[dict, sympy.Symbol | None]:
    values, batch_symbol = {}, None
    for placeholder, (_, dim) in model.sizes.items():
        value = model.node(placeholder).meta.get("example_value")
        if isinstance(value, torch.SymInt):
            symbol = value.node.expr
            values[symbol] = micro_batch if dim == 0 else seq_len
            if dim == 0:
                batch_symbol = symbol
    return values, batch_symbol


def boundary_value(model: ModelGraph, source: str, name: str, micro_batch: int, seq_len: int) -> BoundaryValue:
    """The :class:`BoundaryValue` of a graph value sent between stages (shape from the trace)."""
    value = model.node(source).meta.get("example_value")
    if not isinstance(value, torch.Tensor):
        raise PartitionError(f"value {source} crosses a pipeline cut but is a {type(value).__name__}, not a tensor")
    values, batch_symbol = _symbol_values(model, micro_batch, seq_len)
    dims = [d.node.expr if isinstance(d, torch.SymInt) else sympy.Integer(int(d)) for d in value.shape]
    batched = bool(dims) and batch_symbol is not None and dims[0] == batch_symbol
    rest = dims[1:] if batched else dims
    if batch_symbol is not None and any(batch_symbol in d.free_symbols for d in rest):
        raise PartitionError(f"value {source} has its batch dimension elsewhere than dim 0 "
                             f"({tuple(value.shape)}); it cannot be sent between stages")
    sample = tuple(int(d.subs(values)) for d in rest)
    return BoundaryValue(name, sample, value.dtype, batched)


def _deepest_module(node: fx.Node) -> str:
    paths = module_paths(node)
    return paths[-1] if paths else ""


def module_units(model: ModelGraph, nodes: list[fx.Node]) -> list[tuple[str | None, list[fx.Node]]]:
    """Split the pre or post part into units the way the runtime shards and hooks them: the nodes
    of each module that reads parameters form one unit, named by the module's path (so a unit's
    parameters keep their names); other nodes (a residual add, the loss) stay in the stage's
    top-level graph (``None``). Returned in graph order, consecutive nodes of one owner merged."""
    params = {p for p, (kind, _) in model.tensors.items() if kind == PARAMETER}
    reading = {_deepest_module(n) for n in nodes if any(a.name in params for a in n.all_input_nodes)}
    runs: list[tuple[str | None, list[fx.Node]]] = []
    for node in nodes:
        owner = next((path for path in reversed(module_paths(node) or [""]) if path in reading), None)
        if owner is None and "" in reading and any(a.name in params for a in node.all_input_nodes):
            owner = ""
        if runs and runs[-1][0] == owner:
            runs[-1][1].append(node)
        else:
            runs.append((owner, [node]))
    return runs


def _unit_name(owner: str, kind: str) -> str:
    return owner or kind  # parameters read at the model's top level: the "pre" / "post" unit


def _relative(name: str, unit: str) -> str:
    return name[len(unit) + 1:] if unit and name.startswith(unit + ".") else name


@dataclass
class Partition:
    """The partition pass for one stage of a plan: ``ModelGraph -> StageGraph``."""

    plan: Plan
    stage: int
    name: str = "partition"
    input_type = ModelGraph
    output_type = StageGraph

    def __call__(self, model: ModelGraph) -> PassResult:
        if model.num_layers != self.plan.num_layers:
            raise PartitionError(f"the plan covers {self.plan.num_layers} layers but the model has {model.num_layers}")
        return PassResult(_build_stage(model, self.plan, self.stage), True)


def _stage_of_pre_outputs(model: ModelGraph, plan: Plan, pre_unit_nodes: set[str]) -> dict[str, int]:
    """For every pre-unit value read outside the pre unit: the last stage that reads it."""
    last_stage = {}
    by_name = model._by_name()
    stage_of_layer = {k: i for i, s in enumerate(plan.stages) for k in range(*s.layers)}
    post_stage = len(plan.stages) - 1
    for name in pre_unit_nodes:
        for user in by_name[name].users:
            if user.name in pre_unit_nodes:
                continue
            readers = [post_stage] if user.name in model.post else []
            for region in model.regions:
                if user.name not in region.nodes:
                    continue
                if name in region.glue:  # every layer of the group reads it
                    readers += [stage_of_layer[k] for k in region.layers]
                if name == region.carried_in and user.name in region.hidden_users and 0 in region.layers:
                    readers.append(stage_of_layer[0])  # the first layer's hidden state
            last_stage[name] = max([last_stage.get(name, 0), *readers])
    return last_stage


def _build_stage(model: ModelGraph, plan: Plan, index: int) -> StageGraph:
    stage = plan.stages[index]
    first, last = index == 0, index == len(plan.stages) - 1  # virtual stages: the plan's entries
    by_name = model._by_name()
    free = free_values(model)
    pre_nodes = [by_name[n] for n in model.pre if n not in free and not _is_side_effect(by_name[n])
                 and by_name[n].target not in _DROPPED]
    post_nodes = [by_name[n] for n in model.post if n not in free and not _is_side_effect(by_name[n])
                  and by_name[n].target not in _DROPPED]
    pre_names = {n.name for n in pre_nodes}
    crossing = _stage_of_pre_outputs(model, plan, pre_names)  # pre value -> last stage reading it
    first_region = model.region_of_layer(0)
    hidden_source = first_region.carried_in

    order = list(by_name)
    later = lambda at: sorted((n for n, s in crossing.items() if s >= at), key=order.index)
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    inputs: list[BoundaryValue] = []
    micro, seq = stage.micro_batch, plan.seq_len
    hidden = None
    if not first:  # the hidden state, then the pre values this or a later stage reads
        previous_out = model.region_of_layer(stage.layers[0] - 1).carried_out
        hidden = graph.placeholder(HIDDEN)
        inputs.append(boundary_value(model, previous_out, HIDDEN, micro, seq))
        for name in later(index):
            env[name] = graph.placeholder(name)
            inputs.append(boundary_value(model, name, name, micro, seq))
    units: list[Unit] = []
    needed = _needed_free_values(model, plan, index, free, pre_nodes, post_nodes)
    batch_inputs = _emit_free_values(model, graph, env, needed, free)
    if first:
        _emit_part(model, graph, env, units, pre_nodes, "pre", keep={hidden_source, *later(0)})
        hidden = env[hidden_source]
    layer_graphs: dict[int, _UnitGraph] = {}
    for layer in range(*stage.layers):
        region = model.region_of_layer(layer)
        if region.traced not in layer_graphs:
            layer_graphs[region.traced] = layer_graph(model, region)
        unit = layer_graphs[region.traced]
        target = f"{model.layer_list}.{layer}" if model.layer_list else str(layer)
        tensors = {attr: (kind, model.layer_fqn(layer, attr)) for attr, (kind, _) in unit.tensors.items()
                   if kind in (PARAMETER, BUFFER)}
        tensors.update({attr: t for attr, t in unit.tensors.items() if t[0] == CONSTANT})
        units.append(Unit(target, "layer", unit.graph, tensors, region.label, layer))
        glue = (graph.get_attr(LAYER_CONSTANT.format(layer)) if name == model.layer_index else env[name]
                for name in region.glue)  # the layer's own index where its dropout sites read it
        hidden = graph.call_module(target, (hidden, *glue))
    outputs_sent: list[BoundaryValue] = []
    if last:
        env[model.regions[-1].carried_out] = hidden  # what the post part read in the trace
        final = next(n for n in model.graph.graph.nodes if n.op == "output").args[0]
        final = final[0] if isinstance(final, (tuple, list)) else final
        missing = [a.name for a in _external_inputs(post_nodes, {n.name for n in post_nodes})
                   if a.name not in env and a.name not in model.tensors and a.op != "get_attr"]
        if missing:
            raise PartitionError(f"the last stage needs {missing} but no earlier part of the model provides them")
        _emit_part(model, graph, env, units, post_nodes, "post", keep={final.name})
        graph.output(env[final.name])
    else:
        forwarded = later(index + 1)
        sent = [hidden] + [env[n] for n in forwarded]
        last_layer = model.region_of_layer(stage.layers[1] - 1).carried_out
        outputs_sent.append(boundary_value(model, last_layer, HIDDEN, micro, seq))
        outputs_sent += [boundary_value(model, n, n, micro, seq) for n in forwarded]
        graph.output(tuple(sent))
    graph.lint()
    interface = StageInterface(index, len(plan.stages), inputs, batch_inputs, outputs_sent,
                               [u.name for u in units if u.kind == "layer"])
    return StageGraph(index, len(plan.stages), graph, interface, units, _top_level_tensors(graph, model),
                      plan_dtype=plan.dtype)


def _emit_part(model: ModelGraph, graph: fx.Graph, env: dict[str, fx.Node], units: list[Unit], nodes: list[fx.Node],
               kind: str, keep: set[str]) -> None:
    """Emit the pre or post part into the stage graph: a call per parameter-reading module (a unit),
    the other nodes copied as they are. ``keep``: values read after this part (its results)."""
    runs = module_units(model, nodes)
    run_of = {n.name: index for index, (_, run) in enumerate(runs) for n in run}
    for index, (owner, run) in enumerate(runs):
        if owner is None:
            for node in run:
                env[node.name] = graph.node_copy(node, lambda arg: env[arg.name] if arg.name in env
                                                 else _tensor_attribute(model, graph, arg))
            continue
        name = _unit_name(owner, kind)
        outputs = [n.name for n in run if n.name in keep or any(run_of.get(u.name) != index for u in n.users)]
        unit = _unit_graph(model, run, outputs, lambda placeholder, fqn, name=name: _relative(fqn, name))
        units.append(Unit(name, kind, unit.graph, unit.tensors, kind))
        call = graph.call_module(name, tuple(env[source] for source in unit.inputs))
        for position, output in enumerate(outputs):
            env[output] = call if len(outputs) == 1 else graph.call_function(operator.getitem, (call, position))


def _tensor_attribute(model: ModelGraph, graph: fx.Graph, node: fx.Node) -> fx.Node:
    """A buffer or constant read by top-level code: an attribute of the stage module."""
    if node.op == "get_attr":
        return graph.get_attr(node.target)
    kind, name = model.tensors[node.name]
    if kind == PARAMETER:
        raise PartitionError(f"{node.name}: a parameter read outside any module cannot be sharded or offloaded")
    return graph.get_attr(name)


def _needed_free_values(model: ModelGraph, plan: Plan, index: int, free: set[str], pre_nodes, post_nodes) -> set[str]:
    """Free values this stage's units read (and, transitively, the free values they come from)."""
    stage = plan.stages[index]
    roots: list[str] = []
    if index == 0:
        roots += [a.name for a in _external_inputs(pre_nodes, {n.name for n in pre_nodes})]
    for layer in range(*stage.layers):
        roots += [name for name in model.region_of_layer(layer).glue if name != model.layer_index]
    if index == len(plan.stages) - 1:
        roots += [a.name for a in _external_inputs(post_nodes, {n.name for n in post_nodes})]
    by_name = model._by_name()
    needed: set[str] = set()
    todo = [r for r in roots if r in free]
    while todo:
        name = todo.pop()
        if name in needed:
            continue
        needed.add(name)
        todo += [a.name for a in by_name[name].all_input_nodes if a.name in free]
    return needed


def _emit_free_values(model: ModelGraph, graph: fx.Graph, env: dict[str, fx.Node], needed: set[str],
                      free: set[str]) -> list[str]:
    """Copy the needed free values into the top-level graph, in their order (grad-mode switches
    between them too); returns the batch inputs the stage reads."""
    batch_inputs = []
    batch_nodes: dict[str, fx.Node] = {}
    for node in model.graph.graph.nodes:
        if node.op == "placeholder" and node.name in model.batch_inputs and (
                node.name in needed or any(p in needed for p, (src, _) in model.sizes.items()
                                           if src == model.batch_inputs[node.name])):
            name = model.batch_inputs[node.name]
            batch_nodes[name] = env[node.name] = graph.placeholder(name, default_value=None)
            env[node.name].meta.update(node.meta)
            batch_inputs.append(name)
    for node in model.graph.graph.nodes:
        if node.name in env:
            continue
        if node.op == "placeholder" and node.name in needed:
            if node.name in model.sizes:
                source, dim = model.sizes[node.name]
                env[node.name] = graph.call_method("size", (batch_nodes[source], dim))
            else:  # a buffer read by free code: an attribute of the stage module
                env[node.name] = graph.get_attr(model.tensors[node.name][1])
            env[node.name].meta.update(node.meta)
        elif node.name in needed or (_is_side_effect(node) and needed):
            env[node.name] = graph.node_copy(node, lambda arg: env[arg.name])
    return batch_inputs


def _top_level_tensors(graph: fx.Graph, model: ModelGraph) -> dict[str, tuple[str, str]]:
    """Attributes the top-level graph reads: buffers of the model (by name) and graph constants."""
    buffers = {name for kind, name in model.tensors.values() if kind == BUFFER}
    found = {}
    for node in graph.nodes:
        if node.op == "get_attr":
            found[node.target] = (BUFFER, node.target) if node.target in buffers else (CONSTANT, node.target)
    return found


def stage_interface(stage: StageGraph) -> StageInterface:
    return stage.interface


__all__ = ["HIDDEN", "Partition", "PartitionError", "boundary_value", "free_values", "layer_graph", "stage_interface"]
