"""Split backward: a unit's backward cut into an input-gradient half and a weight-gradient half.

Zero-bubble schedules (``ir/schedule.py``) run a unit's input half (``I``: what the previous
stage waits for) when the gradient arrives and its weight half (``W``) later, in what would be a
bubble. The cut is made on the unit's joint graph, so it works the same whether the halves run
as fx graphs (eager) or compiled: a compiled region is one autograd node, so the split cannot be
made with autograd hooks inside it.

How. The unit's program with its parameters lifted to inputs (:func:`lift_parameters`, made by
the lowering) is traced forward + backward by AOTAutograd, under fake tensors, once per input
signature, and partitioned into a forward graph and a backward graph (the default partitioner:
it keeps what eager autograd keeps). :func:`split_backward_graph` cuts the backward graph by
data dependence: the input half computes the input gradients and every node they need; the
weight half computes the parameter gradients from the rest, reading the saved tensors and the
input half's values it needs, which are kept alive from ``I`` to ``W``. Each of the three graphs
goes through ``compile_graph`` (the fx graph itself by default).

At run time the three graphs are one autograd node (:class:`_SplitFunction`). Its backward runs
the input half, then the weight half at once (a whole backward), or, while the rank's
:class:`WeightGradQueue` defers, queues it under the current (chunk, micro-batch) key; the engine
runs the queued halves at the ``W`` action, each through autograd (:func:`apply_weight_gradients`)
so that gradients arrive as they always do: accumulated into ``.grad`` with the parameters'
post-accumulate hooks (the runtime's reductions) firing.
"""
from __future__ import annotations

import operator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import nn

CompileGraph = Callable[[fx.GraphModule, list], Callable]


def eager_graph(module: fx.GraphModule, example_inputs: list) -> Callable:
    """The default ``compile_graph``: run the fx graph as it is."""
    return module


class WeightGradQueue:
    """A rank's deferred weight halves, by (chunk, micro-batch): the engine sets ``defer`` and
    ``key`` before an ``I`` action and takes the halves back with :meth:`take` at ``W``."""

    def __init__(self) -> None:
        self.defer = False
        self.key: tuple[int, int] | None = None
        self.pending: dict[tuple[int, int] | None, list[tuple[str, Callable[[], None]]]] = {}

    def push(self, unit: str, run: Callable[[], None]) -> None:
        self.pending.setdefault(self.key, []).append((unit, run))

    def take(self, key: tuple[int, int]) -> list[tuple[str, Callable[[], None]]]:
        """The weight halves the input halves of ``key`` queued, in the order they were queued."""
        return self.pending.pop(key, [])

    def clear(self) -> None:
        self.pending.clear()
        self.defer, self.key = False, None


def lift_parameters(graph: fx.Graph, parameters: list[str]) -> fx.Graph:
    """A copy of a unit's graph reading ``parameters`` (attribute names) as its first inputs."""
    lifted = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    lifted_params = {}
    for name in parameters:
        lifted_params[name] = lifted.placeholder(name.replace(".", "_"))
    for node in graph.nodes:
        if node.op == "get_attr" and node.target in lifted_params:
            env[node] = lifted_params[node.target]
            env[node].meta.update(node.meta)
        else:
            env[node] = lifted.node_copy(node, lambda arg: env[arg])
    return lifted


def split_unit_graph(graph: fx.Graph, parameters: list[str]) -> fx.Graph:
    """The graph a split unit runs: its inputs and parameters read as ever, then one call of its
    ``split`` child (a :class:`SplitBackward`) on (parameters, inputs)."""
    outer = fx.Graph()
    inputs = [outer.node_copy(n) for n in graph.nodes if n.op == "placeholder"]
    reads = [outer.get_attr(name) for name in parameters]
    outer.output(outer.call_module("split", (*reads, *inputs)))
    return outer


@dataclass
class SplitGraphs:
    """A traced unit: forward, input half and weight half, and how their values connect."""

    forward: Callable  # (params..., inputs...) -> (outputs..., saved...)
    input_half: Callable  # (saved..., tangents...) -> (input grads..., stash from the input half...)
    weight_half: Callable  # (stash...) -> parameter grads (in parameter order; None where unused)
    num_outputs: int
    differentiable: list[bool]  # per output: it gets a tangent
    num_saved: int
    input_grad_of: list[int | None]  # per primal (params, then inputs): index into the input grads
    param_grad_of: list[int | None]  # per parameter: index into the weight half's outputs
    stash_sources: list[tuple[str, int]]  # per weight-half input: ("saved" | "tangent" | "input_half", index)


