"""Build one stage's modules from its lowered program, holding only this rank's weights.

A :class:`~mist_compiler.ir.stage.StageGraph` names, for every unit, the model tensors its
attributes stand for and how each is split over the tensor-parallel ranks. A
:class:`TensorSource` gives full tensors by name: the user's own module (``ModuleTensors``) or a
model built on the meta device and initialised tensor by tensor (``InitTensors``, in
:mod:`.initialize`), so a rank never holds a weight it does not own for longer than it takes to
slice it. Parameters are created in fp32 (the runtime keeps the fp32 master copy and casts its
compute buffers to the plan's dtype); a tensor two units share (a tied embedding and head) is
one ``nn.Parameter``.

``build_stage(..., deferred=True)`` (what the engine uses) goes one step further: parameters are
created with the right shape but no storage, and :meth:`StageProgram.initial_value` produces one
parameter's initial slice when the runtime asks for it, unit by unit, so a rank's start-up peak
is the state it owns plus one unit's weights in flight, never the stage's (or model's) weights
at once. Buffers (rotary tables, masks) are small and made at once.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.fx as fx
from torch import nn

from ..ir.model_graph import CONSTANT, PARAMETER, ModelGraph, ShardSpec
from ..ir.plan import Offload
from ..ir.stage import SavedPolicy, StageGraph, StageInterface
from ..ops.tensor_parallel import TP_CHILDREN, TensorParallelOps
from .split_backward import CompileGraph, SplitBackward, WeightGradQueue, eager_graph, lift_parameters, split_unit_graph


class TensorSource(Protocol):
    def full(self, kind: str, name: str) -> torch.Tensor:
        """The whole tensor ``name`` (a parameter or buffer of the real model)."""

    def meta(self, kind: str, name: str) -> torch.Tensor:
        """A meta-device tensor with ``name``'s shape and dtype (nothing materialised)."""

    # optional: ``shard(kind, name, spec, rank, world)``, this rank's part of ``name`` read without the
    # rest (see :func:`read_shard`)


class ModuleTensors:
    """Tensors of a live module, by name (tied names resolve to the same tensor)."""

    def __init__(self, module: nn.Module) -> None:
        self.params = dict(module.named_parameters(remove_duplicate=False))
        self.buffers = dict(module.named_buffers(remove_duplicate=False))

    def full(self, kind: str, name: str) -> torch.Tensor:
        table = self.params if kind == PARAMETER else self.buffers
        if name not in table:
            raise KeyError(f"the model has no {kind} {name!r}; was the plan captured from another model?")
        return table[name].detach()

    def meta(self, kind: str, name: str) -> torch.Tensor:
        return self.full(kind, name).to("meta")


def shard(tensor: torch.Tensor, spec: ShardSpec | None, rank: int, world: int) -> torch.Tensor:
    """This rank's part of ``tensor`` under ``spec`` (the whole tensor when not split)."""
    if spec is None or world == 1:
        return tensor
    parts = [tensor.narrow(spec.dim, s.start, s.stop - s.start) for s in spec.rank_slices(tensor.shape[spec.dim], rank, world)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=spec.dim)


def read_shard(source: TensorSource, kind: str, name: str, spec: ShardSpec | None, rank: int,
               world: int) -> torch.Tensor:
    """This rank's part of ``source``'s tensor ``name``: read by itself when the source can (a
    checkpoint read by slice), else cut out of the whole tensor."""
    reader = getattr(source, "shard", None)
    if reader is not None:
        return reader(kind, name, spec, rank, world)
    return shard(source.full(kind, name), spec, rank, world)


