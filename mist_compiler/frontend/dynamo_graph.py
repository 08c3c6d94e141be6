"""Capture from the graph dynamo hands the ``torch.compile`` backend: no second trace of the model.

When a user compiles a model with ``backend="mist"`` and training options, dynamo has already traced
the whole forward into one torch-level graph that holds every layer: each node's ``nn_module_stack``
names the module that issued it, each lifted parameter's source names the tensor. :func:`capture_graph`
starts there instead of tracing a fake copy of the module again (``capture.capture``):

1. the graph is copied (dynamo keeps the original), the float attributes dynamic shapes lift to inputs
   (a norm's ``eps``) become constants again, and the loss is its only output;
2. every node is given to its layer by its module stack, and the values crossing layer edges are read
   off the graph: a layer's output is the one value its nodes hand to nodes outside it, the next layer
   reads it as its hidden state, and the first layer's hidden input is the value read at the same place
   by another layer of its group. The whole graph is then cut into regions once
   (:func:`.regions.find_regions`): the layers run back to back and nothing but its output leaves a
   layer, which capture proves on a module with an eager forward (:mod:`.layer_chain`);
3. layers are grouped by module structure as capture groups them, and the graph keeps one
   representative per group, each reading the previous representative's output, renumbered as
   capture's reduced model numbers its layers (a 48-layer graph is priced and lowered as 1 layer);
4. aot_autograd on that graph, with dynamo's fake inputs (the batch and sequence stay symbols), gives
   the joint graph; the passes every capture shares follow (:func:`.capture.passes_after_trace`).

It applies where the graph holds what a plan needs: the batch and the sequence are symbols of their own
(``torch.compile(..., dynamic=True)``, or dynamo's recompile once the batch size changed),
``input_ids`` and ``labels`` are two inputs, the parameters are in the plan's dtype with no autocast
inside the graph, and every tensor comes from the compiled module. A graph traced with static shapes
(``torch.compile``'s default) has the batch and sequence sizes written into its views while a plan runs
micro-batches of other sizes, and ``labels=input_ids`` makes one input of two: for those, dynamo traces
the call once more from inside the backend with symbolic sizes and two inputs (:func:`symbolic_graph`)
and that graph is cut. Elsewhere :class:`GraphCaptureUnsupported` says why and the caller captures the
module itself.
"""
from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import nn
from torch._guards import detect_fake_mode

from ..ir.capture_state import CaptureState
from ..ir.model_graph import PARAMETER
from ..ir.program import ATTENTION_KERNELS, IRError, MistProgram
from ..passes.block_discovery import module_paths, normalize_module_path
from .boundaries import Boundaries, LayerContractError
from .capture import _max_seq, group_layers, passes_after_trace, run_capture_passes
from .joint import graph_only_backend, joint_backend
from .regions import RegionError, batch_input_name, classify_inputs, find_regions, layer_of_nodes, source_path


class GraphCaptureUnsupported(ValueError):
    """Dynamo's graph does not hold what a plan needs (the message says what); capture the module."""


class _NeedsSymbolicTrace(GraphCaptureUnsupported):
    """The graph is the model's, but traced with static sizes or with ``labels=input_ids`` (one input):
    dynamo traces the call again with symbolic sizes and two batch inputs (:func:`symbolic_graph`)."""


class _Recorded(Exception):
    """Raised by :func:`symbolic_graph`'s backend once it holds the graph: nothing is installed or run."""


def capture_graph(gm: fx.GraphModule, example_inputs: list, model: nn.Module, *, dtype: str | None = None,
                  attention: str = "flash", seq_len: int | None = None, analyse: bool = True,
                  retrace: bool = True) -> MistProgram:
    """The captured program of ``model`` from ``gm``, the graph dynamo traced of a call of it, and the
    ``example_inputs`` it handed the backend (see the module docstring). ``dtype``: the plan's (the
    parameters' own when None); ``analyse=False``: the torch-level program only, as ``capture``.
    ``retrace``: a graph of the model traced with static sizes (``torch.compile``'s default) or with
    ``labels=input_ids`` is traced again by dynamo, the sizes symbolic (:func:`symbolic_graph`), and cut
    from that; else it is refused."""
    if attention not in ATTENTION_KERNELS:
        raise IRError(f"attention must be one of {list(ATTENTION_KERNELS)}, got {attention!r}")
    options = dict(dtype=dtype, attention=attention, seq_len=seq_len, analyse=analyse)
    try:
        return _cut_program(gm, example_inputs, model, **options)
    except _NeedsSymbolicTrace:
        if not retrace:
            raise
        batch = _batch_tensors(gm, example_inputs)
        ids = batch["input_ids"]
        labels = batch.get("labels")
        return symbolic_graph(model, ids, ids.clone() if labels is None else labels,
                              lambda graph, inputs: _cut_program(graph, inputs, model, **options))


