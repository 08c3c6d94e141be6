"""Pipeline partitioning: cut a model into per-stage programs at layer-block boundaries.

``trace_model`` turns the model into a torch-level fx graph whose layer blocks (and every module
holding its own parameters: embeddings, norms, the head) are leaf ``call_module`` nodes. The
``partition`` pass then assigns each node to a stage:

- a layer block goes to the stage whose plan range holds its index;
- a parameter-holding module or parameter read before the first block is "pre" (first stage),
  after it "post" (last stage);
- any other node runs where its latest input is produced; nodes that depend on nothing but the
  batch inputs and constants (positions, masks) are *free*: copied into every stage that needs
  them instead of being sent.

A value produced on stage ``i`` and used on a later stage crosses every cut in between: it is an
output of stages ``i..j-1`` and an input of stages ``i+1..j``. The stage program is a
``GraphModule`` ``forward(*boundary_inputs, **batch_inputs)`` returning a tuple of boundary
outputs (the loss on the last stage); its ``meta["mist_stage"]`` is a :class:`StageInterface`.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn

from mist_compiler.frontend.layer_stack import LayerStack, find_layer_stack
from mist_compiler.ir.plan import Plan

from .manager import PassResult

FREE = -1  # stage of a node that only depends on batch inputs and constants


class PartitionError(ValueError):
    """A model that cannot be cut into pipeline stages; the message says why."""


@dataclass(frozen=True)
class BoundaryValue:
    """One value crossing a pipeline cut: its per-sample shape and whether dim 0 is the batch."""

    name: str
    sample_shape: tuple[int, ...]  # shape without the batch dimension (full shape if not batched)
    dtype: torch.dtype
    batched: bool

    @property
    def needs_grad(self) -> bool:
        return self.batched and self.dtype.is_floating_point

    def shape(self, batch: int) -> tuple[int, ...]:
        return (batch, *self.sample_shape) if self.batched else self.sample_shape


@dataclass
class StageInterface:
    """What a stage program receives and returns."""

    stage: int
    num_stages: int
    inputs: list[BoundaryValue]  # received from the previous stage, in this order
    batch_inputs: list[str]  # fed from the batch (input_ids, labels, ...)
    outputs: list[BoundaryValue]  # sent to the next stage, in this order (empty on the last)
    block_targets: list[str] = field(default_factory=list)  # call_module targets of layer blocks

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1


class _BlockLeafTracer(fx.Tracer):
    """Stops at layer blocks and at every module that owns parameters itself."""

    def __init__(self, stack: LayerStack) -> None:
        super().__init__()
        self.block_paths = {stack.block_path(i) for i in range(len(stack))}

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        if qualified_name in self.block_paths:
            return True
        if any(True for _ in module.parameters(recurse=False)):
            return True
        return super().is_leaf_module(module, qualified_name)


def _is_hf_model(model: nn.Module) -> bool:
    return type(model).__module__.startswith("transformers.")


def _trace_hf(model: nn.Module, stack: LayerStack) -> fx.GraphModule:
    try:
        from transformers.utils.fx import HFTracer
    except ImportError as error:
        raise PartitionError(f"cannot cut {type(model).__name__} for pipelining: transformers.utils.fx is unavailable ({error}); "
                             "use a plan with one stage (the module then runs whole)") from None
    block_paths = {stack.block_path(i) for i in range(len(stack))}

    class _HFBlockTracer(HFTracer):
        def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
            return qualified_name in block_paths or super().is_leaf_module(module, qualified_name)

    try:
        tracer = _HFBlockTracer()
        dummy = {"input_ids": torch.zeros(2, 8, dtype=torch.long), "labels": torch.zeros(2, 8, dtype=torch.long)}
        graph = tracer.trace(model, dummy_inputs=dummy)
    except Exception as error:  # HF tracing fails in many model-specific ways
        raise PartitionError(f"cannot cut {type(model).__name__} for pipelining: symbolic tracing failed ({error}); "
                             "use a plan with one stage (the module then runs whole)") from None
    gm = fx.GraphModule(model, graph)
    _return_loss_only(gm)
    gm.meta["mist_layer_stack"] = stack.path
    return gm


def _return_loss_only(gm: fx.GraphModule) -> None:
    """Hugging Face models return an output object; keep only its ``loss``."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    value = output.args[0]
    if isinstance(value, dict) and "loss" in value:
        output.args = (value["loss"],)
    elif isinstance(value, fx.Node):
        with gm.graph.inserting_before(output):
            output.args = (gm.graph.call_function(operator.getitem, (value, "loss")),)
    gm.graph.eliminate_dead_code()
    gm.recompile()


