"""The lowered program of one pipeline stage, as the lowering passes build and annotate it.

``partition`` produces a :class:`StageGraph` from the captured :class:`~.model_graph.ModelGraph`
and a plan: a top-level fx graph that recomputes the values every stage can compute from the
batch alone (positions, masks, rotary tables), runs the code outside modules (a residual add,
the loss) and calls one *unit* per parameter-holding piece (each module of the pre part that
reads parameters, each layer, each such module of the post part) in execution order. A unit is described, not
built: its fx graph (shared by every layer of one class), the model tensors its attributes
stand for, how each is split over tensor-parallel ranks, whether it is checkpointed, how much
of it is offloaded. The later passes (``tp_sharding``, ``checkpoint``, ``offload_insertion``)
(``split_backward``, for zero-bubble schedules; ``activation_policy``, a layer's per-tensor choices)
fill those fields; the runtime then builds the modules, with only this rank's weights.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from .model_graph import ShardSpec
from .plan import Offload

FREE = -1  # stage of a value computed from the batch alone (every stage recomputes it)


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
    batch_inputs: list[str]  # fed from the batch (input_ids, labels)
    outputs: list[BoundaryValue]  # sent to the next stage, in this order (empty on the last)
    block_targets: list[str] = field(default_factory=list)  # layer units, in order

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1


def split_boundary(numel: int, host_fraction: float) -> int:
    """Number of leading elements of a flat buffer kept on the device when ``host_fraction`` of
    it is offloaded (the rounding rule the runtime and the cost model share)."""
    if not 0.0 <= host_fraction <= 1.0:
        raise ValueError(f"offload fraction must be in [0, 1], got {host_fraction}")
    return numel - int(round(host_fraction * numel))


@dataclass(frozen=True)
class SavedPolicy:
    """What the runtime does with the tensors one unit's forward saves for its backward (made by the
    ``activation_policy`` lowering pass from the plan's per-tensor choices). Each saved tensor
    belongs to the node of the unit graph that made it; that node's choice applies."""

    recompute: frozenset[str]  # nodes run again in the backward (their saved tensors dropped in the forward)
    offload: dict[str, float]  # node -> fraction of its saved bytes kept in host memory
    held: tuple[str, ...]  # values (nodes, unit inputs) the recomputation starts from, referenced from the forward
    replay: torch.fx.Graph | None = None  # held values (placeholders, in ``held`` order) -> the recomputed nodes' values
    replayed: tuple[str, ...] = ()  # the nodes ``replay`` returns, in order
    inputs: tuple[str, ...] = ()  # the unit graph's placeholders, in order (the unit's arguments)
    plain_offload: bool = True  # the stage's ``offload.acts`` applies to the nodes it does not name (no plan policy)


@dataclass
class Unit:
    """One parameter-holding piece of a stage: the ``pre`` part, a layer or the ``post`` part."""

    name: str  # call target in the stage graph; layers use their module path ("model.layers.3")
    kind: str  # "pre" | "layer" | "post"
    graph: torch.fx.Graph  # the unit's program; attributes read by get_attr are its tensors
    tensors: dict[str, tuple[str, str]]  # attribute -> (PARAMETER | BUFFER | CONSTANT, name in the model
    # (CONSTANT: the attribute of the captured graph module holding it))
    region: str  # "pre" | "post" | "layer:<traced>": which region of the captured graph it runs
    layer: int | None = None
    shards: dict[str, ShardSpec] = field(default_factory=dict)  # attribute -> tensor-parallel split
    checkpointed: bool = False
    offload: Offload = field(default_factory=Offload)  # fractions of this unit's state kept on the host
    needs_tp: bool = False  # its graph calls the tensor-parallel collectives (module ``tp``)
    split_backward: bool = False  # its backward runs as an input-gradient and a weight-gradient half
    saved: SavedPolicy | None = None  # per-tensor keep / recompute / offload of what it saves (None: autograd's)


@dataclass
class StageGraph:
    """One stage's lowered program (see the module docstring)."""

    stage: int
    num_stages: int
    graph: torch.fx.Graph  # top level: placeholders, free values, call_module per unit, output
    interface: StageInterface
    units: list[Unit]  # in execution order
    tensors: dict[str, tuple[str, str]] = field(default_factory=dict)  # top-level attribute -> (BUFFER | CONSTANT, name)
    tp: tuple[int, int] = (0, 1)  # (tp rank, tp degree) the units are sharded for
    plan_dtype: str = "float32"
    needs_tp: bool = False  # the top-level graph calls tensor-parallel collectives (a vocabulary-parallel loss)

    def unit(self, name: str) -> Unit:
        for unit in self.units:
            if unit.name == name:
                return unit
        raise KeyError(f"stage {self.stage} has no unit {name!r}; units: {[u.name for u in self.units]}")

    @property
    def layer_units(self) -> list[Unit]:
        return [u for u in self.units if u.kind == "layer"]