def split_backward_graph(backward: fx.GraphModule, num_saved: int, num_params: int
                         ) -> tuple[fx.GraphModule, fx.GraphModule, list, list, list]:
    """Cut a backward graph (placeholders: saved values then tangents; outputs: one gradient per
    primal, parameters first) into (input half, weight half, input-grad index per primal,
    param-grad index per parameter, sources of the weight half's inputs)."""
    graph = backward.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    outputs = list(next(iter(graph.find_nodes(op="output"))).args[0])
    param_outputs, input_outputs = outputs[:num_params], outputs[num_params:]
    needed_by_input = _ancestors([o for o in input_outputs if isinstance(o, fx.Node)])
    for node in graph.nodes:  # the input half also unpacks the results of its multi-output ops
        if node.op == "call_function" and node.target is operator.getitem and node.args[0] in needed_by_input:
            needed_by_input.add(node)
    weight_nodes = [n for n in graph.nodes if n.op == "call_function" and n not in needed_by_input
                    and n in _ancestors([o for o in param_outputs if isinstance(o, fx.Node)])]
    weight_set = set(weight_nodes)
    # what the weight half reads from elsewhere: placeholders or input-half values
    borrowed: list[fx.Node] = []
    for node in weight_nodes:
        for arg in node.all_input_nodes:
            if arg not in weight_set and arg not in borrowed:
                borrowed.append(arg)
    for out in param_outputs:
        if isinstance(out, fx.Node) and out not in weight_set and out not in borrowed:
            borrowed.append(out)
    from_input_half = [n for n in borrowed if n.op != "placeholder"]

    first = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in placeholders:
        env[node] = first.node_copy(node)
    for node in graph.nodes:
        if node in needed_by_input or node in from_input_half:
            if node.op == "call_function":
                env[node] = first.node_copy(node, lambda arg: env[arg])
    grads = [o for o in input_outputs if isinstance(o, fx.Node)]
    first.output(tuple(env[o] for o in grads) + tuple(env[n] for n in from_input_half))
    input_grad_of = [None] * num_params + [grads.index(o) if isinstance(o, fx.Node) else None for o in input_outputs]

    second = fx.Graph()
    wenv: dict[fx.Node, fx.Node] = {}
    sources = []
    for node in borrowed:
        wenv[node] = second.placeholder(f"stash_{node.name}")
        wenv[node].meta.update(node.meta)
        if node.op == "placeholder":
            index = placeholders.index(node)
            sources.append(("saved", index) if index < num_saved else ("tangent", index - num_saved))
        else:
            sources.append(("input_half", len(grads) + from_input_half.index(node)))
    for node in weight_nodes:
        wenv[node] = second.node_copy(node, lambda arg: wenv[arg])
    param_grads = [o for o in param_outputs if isinstance(o, fx.Node)]
    second.output(tuple(wenv[o] for o in param_grads))
    param_grad_of = [param_grads.index(o) if isinstance(o, fx.Node) else None for o in param_outputs]
    return (fx.GraphModule(backward, first), fx.GraphModule(backward, second), input_grad_of, param_grad_of, sources)