def _batch_tensors(gm: fx.GraphModule, example_inputs: list) -> dict[str, torch.Tensor]:
    """The call's ``input_ids`` and ``labels`` among the inputs dynamo handed the backend."""
    found = {}
    for node, value in zip((n for n in gm.graph.nodes if n.op == "placeholder"), example_inputs):
        name = batch_input_name(getattr(node, "_dynamo_source", None))
        if name is not None and isinstance(value, torch.Tensor):
            found.setdefault(name, value)
    if "input_ids" not in found:
        raise GraphCaptureUnsupported("the graph has no input_ids input")
    return found


def _call_model(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, extra: dict):
    return model(input_ids=input_ids, labels=labels, **extra)


def symbolic_graph(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                   on_graph: Callable[[fx.GraphModule, list], Any]) -> Any:
    """``on_graph(gm, example_inputs)`` for the graph dynamo hands a backend of the call
    ``model(input_ids=, labels=)`` traced with ``dynamic=True`` (the batch and sequence symbols,
    ``input_ids`` and ``labels`` two inputs, the parameters the module's own), and its result.

    Called from inside a backend: dynamo traces a frame of its own there, and ``on_graph`` runs inside
    that trace's context (aot_autograd finds its shape environment, not the outer trace's). The
    recording backend then raises, so nothing runs and no compiled code is left behind. Module float
    attributes stay constants and logging calls are dropped, as capture traces."""
    from .joint import _logging_functions, model_call_kwargs

    got: list = []

    def record(graph_module, inputs, **_):
        try:
            got.append(("value", on_graph(graph_module, list(inputs))))
        except GraphCaptureUnsupported as why:
            got.append(("refused", why))
        raise _Recorded

    compiled = torch.compile(_call_model, backend=record, fullgraph=True, dynamic=True)
    try:
        with torch._dynamo.config.patch(specialize_float=True, ignore_logging_functions=_logging_functions()):
            compiled(model, input_ids, labels, model_call_kwargs(model))
    except Exception as error:  # dynamo wraps what the backend raised
        if not got:
            first = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise GraphCaptureUnsupported(f"dynamo could not trace the call again with symbolic sizes: {first}") from None
    finally:
        torch._dynamo.reset_code(_call_model.__code__)
    kind, value = got[-1]
    if kind == "refused":
        raise value
    return value


def _cut_program(gm: fx.GraphModule, example_inputs: list, model: nn.Module, *, dtype: str | None, attention: str,
                 seq_len: int | None, analyse: bool) -> MistProgram:
    graph, root, folded = _training_graph(gm, example_inputs, model)
    tensors, batch, sizes = classify_inputs(graph, root[0], tuple(root[1]), error=GraphCaptureUnsupported)
    param_dtype = _check_inputs(graph, tensors, batch, dtype)
    state = group_layers(CaptureState(model, type(model).__name__, attention, param_dtype, seq_len, model=model,
                                      analyse=analyse))
    if state.layer_list is None or not state.layer_list:
        raise GraphCaptureUnsupported("the model has no layer list (an nn.ModuleList of its layers)")
    _own_copies_of_shared_sizes(graph, state.layer_list)
    try:
        boundaries = _layer_edges(graph, state.layer_list, state.layer_groups)
        find_regions(graph, boundaries, state.layer_list, tuple((i,) for i in range(len(boundaries.inputs))),
                     inputs=(tensors, batch, sizes))  # the whole model: layers back to back, only outputs leave
    except (RegionError, LayerContractError) as error:  # capture's own checks name the layer and the line
        raise GraphCaptureUnsupported(f"the layers' edges in the graph: {error}") from None
    reduced, edges, tensors = _one_layer_per_group(graph, boundaries, state.layer_list, state.layer_groups, tensors)
    fake_inputs = [n.meta["example_value"] for n in reduced.graph.nodes if n.op == "placeholder"]
    captured: list = []
    backend = joint_backend(captured.append) if analyse else graph_only_backend(captured.append)
    with _specialised_floats(folded):
        backend(reduced, fake_inputs)
    if not captured:
        raise GraphCaptureUnsupported("aot_autograd produced no joint graph (does the model have parameters?)")
    joint = replace(captured[-1], boundaries=edges, input_kinds=(tensors, batch, sizes))
    cfg = getattr(model, "config", None)
    config = cfg.to_dict() if hasattr(cfg, "to_dict") else None
    max_positions = _max_seq(config)
    state = replace(state, fake_mode=detect_fake_mode(fake_inputs), config=config, joint=joint,
                    seq_len=seq_len or max_positions or 2048, max_positions=max_positions)
    return run_capture_passes(state, passes_after_trace())


