"""Tensor-parallel sharding of a stage program (Megatron-style, found by data flow).

Inside every layer block, each value is classified as *const* (shapes, parameters read by
non-linear code, anything not derived from the block input), *replicated* (the block input and
what is computed from it identically on every rank) or *sharded* (split along features). A
linear reading a replicated value becomes column-parallel (its output is sharded); a linear
reading a sharded value becomes row-parallel (its partial output is all-reduced, hence
replicated). Elementwise code, head reshapes and attention keep the state of their inputs, so
q/k/v -> attention -> o and up/gate -> activation -> down pair up on GPT and LLaMA alike, and
head-split attention follows because the model derives head counts from shapes. Anything else
(a sharded value meeting a replicated one, reaching a norm or the block output) is an error.

Outside the blocks: the token embedding (an ``nn.Embedding`` of ``input_ids``) becomes
vocab-parallel; the head (the linear whose output only feeds ``F.cross_entropy``) becomes
column-parallel without a gather and the loss call is rewritten into the vocab-parallel
cross-entropy. Other modules stay replicated.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.fx as fx
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
import torch.nn.functional as F
from torch import nn

from mist_compiler.backends.tensor_parallel import (
    ColumnParallelLinear, RowParallelLinear, TensorParallelError, VocabParallelCrossEntropy, VocabParallelEmbedding,
)

from .manager import PassResult
from .partition import stage_interface


class State(Enum):
    CONST = 0
    REPLICATED = 1
    SHARDED = 2


_SHAPE_ATTRS = {"shape", "dtype", "device", "ndim", "is_cuda"}
_REDUCING_METHODS = {"mean", "sum", "norm", "var", "std", "softmax", "log_softmax", "max", "min", "amax", "amin", "cumsum"}


_NORMS = {"layer_norm", "rms_norm", "group_norm", "batch_norm", "instance_norm", "softmax", "log_softmax"}


class _DataFlowRecorder(TorchFunctionMode):
    """Runs a block on an example input and propagates each tensor's :class:`State` op by op."""

    def __init__(self, block: nn.Module, block_name: str) -> None:
        super().__init__()
        self.block_name = block_name
        self.states: dict[int, State] = {}
        self.alive: list[torch.Tensor] = []  # keeps ids unique while recording
        self.roles: dict[str, str] = {}
        self.inside_linear = 0
        self.handles = []
        for path, module in block.named_modules():
            if isinstance(module, nn.Linear):
                self.handles.append(module.register_forward_pre_hook(self._enter_linear(path)))
                self.handles.append(module.register_forward_hook(self._leave_linear(path)))

    def state(self, value: Any) -> State:
        return self.states.get(id(value), State.CONST) if isinstance(value, torch.Tensor) else State.CONST

    def mark(self, value: torch.Tensor, state: State) -> None:
        self.states[id(value)] = state
        self.alive.append(value)

    def _enter_linear(self, path: str):
        def hook(module, args):
            state = self.state(args[0])
            if state != State.CONST:
                role = "column" if state == State.REPLICATED else "row"
                if self.roles.setdefault(path, role) != role:
                    raise TensorParallelError(f"{self.block_name}.{path} is used both as column- and row-parallel")
            self.inside_linear += 1
        return hook

    def _leave_linear(self, path: str):
        def hook(module, args, output):
            self.inside_linear -= 1
            role = self.roles.get(path)
            if role is not None:
                self.mark(output, State.SHARDED if role == "column" else State.REPLICATED)
        return hook

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.inside_linear:
            return out
        inputs = {self.state(v) for v in pytree.tree_leaves((args, kwargs))} - {State.CONST}
        name = getattr(func, "__name__", str(func))
        if inputs == {State.REPLICATED, State.SHARDED}:
            raise TensorParallelError(f"{self.block_name}: {name} mixes sharded and replicated values; cannot shard this structure")
        state = inputs.pop() if inputs else State.CONST
        if state == State.SHARDED and (name in _NORMS or (name in _REDUCING_METHODS and _reduces_features(args, kwargs))):
            raise TensorParallelError(f"{self.block_name}: {name} reduces over tensor-parallel-sharded features; cannot shard this structure")
        if state != State.CONST:
            for leaf in pytree.tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    self.mark(leaf, state)
        return out


def _reduces_features(args: tuple, kwargs: dict) -> bool:
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    return dim is None or dim == -1 or (isinstance(dim, (tuple, list)) and -1 in dim)


def linear_roles(block: nn.Module, block_name: str = "block", example: torch.Tensor | None = None) -> dict[str, str]:
    """``{linear submodule path: "column" | "row"}`` for one layer block, by data flow.

    The block runs once on ``example`` (default ``[1, 4, in_features of its first linear]``)
    while every torch op is recorded, so shape-dependent Python code takes its real path.
    """
    if example is None:
        first = next((m for m in block.modules() if isinstance(m, nn.Linear)), None)
        if first is None:
            return {}
        example = torch.zeros(1, 4, first.in_features, dtype=first.weight.dtype, device=first.weight.device)
    recorder = _DataFlowRecorder(block, block_name)
    try:
        with torch.no_grad(), recorder:
            recorder.mark(example, State.REPLICATED)
            output = block(example)
    finally:
        for handle in recorder.handles:
            handle.remove()
    if recorder.state(output) == State.SHARDED:
        raise TensorParallelError(f"{block_name}: the block output would be sharded; cannot shard this structure")
    unpaired = [name for name, module in block.named_modules() if isinstance(module, nn.Linear) and name not in recorder.roles]
    if unpaired:
        raise TensorParallelError(f"{block_name}: linear(s) {unpaired} are not on the path of the block input; cannot shard them")
    return recorder.roles