def trace_model(model: nn.Module) -> fx.GraphModule:
    """A torch-level fx graph of ``model`` with layer blocks and parameter owners as leaves."""
    stack = find_layer_stack(model)
    if _is_hf_model(model):
        return _trace_hf(model, stack)
    try:
        graph = _BlockLeafTracer(stack).trace(model)
    except Exception as error:  # data-dependent control flow and the like
        raise PartitionError(f"cannot cut {type(model).__name__} for pipelining: symbolic tracing failed ({error}); "
                             "use a plan with one stage (the module then runs whole)") from None
    gm = fx.GraphModule(model, graph)
    gm.meta["mist_layer_stack"] = stack.path
    return gm


def _owns_parameters(gm: fx.GraphModule, node: fx.Node) -> bool:
    if node.op == "call_module":
        return any(True for _ in gm.get_submodule(node.target).parameters())
    if node.op == "get_attr":
        return isinstance(_resolve_attr(gm, node.target), nn.Parameter)
    return False


def _resolve_attr(gm: nn.Module, target: str):
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _inputs_of(node: fx.Node) -> list[fx.Node]:
    return list(node.all_input_nodes)


def assign_stages(gm: fx.GraphModule, plan: Plan, stack_path: str) -> dict[fx.Node, int]:
    """Stage index of every node (``FREE`` for batch-only nodes), see the module docstring."""
    prefix = f"{stack_path}." if stack_path else ""
    last = plan.pp - 1
    stage_of_layer = {}
    for index, stage in enumerate(plan.stages):
        for layer in range(*stage.layers):
            stage_of_layer[layer] = index
    stages: dict[fx.Node, int] = {}
    seen_block = False
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target.startswith(prefix) and node.target[len(prefix):].isdigit():
            layer = int(node.target[len(prefix):])
            if layer not in stage_of_layer:
                raise PartitionError(f"layer block {node.target} is outside the plan's layer ranges (0..{plan.num_layers})")
            stages[node] = stage_of_layer[layer]
            seen_block = True
        elif node.op == "placeholder":
            stages[node] = FREE
        elif _owns_parameters(gm, node):
            stages[node] = last if seen_block else 0
        elif node.op == "output":
            stages[node] = last
        else:
            stages[node] = max((stages[i] for i in _inputs_of(node)), default=FREE)
    for node, stage in stages.items():  # a node's inputs may never come from a later stage
        for source in _inputs_of(node):
            if stages[source] > stage and node.op != "output":
                raise PartitionError(f"node {node.name} (stage {stage}) uses {source.name} from the later stage {stages[source]}")
    return stages


def _model_device(gm: fx.GraphModule) -> torch.device:
    return next((p.device for p in gm.parameters()), torch.device("cpu"))


def _classify_boundary(gm: fx.GraphModule, plan: Plan, names: set[str]) -> dict[str, BoundaryValue]:
    """Run the graph (no grad) on batches of one and two samples: dims that change are batch dims.

    On a meta-device model this costs nothing; on a real one it is one small forward.
    """
    device = _model_device(gm)
    shapes: dict[int, dict[str, torch.Tensor]] = {}
    for batch in (1, 2):
        values: dict[str, torch.Tensor] = {}

        class _Recorder(fx.Interpreter):
            def run_node(self, n: fx.Node):
                result = super().run_node(n)
                if n.name in names:
                    if not isinstance(result, torch.Tensor):
                        raise PartitionError(f"value {n.name} crosses a pipeline cut but is a {type(result).__name__}, not a tensor")
                    values[n.name] = result
                return result

        ids = torch.zeros(batch, plan.seq_len, dtype=torch.long, device=device)
        inputs = {"input_ids": ids, "labels": ids}
        with torch.no_grad():
            _Recorder(gm).run(*[inputs.get(p.target) for p in gm.graph.nodes if p.op == "placeholder"])
        shapes[batch] = values
    result = {}
    for name, small in shapes[1].items():
        large = shapes[2][name]
        batched = small.dim() > 0 and small.shape[0] == 1 and large.shape[0] == 2
        if list(small.shape[1:] if batched else small.shape) != list(large.shape[1:] if batched else large.shape):
            raise PartitionError(f"value {name} has a batch dimension other than dim 0 ({tuple(large.shape)}); cannot send it between stages")
        result[name] = BoundaryValue(name, tuple(small.shape[1:] if batched else small.shape), small.dtype, batched)
    return result


