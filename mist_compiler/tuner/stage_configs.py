"""Stage configurations as the tuner enumerates them, and their evaluation in chunks.

A *base* is (layers, pipeline kind, device shape, TP, ZeRO) with the micro-batch a gradient-
accumulation count G implies; knobs (checkpointed layers, offload ratios) are added later. The pp
kind says which of the embedding (first stage) and the head (last stage) a stage holds.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..cost.stage_api import LOSS_CHOOSE, StageCandidates, StageCostModel, StageEstimates
from .space import Cluster, DeviceShape, SearchSpace, Workload

PP_NONE, PP_PRE, PP_POST, PP_BOTH = 0, 1, 2, 3
PP_NAMES = {PP_NONE: "middle", PP_PRE: "first", PP_POST: "last", PP_BOTH: "only"}
EVAL_CHUNK = 250_000
MEMORY_TOLERANCE = 1e-9  # relative slack against float rounding in the memory comparisons



@dataclass
class Bases:
    """Base configurations (no knobs yet) as parallel int arrays."""

    layers: np.ndarray
    pp: np.ndarray
    shape: np.ndarray
    tp: np.ndarray
    dp: np.ndarray
    micro_batch: np.ndarray
    zero: np.ndarray
    max_inflight: np.ndarray
    grad_accum: np.ndarray  # micro-batches per iteration (accumulators live between them)
    sp: np.ndarray  # 0/1: sequence parallelism with the stage's tensor parallelism
    policy: np.ndarray  # per-tensor activation policy of its layers (the cost model's index), -1: none

    @staticmethod
    def concat(parts: list["Bases"]) -> "Bases":
        return Bases(**{name: np.concatenate([getattr(p, name) for p in parts]) for name in Bases.__dataclass_fields__})

    def take(self, index: np.ndarray) -> "Bases":
        return Bases(**{name: getattr(self, name)[index] for name in self.__dataclass_fields__})

    def __len__(self) -> int:
        return len(self.layers)


def _candidates(bases: Bases, shapes: list[DeviceShape], ckpt: np.ndarray, offload: np.ndarray,
                inflight: np.ndarray | int):
    """The bases with knobs (``offload`` is [n, 4]) as stage candidates, in chunks of ``EVAL_CHUNK``."""
    n = len(bases)
    nodes = np.array([s.nodes for s in shapes])[bases.shape]
    gpus = np.array([s.gpus for s in shapes])[bases.shape]
    inflight_arr = np.broadcast_to(np.asarray(inflight), (n,))
    for start in range(0, n, EVAL_CHUNK):
        window = slice(start, min(n, start + EVAL_CHUNK))
        yield StageCandidates(
            num_layers=bases.layers[window], has_pre=(bases.pp[window] & 1).astype(bool),
            has_post=(bases.pp[window] >= PP_POST), nodes=nodes[window], gpus_per_node=gpus[window],
            micro_batch=bases.micro_batch[window], dp=bases.dp[window], tp=bases.tp[window],
            zero=bases.zero[window], ckpt_layers=ckpt[window],
            offload_weights=offload[window, 0], offload_grads=offload[window, 1],
            offload_opt=offload[window, 2], offload_acts=offload[window, 3], inflight=inflight_arr[window],
            grad_accum=bases.grad_accum[window], fused_loss=LOSS_CHOOSE,
            sp=bases.sp[window].astype(bool), act_policy=bases.policy[window],
        )


def evaluate(model: StageCostModel, bases: Bases, shapes: list[DeviceShape], ckpt: np.ndarray,
             offload: np.ndarray, inflight: np.ndarray | int) -> StageEstimates:
    """Evaluate bases with knobs (``offload`` is [n, 4]) in chunks; returns concatenated estimates."""
    if len(bases) == 0:
        empty = np.zeros(0)
        return StageEstimates(empty, empty, empty, {})
    parts = [estimate_totals(model, candidates) for candidates in _candidates(bases, shapes, ckpt, offload, inflight)]
    if len(parts) == 1:
        return parts[0]
    return StageEstimates(
        np.concatenate([p.stable_s for p in parts]), np.concatenate([p.delta_s for p in parts]),
        np.concatenate([p.peak_memory_bytes for p in parts]), {},
    )


def peak_memory(model: StageCostModel, bases: Bases, shapes: list[DeviceShape], ckpt: np.ndarray,
                offload: np.ndarray, inflight: np.ndarray | int, opt_ratios: tuple[float, ...] | None = None) -> np.ndarray:
    """``evaluate(...).peak_memory_bytes`` at a fraction of its cost (the model prices no time it need not);
    ``opt_ratios``: one row of peaks per optimizer-offload ratio, in place of ``offload[:, 2]``."""
    if len(bases) == 0:
        return np.zeros(0) if opt_ratios is None else np.zeros((len(opt_ratios), 0))
    return np.concatenate([_peak(model, candidates, opt_ratios)
                           for candidates in _candidates(bases, shapes, ckpt, offload, inflight)], axis=-1)


def estimate_totals(model: StageCostModel, candidates: StageCandidates) -> StageEstimates:
    """The model's ``totals`` (times and peaks, no breakdown) where it has one (it is optional), else ``evaluate``."""
    totals = getattr(model, "totals", None)
    return totals(candidates) if totals is not None else model.evaluate(candidates)