@dataclass
class StageProgram:
    """One rank's runnable stage: the module, its interface and its units in execution order.

    When the rank's devices run several virtual stages, ``chunks`` holds one program per virtual
    stage (in pipeline order) and this one describes the rank: every chunk's units, parameters and
    tables together (``module`` and ``interface`` are the first chunk's)."""

    module: fx.GraphModule
    interface: StageInterface
    units: list[tuple[str, nn.Module]]
    offload: dict[str, Offload]
    checkpointed: set[str]
    fqn: dict[str, str] = field(default_factory=dict)  # runtime parameter name -> name in the model
    shards: dict[str, ShardSpec] = field(default_factory=dict)  # runtime parameter name -> its TP split
    deferred: dict[int, "DeferredParameter"] = field(default_factory=dict, repr=False)  # id(param) -> how to make it
    tied: set[str] = field(default_factory=set)  # runtime names of weights the model ties across pre and post
    labels: Any = None  # frontend.labels.LabelConvention: how the model reads its labels (set by lower())
    compile_stats: Any = None  # lowering.compile.CompileStats once the units are compiled (or kept eager)
    chunks: list["StageProgram"] = field(default_factory=list)  # per virtual stage, when there are several
    weight_grads: WeightGradQueue | None = None  # where split units defer their weight halves (one per rank)

    @property
    def chunk_programs(self) -> list["StageProgram"]:
        """The virtual stages this rank runs, in pipeline order (itself when there is one)."""
        return self.chunks or [self]
    # unit -> its per-tensor policy and the replay module recomputing its chosen nodes (on the unit's own weights)
    saved: dict[str, tuple[SavedPolicy, fx.GraphModule | None]] = field(default_factory=dict)

    def initial_value(self, param: nn.Parameter) -> torch.Tensor | None:
        """The initial fp32 value of a deferred parameter (made now, on the stage's device; read it,
        do not write to it), or None for a parameter that already holds its value."""
        pending = self.deferred.pop(id(param), None)  # made once: the caller keeps it
        return None if pending is None else pending.make()

    def materialize(self, param: nn.Parameter) -> None:
        """Give a deferred parameter its initial value in place (a no-op for a materialised one)."""
        value = self.initial_value(param)
        if value is not None:
            param.data = value.clone()

    def materialize_all(self) -> None:
        for pending in list(self.deferred.values()):
            self.materialize(pending.param)


@dataclass
class DeferredParameter:
    """A parameter created without storage, and the slice of the model tensor it stands for."""

    param: nn.Parameter
    name: str
    spec: ShardSpec | None
    source: TensorSource
    tp: tuple[int, int]
    device: torch.device

    def make(self) -> torch.Tensor:
        """The value (may share memory with the source's tensor: copy before writing to it)."""
        value = read_shard(self.source, PARAMETER, self.name, self.spec, *self.tp)
        return value.to(device=self.device, dtype=torch.float32).contiguous()


def _without_storage(shape: torch.Size, device: torch.device) -> torch.Tensor:
    """An fp32 tensor of ``shape`` whose storage holds nothing yet (its data is set later)."""
    tensor = torch.empty(shape, dtype=torch.float32, device=device)
    tensor.untyped_storage().resize_(0)
    return tensor