def _stage_graph(gm: fx.GraphModule, stages: dict[fx.Node, int], stage: int,
                 crossing: dict[int, list[fx.Node]], is_last: bool) -> tuple[fx.Graph, list[str]]:
    """Copy the nodes of one stage (plus the free nodes they need) into a new graph."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in crossing.get(stage - 1, []):
        env[node] = graph.placeholder(node.name)
    own = {n for n, s in stages.items() if s == stage and n.op not in ("output", "placeholder")}
    needed_outputs = crossing.get(stage, []) if not is_last else []
    final = next(n for n in gm.graph.nodes if n.op == "output")
    roots = list(own) + needed_outputs + ([final.args[0]] if is_last else [])
    required: set[fx.Node] = set()
    todo = [r for r in roots if isinstance(r, fx.Node)]
    while todo:  # free nodes the stage needs
        node = todo.pop()
        if node in required or node in env:
            continue
        required.add(node)
        todo.extend(i for i in _inputs_of(node) if i not in env)
    batch_inputs = []
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node in required:
            env[node] = graph.placeholder(node.target, default_value=None)
            batch_inputs.append(node.target)
    for node in gm.graph.nodes:
        if node in required and node.op != "placeholder" and node.op != "output":
            if stages[node] not in (stage, FREE):
                raise PartitionError(f"stage {stage} needs {node.name} from stage {stages[node]} but it does not cross the cut")
            env[node] = graph.node_copy(node, lambda n: env[n])
    if is_last:
        graph.output(env[final.args[0]])
    else:
        graph.output(tuple(env[n] for n in needed_outputs))
    return graph, batch_inputs


def crossing_values(gm: fx.GraphModule, stages: dict[fx.Node, int], num_stages: int) -> dict[int, list[fx.Node]]:
    """For each cut ``i`` (between stage i and i+1) the values that cross it, in graph order."""
    crossing: dict[int, list[fx.Node]] = {i: [] for i in range(num_stages - 1)}
    for node in gm.graph.nodes:
        produced = stages[node]
        if produced == FREE or node.op == "output":
            continue
        used = max((stages[u] for u in node.users), default=produced)
        for cut in range(produced, used):
            crossing[cut].append(node)
    return crossing


class Partition:
    """The pipeline partitioning pass for one stage of a plan (full model graph -> stage program)."""

    name = "partition"

    def __init__(self, plan: Plan, stage: int) -> None:
        if not 0 <= stage < plan.pp:
            raise PartitionError(f"stage {stage} is out of range for a plan of {plan.pp} stages")
        self.plan = plan
        self.stage = stage

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        stack_path = gm.meta.get("mist_layer_stack")
        if stack_path is None:
            stack_path = find_layer_stack(gm).path
        stages = assign_stages(gm, self.plan, stack_path)
        crossing = crossing_values(gm, stages, self.plan.pp)
        is_last = self.stage == self.plan.pp - 1
        graph, batch_inputs = _stage_graph(gm, stages, self.stage, crossing, is_last)
        names = {n.name for cut in crossing.values() for n in cut}
        boundary = _classify_boundary(gm, self.plan, names) if names else {}
        stage_gm = fx.GraphModule(gm, graph, class_name=f"Stage{self.stage}")
        prefix = f"{stack_path}."
        stage_gm.meta["mist_layer_stack"] = stack_path
        stage_gm.meta["mist_stage"] = StageInterface(
            stage=self.stage, num_stages=self.plan.pp,
            inputs=[boundary[n.name] for n in crossing.get(self.stage - 1, [])],
            batch_inputs=batch_inputs,
            outputs=[] if is_last else [boundary[n.name] for n in crossing[self.stage]],
            block_targets=[n.target for n in graph.nodes if n.op == "call_module" and n.target.startswith(prefix)
                           and n.target[len(prefix):].isdigit()],
        )
        return PassResult(stage_gm, self.plan.pp > 1)


def stage_interface(gm: fx.GraphModule) -> StageInterface:
    interface = gm.meta.get("mist_stage")
    if interface is None:
        raise PartitionError("the program has no stage interface; run the partition pass first")
    return interface
