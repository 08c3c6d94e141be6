"""The tuner's search space: what may vary per stage and globally, and switches to restrict it.

Per stage: the layer range (any contiguous split), the devices (``(1, g)`` inside one node with
``g`` dividing the node's GPU count, or ``(n, gpus_per_node)`` whole nodes), the data- and
tensor-parallel degrees (``dp * tp`` = the stage's devices; TP a power of two that divides the
attention heads and fits in one node), the micro-batch (``global_batch / (dp * G)``, which must be a
whole number), the ZeRO level 0-3, the number of checkpointed layers (0..layers) and the offload
ratios of weights, gradients and activations on a grid (default 0, 0.5, 1); the optimizer-state
ratio is continuous up to the grid's largest value (the least that fits is found in closed form,
``knobs``).
Globally: the number of pipeline stages ``S``, gradient-accumulation steps ``G`` and the pipeline
schedule (1F1B, interleaved with ``v`` virtual stages per group of devices, zero-bubble ZB-H1
and ZB-V; ``tuner/schedules.py``).

A :class:`SearchSpace` turns families off or restricts them; the baselines are such restrictions,
which makes "the full search is never worse than a baseline" hold by construction.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from itertools import product

import numpy as np

from ..ir.schedule import SCHEDULES
from ..ir.vocabulary import DEFAULT_DTYPE, OFFLOAD_KINDS

CKPT_MODES = ("tune", "all_or_none", "none", "all")
OFFLOAD_FAMILIES = OFFLOAD_KINDS  # each kind of state the search may offload
DEFAULT_OFFLOAD_GRID = (0.0, 0.5, 1.0)


class TuneError(ValueError):
    """A tuning request that cannot be satisfied; the message names the limit and the smallest fix."""


@dataclass(frozen=True)
class DeviceShape:
    """Devices of one stage: ``nodes`` whole nodes, or one node's ``gpus`` GPUs when ``nodes == 1``."""

    nodes: int
    gpus: int

    @property
    def count(self) -> int:
        return self.nodes * self.gpus