def _ancestors(nodes: list[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = list(nodes)
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        todo.extend(node.all_input_nodes)
    return seen


def trace_split(program: fx.GraphModule, args: list[torch.Tensor], num_params: int,
                compile_graph: CompileGraph = eager_graph) -> SplitGraphs:
    """Trace ``program(*args)`` (parameters first) forward + backward under fake tensors, partition
    it and split its backward (see the module docstring)."""
    from functorch.compile import aot_function, default_partition, make_boxed_func
    from torch._subclasses.fake_tensor import FakeTensorMode

    captured: dict[str, Any] = {}

    def partition(joint, joint_inputs, **kwargs):
        forward, backward = default_partition(joint, joint_inputs, **kwargs)
        captured.update(forward=forward, backward=backward, num_outputs=kwargs["num_fwd_outputs"])
        return forward, backward

    def boxed(graph, example_inputs):
        return make_boxed_func(graph.forward)

    mode = FakeTensorMode(allow_non_fake_inputs=True)  # the program's buffers and constants are real
    fakes = []
    for value in args:
        fake = mode.from_tensor(value.detach()) if isinstance(value, torch.Tensor) else value
        if isinstance(value, torch.Tensor) and value.requires_grad:
            fake.requires_grad_(True)
        fakes.append(fake)
    with mode:
        traced_outputs = aot_function(program, boxed, boxed, partition_fn=partition)(*fakes)
    if "backward" not in captured:
        raise RuntimeError("the unit's outputs need no gradient: there is no backward to split")
    traced_outputs = traced_outputs if isinstance(traced_outputs, tuple) else (traced_outputs,)
    forward, backward, num_outputs = captured["forward"], captured["backward"], captured["num_outputs"]
    forward_outputs = list(next(iter(forward.graph.find_nodes(op="output"))).args[0])
    num_saved = len(forward_outputs) - num_outputs
    if any(not isinstance(v.meta.get("val"), torch.Tensor) for v in forward_outputs[num_outputs:]):
        raise RuntimeError("the unit saves non-tensor values for backward (symbolic sizes): not splittable")
    first, second, input_grad_of, param_grad_of, sources = split_backward_graph(backward, num_saved, num_params)
    examples = {name: [n.meta.get("val") for n in g.graph.nodes if n.op == "placeholder"]
                for name, g in (("forward", forward), ("input", first), ("weight", second))}
    return SplitGraphs(compile_graph(forward, examples["forward"]), compile_graph(first, examples["input"]),
                       compile_graph(second, examples["weight"]), num_outputs,
                       [bool(o.requires_grad) for o in traced_outputs], num_saved, input_grad_of, param_grad_of,
                       sources)


class SplitBackward(nn.Module):
    """The ``split`` child of a split unit: runs the unit's lifted program as one autograd node
    whose weight half may be deferred (see the module docstring)."""

    def __init__(self, program: fx.GraphModule, num_params: int, unit: str, queue: WeightGradQueue,
                 compile_graph: CompileGraph = eager_graph) -> None:
        super().__init__()
        self.program = program  # the lifted graph: (params..., inputs...) -> outputs; holds buffers/constants
        self.num_params, self.unit, self.queue, self.compile_graph = num_params, unit, queue, compile_graph
        self._traced: dict[tuple, SplitGraphs] = {}

    def traced(self, args: tuple) -> SplitGraphs:
        key = tuple((tuple(a.shape), a.dtype, a.requires_grad, a.device.type) if isinstance(a, torch.Tensor) else a
                    for a in args)
        if key not in self._traced:
            # traced on a thread of its own: the caller's saved-tensor hooks (a checkpoint's, an offload's)
            # are per thread and must not see the trace's fake tensors
            with ThreadPoolExecutor(max_workers=1) as worker:
                self._traced[key] = worker.submit(trace_split, self.program, list(args), self.num_params,
                                                  self.compile_graph).result()
        return self._traced[key]

    @property
    def deferring(self) -> bool:
        return self.queue.defer

    def forward(self, *args):
        if not torch.is_grad_enabled() or not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return self.program(*args)  # no backward will run (evaluation, or a recompute's no-grad pass)
        graphs = self.traced(args)
        outputs = _SplitFunction.apply(self, graphs, *args)
        return outputs[0] if graphs.num_outputs == 1 else outputs


class _SplitFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, split: SplitBackward, graphs: SplitGraphs, *args):
        results = graphs.forward(*args)
        outputs, saved = results[:graphs.num_outputs], results[graphs.num_outputs:]
        ctx.save_for_backward(*saved)
        ctx.split, ctx.graphs = split, graphs
        ctx.params = args[:split.num_params]
        ctx.mark_non_differentiable(*(o for o, d in zip(outputs, graphs.differentiable) if not d))
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        graphs, split = ctx.graphs, ctx.split
        saved = list(ctx.saved_tensors)
        tangents = [g for g, differentiable in zip(grads, graphs.differentiable) if differentiable]
        first = graphs.input_half(*saved, *tangents)
        values = {"saved": saved, "tangent": tangents, "input_half": first}
        stash = [values[kind][index] for kind, index in graphs.stash_sources]
        params = ctx.params
        del saved, values

        def weight_half() -> list[torch.Tensor | None]:
            out = graphs.weight_half(*stash) if any(i is not None for i in graphs.param_grad_of) else ()
            return [out[i] if i is not None else None for i in graphs.param_grad_of]

        input_grads = [first[i] if i is not None else None for i in graphs.input_grad_of[split.num_params:]]
        if split.queue.defer:
            split.queue.push(split.unit, lambda: apply_weight_gradients(params, weight_half()))
            return (None, None, *([None] * split.num_params), *input_grads)
        return (None, None, *weight_half(), *input_grads)


class _WeightGradients(torch.autograd.Function):
    """Hands precomputed gradients to autograd: ``backward`` of its (dummy) output returns them."""

    @staticmethod
    def forward(ctx, grads, *params):
        ctx.grads = grads
        return params[0].new_zeros(())

    @staticmethod
    def backward(ctx, _):
        grads, ctx.grads = ctx.grads, None
        return (None, *grads)


def apply_weight_gradients(params: tuple, grads: list[torch.Tensor | None]) -> None:
    """Accumulate ``grads`` into ``params`` through autograd (their hooks fire as in any backward)."""
    pairs = [(p, g) for p, g in zip(params, grads) if g is not None and p.requires_grad]
    if not pairs:
        return
    with torch.enable_grad():
        root = _WeightGradients.apply([g for _, g in pairs], *(p for p, _ in pairs))
    torch.autograd.backward(root)