def _peak(model: StageCostModel, candidates: StageCandidates, opt_ratios: tuple[float, ...] | None = None) -> np.ndarray:
    """The model's ``peak_memory`` where it has one (it is optional), else its full evaluation's peak."""
    peak = getattr(model, "peak_memory", None)
    if peak is not None:
        return peak(candidates, opt_ratios)
    if opt_ratios is None:
        return model.evaluate(candidates).peak_memory_bytes
    rows = []
    for ratio in opt_ratios:
        candidates.offload_opt = np.full(len(candidates), float(ratio))
        rows.append(model.evaluate(candidates).peak_memory_bytes)
    return np.stack(rows)


def enumerate_bases(work: Workload, cluster: Cluster, space: SearchSpace, grad_accum: int,
                    max_stages: int, sequence_parallel: bool = False) -> tuple[Bases, list[DeviceShape]]:
    """All (layers, pp kind, shape, tp, zero, sp) with a whole micro-batch for this G (``sp`` on and
    off for every tp > 1 that divides the sequence when ``sequence_parallel``).

    With ``uniform_devices`` a shape of ``c`` devices serves only plans of ``S = world / c`` stages,
    so it needs only the layer counts such a plan can give a stage (``layer_slack`` narrows them)."""
    shapes = space.device_shapes(cluster.nodes, cluster.gpus_per_node)
    total = work.num_layers
    stage_options = set(space.stage_count_options(total, cluster.world))
    columns: dict[str, list[np.ndarray]] = {name: [] for name in Bases.__dataclass_fields__}
    zeros = np.array(sorted(space.zero_levels))
    for shape_index, shape in enumerate(shapes):
        if shape.count > cluster.world:
            continue
        layer_kinds = _layer_kinds(work, cluster, space, shape, max_stages, stage_options)
        for tp, sp in [(t, s) for t in space.tp_options(shape, work.heads)
                       for s in ((0, 1) if sequence_parallel and t > 1 and work.seq_len % t == 0 else (0,))]:
            dp = shape.count // tp
            if work.global_batch % (dp * grad_accum):
                continue
            micro = work.global_batch // (dp * grad_accum)
            if not space.micro_batch_allowed(np.array([micro]))[0]:
                continue
            for pp, layers in layer_kinds:
                if len(layers) == 0:
                    continue
                grid_layers, grid_zero = np.meshgrid(layers, zeros, indexing="ij")
                count = grid_layers.size
                inflight_cap = 1 if pp in (PP_POST, PP_BOTH) else max(1, min(max_stages - (pp == PP_NONE), grad_accum))
                columns["layers"].append(grid_layers.ravel())
                columns["zero"].append(grid_zero.ravel())
                columns["pp"].append(np.full(count, pp))
                columns["shape"].append(np.full(count, shape_index))
                columns["tp"].append(np.full(count, tp))
                columns["dp"].append(np.full(count, dp))
                columns["micro_batch"].append(np.full(count, micro))
                columns["max_inflight"].append(np.full(count, inflight_cap))
                columns["grad_accum"].append(np.full(count, grad_accum))
                columns["sp"].append(np.full(count, sp))
                columns["policy"].append(np.full(count, -1))
    if not columns["layers"]:
        empty = np.zeros(0, dtype=int)
        return Bases(*(empty for _ in Bases.__dataclass_fields__)), shapes
    bases = Bases(**{name: np.concatenate(parts).astype(int) for name, parts in columns.items()})
    return bases, shapes