def build_stage(stage: StageGraph, model: ModelGraph, source: TensorSource, *, device: torch.device,
                group: Any = None, deferred: bool = False, made: dict | None = None,
                weight_grads: WeightGradQueue | None = None, compile_graph: CompileGraph | None = None) -> StageProgram:
    """Instantiate ``stage``'s modules on ``device`` with this rank's slices of ``source``'s tensors
    (parameters left without storage until asked for when ``deferred``; ``made``: tensors already
    made for another virtual stage of this rank, shared). Units marked ``split_backward`` run their
    joint graph's two backward halves (:mod:`.split_backward`), deferring weight halves into
    ``weight_grads``, each graph through ``compile_graph``."""
    rank, world = stage.tp
    made = {} if made is None else made
    weight_grads = weight_grads if weight_grads is not None else WeightGradQueue()
    pending: dict[int, DeferredParameter] = {}

    def tensor(kind: str, name: str, spec: ShardSpec | None) -> torch.Tensor:
        key = (kind, name)
        if key not in made:
            if kind == CONSTANT:
                made[key] = getattr(model.graph, name).to(device)
            elif kind == PARAMETER and deferred:
                param = nn.Parameter(_without_storage(shard(source.meta(kind, name), spec, rank, world).shape, device))
                pending[id(param)] = DeferredParameter(param, name, spec, source, (rank, world), device)
                made[key] = param
            else:
                value = read_shard(source, kind, name, spec, rank, world)
                value = value.to(device=device, dtype=torch.float32 if value.is_floating_point() else value.dtype,
                                 copy=True).contiguous()
                made[key] = nn.Parameter(value, requires_grad=True) if kind == PARAMETER else value
        return made[key]

    for graph in [stage.graph] + [unit.graph for unit in stage.units] + [
            unit.saved.replay for unit in stage.units if unit.saved is not None and unit.saved.replay is not None]:
        retarget_devices(graph, torch.device(device))
    ops = TensorParallelOps(group) if world > 1 else None
    root: dict[str, Any] = {}
    units, fqn, shards = [], {}, {}
    saved: dict[str, tuple[SavedPolicy, fx.GraphModule | None]] = {}
    for unit in stage.units:
        parts: dict[str, Any] = {attr: tensor(kind, name, unit.shards.get(attr)) for attr, (kind, name) in unit.tensors.items()}
        if unit.needs_tp:
            parts.update({f"tp.{child}": getattr(ops, child) for child in TP_CHILDREN})
        if unit.split_backward:
            module = _split_unit(unit, parts, weight_grads, compile_graph or eager_graph)
        else:
            module = fx.GraphModule(parts, unit.graph, class_name=f"Unit_{unit.kind}")
        root[unit.name] = module
        units.append((unit.name, module))
        if unit.saved is not None:
            replay = unit.saved.replay
            saved[unit.name] = (unit.saved, fx.GraphModule(module, replay, class_name="Replay") if replay else None)
        for attr, (kind, name) in unit.tensors.items():
            if kind == PARAMETER:
                fqn[f"{unit.name}.{attr}"] = name
                if attr in unit.shards:
                    shards[f"{unit.name}.{attr}"] = unit.shards[attr]
    for attr, (kind, name) in stage.tensors.items():
        root[attr] = tensor(kind, name, None)
    if stage.needs_tp:
        root.update({f"tp.{child}": getattr(ops, child) for child in TP_CHILDREN})
    module = fx.GraphModule(root, stage.graph, class_name=f"Stage{stage.stage}")
    offload = {unit.name: unit.offload for unit in stage.units}
    checkpointed = {unit.name for unit in stage.units if unit.checkpointed}
    tied_fqns = model.tied_parameters()
    tied = {name for name, full_name in fqn.items() if full_name in tied_fqns}
    return StageProgram(module, stage.interface, units, offload, checkpointed, fqn, shards, pending, tied,
                        weight_grads=weight_grads, saved=saved)


def retarget_devices(graph: fx.Graph, device: torch.device) -> None:
    """Point the devices a captured graph names (``torch.arange(..., device=cpu)`` of position ids,
    ``.to(cpu)``: the capture ran on the CPU) at ``device``, the rank's, in place. A graph never names
    the host on purpose: offload copies are the runtime's, outside graphs."""
    if device.type == "cpu":
        return

    def moved(value):
        if isinstance(value, torch.device):
            return device if value.type == "cpu" else value
        if isinstance(value, (tuple, list)):
            return type(value)(moved(item) for item in value)
        if isinstance(value, dict):
            return {key: moved(item) for key, item in value.items()}
        return value

    for node in graph.nodes:
        if node.op in ("call_function", "call_method"):
            node.args, node.kwargs = moved(node.args), moved(node.kwargs)
            if node.kwargs.get("device") == "cpu":
                node.kwargs = {**node.kwargs, "device": device}


def _split_unit(unit, parts: dict[str, Any], queue: WeightGradQueue, compile_graph: CompileGraph) -> fx.GraphModule:
    """A unit whose backward runs as two halves: its parameters as ever, its program in a
    :class:`~.split_backward.SplitBackward` child reading them as inputs."""
    params = [attr for attr, (kind, _) in unit.tensors.items() if kind == PARAMETER]
    others = {attr: value for attr, value in parts.items() if attr not in params}
    program = fx.GraphModule(others, lift_parameters(unit.graph, params), class_name=f"Lifted_{unit.kind}")
    outer = {attr: parts[attr] for attr in params}
    outer["split"] = SplitBackward(program, len(params), unit.name, queue, compile_graph)
    return fx.GraphModule(outer, split_unit_graph(unit.graph, params), class_name=f"Unit_{unit.kind}")