def shard_block(block: nn.Module, roles: dict[str, str], group, rank: int, world: int, block_name: str) -> nn.Module:
    """A copy of ``block`` with each linear replaced by its column/row-parallel slice."""
    linears = {id(block.get_submodule(path)): block.get_submodule(path) for path in roles}
    sharded = copy.deepcopy(block, memo=dict(linears))  # the linears are replaced, do not copy them
    for path, role in roles.items():
        parent_path, _, attr = path.rpartition(".")
        parent = sharded.get_submodule(parent_path) if parent_path else sharded
        linear = getattr(parent, attr)
        cls = ColumnParallelLinear if role == "column" else RowParallelLinear
        setattr(parent, attr, cls(linear, group, rank, world, name=f"{block_name}.{path}"))
    return sharded


def _flows_only_to_cross_entropy(node: fx.Node) -> fx.Node | None:
    """The ``F.cross_entropy`` node that consumes ``node`` (via float/view/reshape), or None."""
    passthrough = {"float", "view", "reshape", "contiguous", "to"}
    frontier, found = [node], None
    while frontier:
        current = frontier.pop()
        for user in current.users:
            if user.op == "call_function" and user.target is getattr and user.args[1] in _SHAPE_ATTRS:
                continue
            if user.op == "call_method" and user.target in passthrough and user.args[0] is current:
                frontier.append(user)
            elif user.op == "call_function" and user.target is F.cross_entropy and user.args[0] is current:
                found = user
            else:
                return None
    return found


@dataclass
class TensorParallel:
    """The TP sharding pass for one rank of a stage: ``world`` ranks, this one ``rank``."""

    group: Any
    rank: int
    world: int
    name: str = "tp_sharding"

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        if self.world == 1:
            return PassResult(gm, False)
        interface = stage_interface(gm)
        blocks = set(interface.block_targets)
        graph = copy.deepcopy(gm.graph)
        modules: dict[str, Any] = {}
        for node in graph.nodes:
            if node.op == "get_attr":
                modules[node.target] = _resolve(gm, node.target)
            if node.op != "call_module" or node.target in modules:
                continue
            module = gm.get_submodule(node.target)
            if node.target in blocks:
                roles = linear_roles(module, node.target)
                modules[node.target] = shard_block(module, roles, self.group, self.rank, self.world, node.target)
            elif isinstance(module, nn.Embedding) and _is_input_ids(node.args[0]):
                modules[node.target] = VocabParallelEmbedding(module, self.group, self.rank, self.world, node.target)
            elif isinstance(module, nn.Linear) and (loss := _flows_only_to_cross_entropy(node)) is not None:
                modules[node.target] = ColumnParallelLinear(module, self.group, self.rank, self.world, node.target)
                loss_name = f"{loss.name}_vocab_parallel"
                modules[loss_name] = self._loss_module(loss)
                loss.op, loss.target, loss.args, loss.kwargs = "call_module", loss_name, loss.args[:2], {}
            else:
                modules[node.target] = module
        sharded = fx.GraphModule(modules, graph, class_name=type(gm).__name__)
        sharded.meta.update(gm.meta)
        sharded.meta["mist_tp"] = (self.rank, self.world)
        return PassResult(sharded, True)

    def _loss_module(self, loss: fx.Node) -> VocabParallelCrossEntropy:
        kwargs = dict(loss.kwargs)
        if kwargs.get("weight") is not None or kwargs.get("label_smoothing", 0.0) != 0.0:
            raise TensorParallelError(f"{loss.name}: vocab-parallel cross-entropy supports no class weights and no label smoothing")
        if kwargs.get("size_average") is not None or kwargs.get("reduce") is not None:
            raise TensorParallelError(f"{loss.name}: legacy size_average/reduce arguments are not supported")
        if len(loss.args) > 2:
            raise TensorParallelError(f"{loss.name}: pass cross_entropy options as keywords to shard it")
        return VocabParallelCrossEntropy(self.group, self.rank, self.world, kwargs.get("ignore_index", -100),
                                         kwargs.get("reduction", "mean"))


def _is_input_ids(arg: Any) -> bool:
    return isinstance(arg, fx.Node) and arg.op == "placeholder" and arg.target == "input_ids"


def _resolve(module: nn.Module, target: str) -> Any:
    value: Any = module
    for part in target.split("."):
        value = getattr(value, part)
    return value


def check_heads_divisible(config: Any, tp: int, where: str = "tp") -> None:
    """Head-split attention needs heads and key/value heads divisible by the TP degree."""
    heads = getattr(config, "heads", None)
    kv_heads = getattr(config, "num_kv_heads", None)
    if heads is not None and heads % tp:
        raise TensorParallelError(f"{where}: {heads} attention heads are not divisible by tp={tp}")
    if kv_heads is not None and kv_heads % tp:
        raise TensorParallelError(f"{where}: {kv_heads} key/value heads are not divisible by tp={tp}")