@dataclass(frozen=True)
class SearchSpace:
    """Which knobs the tuner may turn. Defaults: everything (a superset of the Mist paper's space).

    - ``micro_batches``: allowed micro-batch sizes (None: any whole ``global_batch / (dp * G)``).
    - ``tp_degrees`` / ``zero_levels``: allowed values (None TP: every power of two that fits).
    - ``ckpt``: ``"tune"`` (any count 0..layers), ``"all_or_none"``, ``"none"`` or ``"all"``.
    - ``offload_grid``: ratios tried for each enabled offload family (the optimizer's: its largest value
      bounds a continuous ratio); ``offload_*`` switch a family.
    - ``stage_counts`` / ``max_stages`` / ``grad_accum``: allowed pipeline depths and G values.
    - ``uniform_devices``: every stage gets ``world / S`` devices (no heterogeneous stages).
    - ``layer_slack``: each stage holds within this many layers of ``L / S`` (None: any split).
    - ``partial_node_stages``: allow stages smaller than a node.
    - ``max_frontier_points``: cap on Pareto points kept per stage cell and in-flight count.
    - ``gap``: relative optimality gap the stage-partition search must certify (0: exact).
    - ``schedules`` / ``virtual_stages``: pipeline schedules tried (``ir.schedule.SCHEDULES``) and the
      chunks per group of devices the interleaved schedule may use.
    - ``sequence_parallel``: offer sequence parallelism with every tensor-parallel degree > 1 (when the
      model's layers can run it).
    - ``per_tensor``: offer the layer's per-tensor keep / recompute / offload policies (its activation
      frontier, ``activation_milp``: ``activation_points`` budgets) to stages that need to save memory;
      they offload only where ``offload_acts`` allows it and recompute only where ``ckpt`` is not ``none``.
    """

    micro_batches: tuple[int, ...] | None = None
    tp_degrees: tuple[int, ...] | None = None
    zero_levels: tuple[int, ...] = (0, 1, 2, 3)
    ckpt: str = "tune"
    offload_grid: tuple[float, ...] = DEFAULT_OFFLOAD_GRID
    offload_weights: bool = True
    offload_grads: bool = True
    offload_opt: bool = True
    offload_acts: bool = True
    stage_counts: tuple[int, ...] | None = None
    max_stages: int | None = None
    grad_accum: tuple[int, ...] | None = None
    uniform_devices: bool = False
    layer_slack: int | None = None
    partial_node_stages: bool = True
    max_frontier_points: int = 32
    gap: float = 1e-4
    schedules: tuple[str, ...] = ("1f1b", "zb-h1", "zbv", "interleaved")
    virtual_stages: tuple[int, ...] = (2, 4)
    sequence_parallel: bool = True
    per_tensor: bool = True
    activation_points: int = 5
    name: str = "full"

    def __post_init__(self) -> None:
        if self.ckpt not in CKPT_MODES:
            raise ValueError(f"SearchSpace.ckpt must be one of {list(CKPT_MODES)}, got {self.ckpt!r}")
        if not self.zero_levels or any(z not in (0, 1, 2, 3) for z in self.zero_levels):
            raise ValueError(f"SearchSpace.zero_levels must be a non-empty subset of 0..3, got {self.zero_levels}")
        grid = tuple(self.offload_grid)
        if not grid or 0.0 not in grid or any(not 0.0 <= r <= 1.0 for r in grid):
            raise ValueError(f"SearchSpace.offload_grid must contain 0 and only ratios in [0, 1], got {grid}")
        for name in ("micro_batches", "tp_degrees", "stage_counts", "grad_accum"):
            values = getattr(self, name)
            if values is not None and (not values or any(int(v) < 1 for v in values)):
                raise ValueError(f"SearchSpace.{name} must be None or positive integers, got {values}")
        if self.layer_slack is not None and self.layer_slack < 0:
            raise ValueError(f"SearchSpace.layer_slack must be >= 0, got {self.layer_slack}")
        if self.max_frontier_points < 1:
            raise ValueError(f"SearchSpace.max_frontier_points must be >= 1, got {self.max_frontier_points}")
        if not 0.0 <= self.gap < 1.0:
            raise ValueError(f"SearchSpace.gap must be in [0, 1), got {self.gap}")
        if "1f1b" not in self.schedules or any(name not in SCHEDULES for name in self.schedules):
            raise ValueError(f"SearchSpace.schedules must include '1f1b' and name only {sorted(SCHEDULES)}, "
                             f"got {self.schedules}")
        if not self.virtual_stages or any(int(v) < 2 for v in self.virtual_stages):
            raise ValueError(f"SearchSpace.virtual_stages must be integers >= 2, got {self.virtual_stages}")

    def restrict(self, **changes) -> "SearchSpace":
        return replace(self, **changes)

    # --- enumerations -------------------------------------------------------------------------

    def offload_combos(self) -> np.ndarray:
        """All (weights, grads, opt, acts) ratio tuples, shape [n, 4], zeros first."""
        grid = sorted(set(float(r) for r in self.offload_grid))
        axes = [grid if getattr(self, f"offload_{family}") else [0.0] for family in OFFLOAD_FAMILIES]
        return np.array(list(product(*axes)), dtype=float).reshape(-1, 4)

    def ckpt_options(self, num_layers: int) -> list[int]:
        if self.ckpt == "tune":
            return list(range(num_layers + 1))
        if self.ckpt == "all_or_none":
            return [0, num_layers]
        return [0] if self.ckpt == "none" else [num_layers]

    def device_shapes(self, nodes: int, gpus_per_node: int) -> list[DeviceShape]:
        """Stage device shapes: divisors of a node, and whole-node counts (divisors of N or powers of 2)."""
        shapes = []
        if self.partial_node_stages or nodes * gpus_per_node == gpus_per_node:
            shapes += [DeviceShape(1, g) for g in divisors(gpus_per_node) if g < gpus_per_node]
        counts = set(divisors(nodes)) | {2 ** e for e in range(nodes.bit_length()) if 2 ** e <= nodes}
        shapes += [DeviceShape(n, gpus_per_node) for n in sorted(counts)]
        return shapes

    def tp_options(self, shape: DeviceShape, heads: int) -> list[int]:
        within_node = shape.gpus
        options = [t for t in powers_of_two(within_node) if heads % t == 0 and shape.count % t == 0]
        if self.tp_degrees is not None:
            options = [t for t in options if t in self.tp_degrees]
        return options

    def stage_count_options(self, num_layers: int, world: int) -> list[int]:
        upper = min(num_layers, world, self.max_stages or world)
        counts = range(1, upper + 1)
        if self.stage_counts is not None:
            counts = [s for s in counts if s in self.stage_counts]
        return list(counts)

    def grad_accum_options(self, global_batch: int) -> list[int]:
        options = divisors(global_batch)
        if self.grad_accum is not None:
            options = [g for g in options if g in self.grad_accum]
        return options

    def micro_batch_allowed(self, micro_batch: np.ndarray) -> np.ndarray:
        if self.micro_batches is None:
            return np.ones_like(micro_batch, dtype=bool)
        return np.isin(micro_batch, np.array(self.micro_batches))

    def layers_allowed(self, num_layers: int, stages: int, total_layers: int) -> bool:
        if self.layer_slack is None:
            return True
        low = total_layers // stages - self.layer_slack
        high = -(-total_layers // stages) + self.layer_slack
        return low <= num_layers <= high

    def describe(self) -> str:
        offload = [f for f in OFFLOAD_FAMILIES if getattr(self, f"offload_{f}")]
        return (
            f"{self.name}: zero {list(self.zero_levels)}, ckpt {self.ckpt}, offload {offload or 'none'} "
            f"on {list(self.offload_grid)}, tp {list(self.tp_degrees) if self.tp_degrees else 'any'}, "
            f"micro-batch {list(self.micro_batches) if self.micro_batches else 'any'}, "
            f"devices {'uniform' if self.uniform_devices else 'any'}, "
            f"layers {'any split' if self.layer_slack is None else f'uniform +-{self.layer_slack}'}, "
            f"schedules {list(self.schedules)}"
            + (f" (v {list(self.virtual_stages)})" if "interleaved" in self.schedules else "") + ", "
            + f"sp {'tuned' if self.sequence_parallel else 'off'}, "
            f"per-tensor activations {'tuned' if self.per_tensor else 'off'}"
        )


def divisors(value: int) -> list[int]:
    """The divisors of ``value`` in increasing order (pairs up to its square root: a global batch of
    2**30 has 31 of them, found in 2**15 steps)."""
    small = [d for d in range(1, math.isqrt(value) + 1) if value % d == 0]
    return small + [value // d for d in reversed(small) if d * d != value]


def powers_of_two(limit: int) -> list[int]:
    return [2 ** e for e in range(limit.bit_length()) if 2 ** e <= limit]


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise TuneError(f"nodes must be >= 1, got {self.nodes}")
        if self.gpus_per_node < 1:
            raise TuneError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")


@dataclass(frozen=True)
class Workload:
    """What is trained: layer count, heads (TP must divide them), global batch, sequence length."""

    num_layers: int
    heads: int
    global_batch: int
    seq_len: int
    dtype: str = DEFAULT_DTYPE
    model_name: str = "model"
    extra: dict = field(default_factory=dict, compare=False)
    tied_embeddings: bool = False  # the head shares the embedding's weight: both ends never on one device group