@contextlib.contextmanager
def _specialised_floats(shape_envs: set):
    """While aot_autograd runs on dynamo's shape environment, its float symbols with a value (the ones
    this graph made constants) count as specialised: otherwise its scalar pass finds them unused and has
    dynamo trace the whole frame again (``TensorifyScalarRestartAnalysis``) with every float a constant,
    to the same end."""
    import sympy
    from torch._dynamo.symbolic_convert import TensorifyState
    from torch.utils._sympy.symbol import SymT, symbol_is_type

    names = {str(symbol) for env in shape_envs for symbol, value in env.backed_var_to_val.items()
             if symbol_is_type(symbol, SymT.FLOAT) and isinstance(value, sympy.Float)}
    added = names - TensorifyState.force_specializations
    for name in added:
        TensorifyState.specialize(name)
    try:
        yield
    finally:
        TensorifyState.force_specializations.difference_update(added)


def _training_graph(gm: fx.GraphModule, example_inputs: list,
                    model: nn.Module) -> tuple[fx.GraphModule, tuple[str, list[str]], set]:
    """A copy of ``gm`` returning only the loss, its lifted float attributes constants again and its
    module stacks relative to ``model``; and where the compiled frame holds ``model``: a local and a
    path in it (``("self", [])`` when the module itself is compiled, ``("args", ["0"])`` through a
    wrapper of its forward); and the shape environments of the float symbols made constants."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    root = None
    for node, value in zip(placeholders, example_inputs):
        if isinstance(value, nn.Parameter):
            local, path, _ = source_path(getattr(node, "_dynamo_source", None))
            found = next(((local, path[:k]) for k in range(len(path)) if _parameter(model, path[k:]) is value), None)
            if found is None or root not in (None, found):
                raise GraphCaptureUnsupported(f"graph input {node.name} is not a parameter of the compiled module "
                                              "read through one place of the compiled frame")
            root = found
    if root is None:
        raise GraphCaptureUnsupported("the graph reads no parameter")
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    loss = next((n for n in outputs if isinstance(n, fx.Node) and _is_loss(n)), None)
    if loss is None:
        raise GraphCaptureUnsupported("the graph returns no scalar loss")
    graph = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    graph.graph_copy(gm.graph, copies)
    prefix = ".".join(root[1])
    for old, new in copies.items():
        if old.op == "placeholder":
            new._dynamo_source = getattr(old, "_dynamo_source", None)  # not copied by graph_copy
        if new.meta.get("nn_module_stack"):
            new.meta["nn_module_stack"] = _renumbered(new.meta["nn_module_stack"], prefix)
    graph.output((copies[loss],))
    folded: set = set()
    for node, value in zip(placeholders, example_inputs):
        _constant_float(graph, copies[node], value, folded)
    _skip_empty_concatenations(graph)
    graph.eliminate_dead_code()  # what only other outputs (logits, a key/value cache) needed
    return fx.GraphModule(gm, graph), root, folded


def _skip_empty_concatenations(graph: fx.Graph) -> None:
    """``torch.cat`` skips 1-D empty operands (a key/value cache's first update when the call did not
    pass ``use_cache=False``, which capture passes): drop them, and a cat left with one operand."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.cat or not isinstance(node.args[0], (list, tuple)):
            continue
        kept = [a for a in node.args[0] if not _empty_vector(a)]
        if len(kept) == len(node.args[0]) or not kept:
            continue
        if len(kept) == 1:
            node.replace_all_uses_with(kept[0])
            graph.erase_node(node)
        else:
            node.args = (kept, *node.args[1:])


def _empty_vector(arg) -> bool:
    value = arg.meta.get("example_value") if isinstance(arg, fx.Node) else None
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape[0] == 0