def merge_chunks(chunks: list[StageProgram]) -> StageProgram:
    """One rank's program made of several virtual stages (see :class:`StageProgram`)."""
    first = chunks[0]
    merged = StageProgram(first.module, first.interface, [u for c in chunks for u in c.units], {}, set(),
                          chunks=list(chunks), weight_grads=first.weight_grads)
    for chunk in chunks:
        merged.offload.update(chunk.offload)
        merged.checkpointed |= chunk.checkpointed
        merged.fqn.update(chunk.fqn)
        merged.shards.update(chunk.shards)
        merged.deferred.update(chunk.deferred)
        merged.tied |= chunk.tied
        merged.saved.update(chunk.saved)
    for chunk in chunks:  # one table: a parameter made through the rank's program is gone from its chunk's too
        chunk.deferred = merged.deferred  # (else every chunk keeps the source, e.g. the whole model, alive)
    return merged


def tensor_source(model: nn.Module | str, seq_len: int | None) -> TensorSource:
    """Where the stage's initial weights come from: a live module's own tensors, or a model name's
    initialisation made tensor by tensor."""
    return ModuleTensors(model) if isinstance(model, nn.Module) else InitTensors(model, seq_len)


class InitTensors:
    """Tensors of a named model, as :func:`mist_compiler.models.build_model` makes them, without
    building it: the model is made on the meta device; a tensor a checkpoint holds (``hf:DIR``, a
    factory calling ``from_pretrained``) is read from it, only the slices asked for
    (:meth:`shard`); any other is initialised when asked for
    (:class:`~mist_compiler.models.initialize.MetaInit`). Models without a per-module rule, tensors
    no rule covers and those of modules mixing pretrained and other tensors come from a whole build
    instead (made once, only if needed)."""

    def __init__(self, spec: str, seq_len: int | None, seed: int = 0) -> None:
        from ..models import resolve_model
        from ..models.initialize import MetaInit, has_init_rule
        from ..models.pretrained import checkpoint_names

        self.spec, self.seq_len, self.seed = spec, seq_len, seed
        with torch.device("meta"):
            meta = resolve_model(spec, seq_len).build()
        self.meta_tensors = ModuleTensors(meta)  # shapes and dtypes, by name
        pretrained = checkpoint_names(meta)
        self.stored = pretrained.stored  # name -> (checkpoint, name there)
        owners = pretrained.owners()
        self.mixed = {name for name in list(self.meta_tensors.params) + list(self.meta_tensors.buffers)
                      if name not in self.stored and name.rpartition(".")[0] in owners}  # from a whole build
        self.meta_init = MetaInit(meta, seed) if has_init_rule(meta) else None
        self._whole: ModuleTensors | None = None
        self.whole_builds = 0
        self._lock = threading.Lock()

    def whole(self) -> ModuleTensors:
        with self._lock:
            return self._whole_locked()

    def _whole_locked(self) -> ModuleTensors:
        if self._whole is None:
            from ..models import build_model

            self._whole = ModuleTensors(build_model(self.spec, seq_len=self.seq_len, seed=self.seed))
            self.whole_builds += 1
        return self._whole

    def meta(self, kind: str, name: str) -> torch.Tensor:
        return self.meta_tensors.full(kind, name)

    def full(self, kind: str, name: str) -> torch.Tensor:
        from ..models.initialize import UninitializedError

        if name in self.stored:
            return self._read(kind, name, 0, None)
        if self.meta_init is not None and name not in self.mixed:
            try:
                return self.meta_init.full(kind, name)
            except UninitializedError:
                pass
        return self.whole().full(kind, name)

    def shard(self, kind: str, name: str, spec: ShardSpec | None, rank: int, world: int) -> torch.Tensor:
        """This rank's part of ``name``; a pretrained tensor is read by slices (nothing else of it)."""
        if name not in self.stored or spec is None or world == 1:
            return shard(self.full(kind, name), spec, rank, world)
        size = self.meta(kind, name).shape[spec.dim]
        return self._read(kind, name, spec.dim, spec.rank_slices(size, rank, world))

    def _read(self, kind: str, name: str, dim: int, slices: list[slice] | None) -> torch.Tensor:
        from ..models.pretrained import CheckpointError

        checkpoint, stored = self.stored[name]
        expected = tuple(self.meta(kind, name).shape)
        if checkpoint.shape(stored) != expected:
            raise CheckpointError(f"{checkpoint.folder}: {stored} has shape {list(checkpoint.shape(stored))}, but the "
                                  f"model's {name} has {list(expected)} (a checkpoint of another configuration?)")
        return checkpoint.read(stored, dim, slices)