def _layer_kinds(work: Workload, cluster: Cluster, space: SearchSpace, shape: DeviceShape, max_stages: int,
                 stage_options: set[int]) -> list[tuple[int, np.ndarray]]:
    """Per pp kind, the layer counts a stage on ``shape`` can hold."""
    total = work.num_layers
    kinds = [(PP_NONE, np.arange(1, total - 1) if max_stages >= 3 else np.zeros(0, dtype=int)),
             (PP_PRE, np.arange(1, total) if max_stages >= 2 else np.zeros(0, dtype=int)),
             (PP_POST, np.arange(1, total) if max_stages >= 2 else np.zeros(0, dtype=int)),
             (PP_BOTH, np.array([total]))]
    if not space.uniform_devices:
        return kinds
    stages = cluster.world // shape.count
    if cluster.world % shape.count or stages not in stage_options:
        return []
    allowed = np.array([l for l in range(1, total + 1) if space.layers_allowed(l, stages, total)], dtype=int)
    if stages == 1:
        return [(PP_BOTH, np.array([total]))]
    middle = allowed[allowed <= total - 2] if stages >= 3 else np.zeros(0, dtype=int)
    ends = allowed[allowed <= total - 1]
    return [(PP_NONE, middle), (PP_PRE, ends), (PP_POST, ends)]


def _fits(memory: np.ndarray, limit: float) -> np.ndarray:
    return memory <= limit * (1 + MEMORY_TOLERANCE)


def inflight_samples(largest: int) -> list[int]:
    """In-flight counts that get their own frontier: every k up to 8, then about 25% apart.

    A stage that needs an unsampled k uses the points of the sampled k below it that fit k
    (each point's exact capacity is known), so this costs optimality at most, never validity."""
    samples = set(range(1, min(8, largest) + 1))
    value = 8.0
    while value < largest:
        value *= 1.25
        samples.add(min(largest, int(round(value))))
    samples.add(largest)
    return sorted(k for k in samples if k >= 1)


def _knob_limits(space: SearchSpace, layers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    low = layers if space.ckpt == "all" else np.zeros_like(layers)
    high = np.zeros_like(layers) if space.ckpt == "none" else layers
    return low, high


class CountingModel:
    """Passes evaluations through to a cost model, counting the candidates priced."""

    def __init__(self, model: StageCostModel) -> None:
        self.model = model
        self.device_memory_bytes = model.device_memory_bytes
        self.rows = 0

    def evaluate(self, candidates: StageCandidates) -> StageEstimates:
        self.rows += len(candidates)
        return self.model.evaluate(candidates)

    def totals(self, candidates: StageCandidates) -> StageEstimates:
        self.rows += len(candidates)
        return estimate_totals(self.model, candidates)

    def peak_memory(self, candidates: StageCandidates, opt_ratios: tuple[float, ...] | None = None) -> np.ndarray:
        self.rows += len(candidates) * (1 if opt_ratios is None else len(opt_ratios))
        return _peak(self.model, candidates, opt_ratios)