def _parameter(model: nn.Module, path: list[str]) -> torch.Tensor | None:
    try:
        return model.get_parameter(".".join(path))
    except AttributeError:
        return None


def _is_loss(node: fx.Node) -> bool:
    value = node.meta.get("example_value")
    return isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point()


def _constant_float(graph: fx.Graph, node: fx.Node, value, folded: set) -> None:
    """A Python float that dynamo lifted to a 0-d input read with ``.item()`` (a module's ``eps``, a
    global such as ``math.pi``): the number itself again, as capture's trace has it (``specialize_float``);
    the shape environment its float symbol lives in is added to ``folded``."""
    _, _, kind = source_path(getattr(node, "_dynamo_source", None))
    if not (isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and value.dim() == 0
            and value.is_floating_point() and kind is None and node.users
            and all(user.op == "call_method" and user.target == "item" for user in node.users)):
        return
    number = float(value)
    for item in list(node.users):
        symbol = item.meta.get("example_value")
        if isinstance(symbol, torch.SymFloat):
            folded.add(symbol.node.shape_env)
        for user in list(item.users):
            user.args = fx.node.map_arg(user.args, lambda a: number if a is item else a)
            user.kwargs = fx.node.map_arg(user.kwargs, lambda a: number if a is item else a)
        graph.erase_node(item)
    graph.erase_node(node)


def _check_inputs(graph: fx.GraphModule, tensors: dict, batch: dict, dtype: str | None) -> str:
    """The parameters' dtype, after refusing a graph a plan cannot be cut from (see the module docstring)."""
    if sorted(batch.values()) == ["input_ids"]:
        raise _NeedsSymbolicTrace("the graph's batch inputs are ['input_ids'], not input_ids and labels as two "
                                  "tensors (labels=input_ids)")
    if sorted(batch.values()) != ["input_ids", "labels"]:
        raise GraphCaptureUnsupported(f"the graph's batch inputs are {sorted(batch.values())}, not input_ids and "
                                      "labels as two tensors")
    nodes = {n.name: n for n in graph.graph.nodes}
    symbols = []
    for name in batch:
        shape = nodes[name].meta["example_value"].shape
        if len(shape) != 2 or not all(isinstance(d, torch.SymInt) and d.node.expr.is_Symbol for d in shape):
            raise _NeedsSymbolicTrace("the graph was traced with static batch and sequence sizes "
                                          "(torch.compile(..., dynamic=True) makes them symbols)")
        symbols.append(tuple(d.node.expr for d in shape))
    if len(set(symbols)) != 1 or symbols[0][0] == symbols[0][1]:
        raise GraphCaptureUnsupported("the batch and the sequence are not two symbols shared by input_ids and labels")
    if any(n.op == "call_function" and getattr(n.target, "__name__", "") == "_enter_autocast" for n in graph.graph.nodes):
        raise GraphCaptureUnsupported("the graph holds an autocast region (the plan casts the weights instead)")
    dtypes = {nodes[name].meta["example_value"].dtype for name, (kind, _) in tensors.items()
              if kind == PARAMETER and nodes[name].meta["example_value"].is_floating_point()}
    if len(dtypes) != 1:
        raise GraphCaptureUnsupported(f"the parameters are not of one floating dtype ({sorted(map(str, dtypes))})")
    own = str(dtypes.pop()).replace("torch.", "")
    if dtype is not None and str(dtype).replace("torch.", "") != own:
        raise GraphCaptureUnsupported(f"the plan's dtype {dtype} is not the parameters' {own}")
    return own


def _own_copies_of_shared_sizes(graph: fx.GraphModule, layer_list: str) -> None:
    """Dynamo computes a size expression once (GPT-2's ``sqrt(head_dim)``) and every later layer reads
    it from the first: each layer gets its own copy, computed where it first reads it, as a trace of
    that layer alone (capture's) has it."""
    body = [n for n in graph.graph.nodes if n.op not in ("placeholder", "output")]
    layer_of = layer_of_nodes(body, layer_list)
    for node in body:
        home = layer_of[node.name]
        if home is None or isinstance(node.meta.get("example_value"), torch.Tensor):
            continue
        readers: dict[int, list[fx.Node]] = {}
        for user in node.users:
            if layer_of.get(user.name) not in (None, home):
                readers.setdefault(layer_of[user.name], []).append(user)
        for layer, users in readers.items():
            anchor = min(users, key=body.index)
            memo: dict[fx.Node, fx.Node] = {}
            with graph.graph.inserting_before(anchor):
                copy = _copy_size(graph.graph, node, home, layer_of, memo, anchor.meta.get("nn_module_stack"))
            for user in users:
                user.replace_input_with(node, copy)
            for new in memo.values():
                layer_of[new.name] = layer
    graph.recompile()


def _copy_size(graph: fx.Graph, node: fx.Node, home: int, layer_of: dict, memo: dict, stack) -> fx.Node:
    """``node`` and the size expressions of its layer it is computed from, copied where the graph inserts."""
    if node in memo:
        return memo[node]

    def arg(a: fx.Node) -> fx.Node:
        shared = layer_of.get(a.name) == home and not isinstance(a.meta.get("example_value"), torch.Tensor)
        return _copy_size(graph, a, home, layer_of, memo, stack) if shared else a

    memo[node] = copied = graph.node_copy(node, arg)
    if stack is not None:
        copied.meta["nn_module_stack"] = dict(stack)
    return copied


def _layer_edges(graph: fx.GraphModule, layer_list: str, groups: tuple) -> Boundaries:
    """Per layer of the whole graph, the value entering it and the one leaving it (as the boundary
    markers of capture's trace record them), read off the graph."""
    body = [n for n in graph.graph.nodes if n.op not in ("placeholder", "output")]
    layer_of = layer_of_nodes(body, layer_list)
    count = sum(len(group) for group in groups)
    members = {i: [n for n in body if layer_of[n.name] == i] for i in range(count)}
    empty = [i for i, nodes in members.items() if not nodes]
    if empty:
        raise GraphCaptureUnsupported(f"layers {empty[:3]} of {layer_list} run no code in the graph")
    edges = Boundaries()
    leaving: dict[int, fx.Node] = {}
    for i, nodes in members.items():
        names = {n.name for n in nodes}
        out = [n for n in nodes if any(u.name not in names for u in n.users)]
        if len(out) != 1:
            raise RegionError(f"layer {layer_list}.{i}: {len(out)} of its values are used outside it "
                              f"({[n.name for n in out][:3]}); a pipeline stage can only pass on the layer's output")
        leaving[i] = out[0]
        edges.outputs[i] = out[0].name
    for i in range(1, count):
        users = {u.name for u in leaving[i - 1].users if layer_of.get(u.name) == i}
        if not users:
            raise RegionError(f"capture: {layer_list}.{i} is not called on the output of {layer_list}.{i - 1}; "
                              "a pipeline needs each layer called on the previous layer's output")
        edges.inputs[i], edges.input_users[i] = leaving[i - 1].name, users
    edges.inputs[0], edges.input_users[0] = _first_layer_input(members, leaving, layer_of, groups)
    return edges


def _first_layer_input(members: dict, leaving: dict, layer_of: dict, groups: tuple) -> tuple[str, set[str]]:
    """The hidden state entering layer 0: the value its nodes read where a layer of its group reads the
    output of the layer before it; with no such twin, the one outside value of the output's shape."""
    first = members[0]
    twin = next((j for group in groups if 0 in group for j in group if j != 0), None)
    if twin is not None and len(members[twin]) == len(first) and all(
            a.op == b.op and a.target == b.target for a, b in zip(first, members[twin])):
        hidden = leaving[twin - 1]
        places = [(k, i) for k, node in enumerate(members[twin]) for i, arg in enumerate(node.all_input_nodes)
                  if arg is hidden]
        values = {first[k].all_input_nodes[i] for k, i in places}
        if len(values) == 1 and layer_of.get(next(iter(values)).name) is None:
            return next(iter(values)).name, {first[k].name for k, _ in places}
    shape = leaving[0].meta.get("example_value")
    names = {n.name for n in first}
    outside = {arg for node in first for arg in node.all_input_nodes if arg.name not in names
               and arg.op != "placeholder" and _same_kind(arg.meta.get("example_value"), shape)}
    if len(outside) != 1:
        raise GraphCaptureUnsupported("the hidden state entering the first layer cannot be told from the "
                                      f"other values it reads ({sorted(a.name for a in outside)[:3]})")
    value = outside.pop()
    return value.name, {n.name for n in first if value in n.all_input_nodes}


def _same_kind(value, reference) -> bool:
    return isinstance(value, torch.Tensor) and isinstance(reference, torch.Tensor) and \
        value.dtype == reference.dtype and tuple(map(str, value.shape)) == tuple(map(str, reference.shape))


def _one_layer_per_group(graph: fx.GraphModule, edges: Boundaries, layer_list: str, groups: tuple,
                         tensors: dict) -> tuple[fx.GraphModule, Boundaries, dict]:
    """``graph`` (changed in place) holding one layer per group, renumbered ``0..len(groups)-1`` as
    capture's reduced model: its regions' boundaries and its tensors named by those numbers."""
    keep = [group[0] for group in groups]
    traced_of = {real: traced for traced, real in enumerate(keep)}
    nodes = {n.name: n for n in graph.graph.nodes}
    body = [n for n in graph.graph.nodes if n.op not in ("placeholder", "output")]
    layer_of = layer_of_nodes(body, layer_list)
    for traced in range(1, len(keep)):  # a kept layer reads the previous kept layer's output
        real, before = keep[traced], keep[traced - 1]
        if real != before + 1:
            for name in edges.input_users[real]:
                nodes[name].replace_input_with(nodes[edges.inputs[real]], nodes[edges.outputs[before]])
    last = max(edges.outputs)
    if keep[-1] != last:  # the code after the layers reads the last kept layer's output
        for user in list(nodes[edges.outputs[last]].users):
            if layer_of.get(user.name) is None:
                user.replace_input_with(nodes[edges.outputs[last]], nodes[edges.outputs[keep[-1]]])
    for node in reversed(body):
        if layer_of[node.name] is not None and layer_of[node.name] not in traced_of:
            if node.users:
                raise GraphCaptureUnsupported(f"{node.name} of {layer_list}.{layer_of[node.name]} is read by "
                                              f"{[u.name for u in node.users][:3]}")
            graph.graph.erase_node(node)
    renamed = {}
    for node in list(graph.graph.nodes):
        real = _layer_index(node, layer_list, tensors)
        if node.op == "placeholder" and real is not None and real not in traced_of and not node.users:
            graph.graph.erase_node(node)  # the weights of the layers no longer in the graph
            tensors.pop(node.name, None)
            continue
        if real in traced_of:
            node.meta["nn_module_stack"] = _renumbered(node.meta.get("nn_module_stack") or {}, "",
                                                       (f"{layer_list}.{real}", f"{layer_list}.{traced_of[real]}"))
        if node.name in tensors:
            kind, path = tensors[node.name]
            index = _index_in(path, layer_list)
            if index is not None and index in traced_of:
                path = f"{layer_list}.{traced_of[index]}{path[len(f'{layer_list}.{index}'):]}"
            renamed[node.name] = (kind, path)
    graph.graph.lint()
    graph.recompile()
    reduced = Boundaries(
        inputs={t: edges.inputs[0] if t == 0 else edges.outputs[keep[t - 1]] for t in range(len(keep))},
        outputs={t: edges.outputs[real] for t, real in enumerate(keep)},
        input_users={t: set(edges.input_users[real]) for t, real in enumerate(keep)})
    return graph, reduced, renamed


def _index_in(path: str, layer_list: str) -> int | None:
    head = f"{layer_list}."
    if path.startswith(head):
        first = path[len(head):].split(".")[0]
        return int(first) if first.isdigit() else None
    return None


def _layer_index(node: fx.Node, layer_list: str, tensors: dict) -> int | None:
    for path in module_paths(node):
        index = _index_in(path, layer_list)
        if index is not None:
            return index
    return _index_in(tensors[node.name][1], layer_list) if node.name in tensors else None


def _renumbered(stack: dict, prefix: str, rename: tuple[str, str] | None = None) -> dict:
    """A module stack with paths relative to the model (``prefix``, where the frame holds it, cut
    off) as capture's trace has them (``L['model'].path``); ``rename``: a layer's path called by
    another (its number in the reduced graph)."""
    result = {}
    for key, value in stack.items():
        raw, kind = (value[0], value[1]) if isinstance(value, (tuple, list)) else (value, None)
        path = normalize_module_path(str(raw))
        if prefix and (path == prefix or path.startswith(prefix + ".")):
            path = path[len(prefix):].lstrip(".")
        if rename is not None and (path == rename[0] or path.startswith(rename[0] + ".")):
            path = rename[1] + path[len(rename[0]):]
        result[key] = (f"L['model'].{path}" if path else "L['model']", kind)
    return result


__all__ = ["GraphCaptureUnsupported", "capture_graph"]
