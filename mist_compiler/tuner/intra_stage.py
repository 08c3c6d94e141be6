"""Intra-stage tuning: per stage cell, the Pareto frontier of (stable, delta) under the memory limit.

A cell is (layers, pre/post kind, device shape, in-flight micro-batches) for one
gradient-accumulation count ``G`` (which fixes each stage's micro-batch as
``global_batch / (dp * G)``). Inside a cell the free choices are TP (hence DP and micro-batch),
ZeRO level, checkpointed layers and the four offload ratios (``knobs`` picks which settings to
price). Candidates are then evaluated exactly: times and memory at one in-flight micro-batch, the
memory slope at the stage's largest in-flight count, the capacity verified (bisected where memory
is convex rather than affine in k), and the checkpoint count raised where a prediction fell short.

Kept per G: every row on the frontier of a sampled in-flight count (``cells``, what the even-split
heuristic and ``mistc explain`` read) and every row no other row of its cell beats in stable, delta
and capacity at once (what the partition DP needs for in-flight counts between the samples).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import numpy as np

from ..cost.stage_api import LOSS_CHOOSE, StageCandidates, StageCostModel
from .knobs import IncumbentBound, _candidate_knobs
from .space import Cluster, DeviceShape, SearchSpace, Workload
from .stage_configs import (
    MEMORY_TOLERANCE,
    PP_POST,
    Bases,
    CountingModel,
    _fits,
    _knob_limits,
    enumerate_bases,
    evaluate,
    inflight_samples,
    peak_memory,
)


@dataclass
class FrontierTable:
    """Pareto points of every cell for one G. ``cells`` maps (layers, pp, shape, k) -> row indices."""

    grad_accum: int
    shapes: list[DeviceShape]
    configs: StageCandidates  # inflight field holds 1; use memory_at for other k
    stable: np.ndarray
    delta: np.ndarray
    memory_k1: np.ndarray
    memory_per_inflight: np.ndarray
    cells: dict[tuple[int, int, int, int], np.ndarray]
    fit_k: np.ndarray  # per row: the most in-flight micro-batches it fits (verified)
    stats: dict = field(default_factory=dict)

    def memory_at(self, rows: np.ndarray, inflight: int) -> np.ndarray:
        return self.memory_k1[rows] + (inflight - 1) * self.memory_per_inflight[rows]

    def entries(self) -> dict[str, np.ndarray]:
        """The cells flattened: one entry per (cell, member row), as arrays (built once)."""
        if "_entries" not in self.stats:
            keys = list(self.cells)
            sizes = np.array([len(self.cells[key]) for key in keys], dtype=int)
            columns = np.array(keys, dtype=int).reshape(-1, 4)
            flat = {name: np.repeat(columns[:, i], sizes) for i, name in enumerate(("layers", "pp", "shape", "k"))}
            flat["row"] = np.concatenate([self.cells[key] for key in keys]) if keys else np.zeros(0, dtype=int)
            flat["k"] = self.fit_k[flat["row"]]  # a row's real capacity, not just its cell's
            self.stats["_entries"] = flat
        return self.stats["_entries"]

    def cell(self, layers: int, pp: int, shape: int, inflight: int) -> np.ndarray:
        """Frontier rows of a cell that fit ``inflight`` (from the nearest sampled k at or below it)."""
        for k in range(inflight, 0, -1):
            members = self.cells.get((layers, pp, shape, k))
            if members is not None:
                return members[self.fit_k[members] >= inflight]
        return np.zeros(0, dtype=int)


def pareto_mask(group: np.ndarray, stable: np.ndarray, delta: np.ndarray, tiebreak: np.ndarray) -> np.ndarray:
    """Vectorised per-group Pareto filter on (stable, delta), lower is better; one point per tie."""
    if len(group) == 0:
        return np.zeros(0, dtype=bool)
    order = np.lexsort((tiebreak, delta, stable, group))
    keep = np.zeros(len(group), dtype=bool)
    keep[order[_pareto_sorted(group[order], delta[order])]] = True
    return keep


def _pareto_sorted(group: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """Pareto mask for points already sorted by (group, stable, delta): keep strict new delta minima."""
    if len(group) == 0:
        return np.zeros(0, dtype=bool)
    new_group = np.ones(len(group), dtype=bool)
    new_group[1:] = group[1:] != group[:-1]
    # running minimum of delta restarting at each group: offset groups so later ones lie far below
    span = float(np.ptp(delta)) + 1.0
    shifted = delta - (np.cumsum(new_group) - 1) * span * 4
    running = np.minimum.accumulate(shifted)
    previous = np.empty_like(running)
    previous[0] = np.inf
    previous[1:] = running[:-1]
    return new_group | (shifted < previous - 1e-15 * span)


def _thin(indices: np.ndarray, stable: np.ndarray, limit: int) -> np.ndarray:
    """At most ``limit`` points of one frontier (sorted by stable), spread along it, both ends kept."""
    ordered = indices[np.argsort(stable[indices], kind="stable")]
    if len(ordered) <= limit:
        return ordered
    picks = np.unique(np.round(np.linspace(0, len(ordered) - 1, limit)).astype(int))
    return ordered[picks]


def build_frontiers(model: StageCostModel, work: Workload, cluster: Cluster, space: SearchSpace,
                    grad_accum: int, max_stages: int, incumbent: float = math.inf,
                    trade: list[int] | None = None,
                    activation_policies: Callable[[int, bool], list[int]] | None = None) -> FrontierTable:
    """Evaluate every stage configuration for this G and keep each cell's Pareto frontier.

    ``trade``: the offload families found to lower stable or delta (``stats['trade_families']`` of
    an earlier table of the same model), to skip probing again. ``activation_policies(tp, sp)``: the
    per-tensor policies (the layer's activation frontier, cost-model indices) a base that needs
    checkpointing or activation offload also tries, in place of activation offload."""
    stats: dict = {"grad_accum": grad_accum}
    model = CountingModel(model)
    options = tuple(space.stage_count_options(work.num_layers, cluster.world))
    bound = IncumbentBound(grad_accum, incumbent, work.num_layers, cluster.world, cluster, options)
    limit = float(model.device_memory_bytes)
    sequence_parallel = space.sequence_parallel and bool(getattr(model.model, "sp_supported", False))
    bases, shapes = enumerate_bases(work, cluster, space, grad_accum, max_stages, sequence_parallel)
    rows, ckpt, offload = _candidate_knobs(model, bases, shapes, space, limit, stats, bound, trade) if len(bases) else (
        np.zeros(0, dtype=int), np.zeros(0, dtype=int), np.zeros((0, 4)))
    table_bases = bases.take(rows)
    exact = _exact(model, table_bases, shapes, space, ckpt, offload, limit, stats)
    if activation_policies is not None and len(rows):
        variants = _policy_variants(bases, rows, ckpt, offload, activation_policies)
        if len(variants):
            more, more_ckpt, more_offload = _candidate_knobs(model, variants, shapes, space, limit, stats, bound, trade)
            stats["policy_bases"] = stats.get("policy_bases", 0) + len(variants)
            variant_bases = variants.take(more)
            more_exact = _exact(model, variant_bases, shapes, space, more_ckpt, more_offload, limit, stats)
            table_bases = Bases.concat([table_bases, variant_bases])
            offload = np.concatenate([offload, more_offload])
            exact = ExactRows(*(np.concatenate([a, b]) for a, b in zip(exact, more_exact)))
    ckpt, stable, delta, mem1, slope, fit_k = exact
    rows = np.arange(len(table_bases))
    stats["candidates_exact"] = len(rows)
    cells = _frontier_cells(table_bases, fit_k, stable, delta, mem1, space.max_frontier_points, stats)
    keep = np.unique(np.concatenate(list(cells.values()) + [np.flatnonzero(_capacity_pareto(table_bases, fit_k, stable, delta))]))
    if not cells:
        keep = np.zeros(0, dtype=int)
    remap = np.full(len(rows), -1)
    remap[keep] = np.arange(len(keep))
    cells = {key: remap[value] for key, value in cells.items()}
    kept = table_bases.take(keep)
    nodes = np.array([s.nodes for s in shapes], dtype=int)
    gpus = np.array([s.gpus for s in shapes], dtype=int)
    configs = StageCandidates(
        num_layers=kept.layers, has_pre=(kept.pp & 1).astype(bool), has_post=kept.pp >= PP_POST,
        nodes=nodes[kept.shape] if len(keep) else np.zeros(0, int), gpus_per_node=gpus[kept.shape] if len(keep) else np.zeros(0, int),
        micro_batch=kept.micro_batch, dp=kept.dp, tp=kept.tp, zero=kept.zero, ckpt_layers=ckpt[keep],
        offload_weights=offload[keep, 0], offload_grads=offload[keep, 1], offload_opt=offload[keep, 2],
        offload_acts=offload[keep, 3], inflight=np.ones(len(keep), dtype=int), grad_accum=kept.grad_accum,
        fused_loss=LOSS_CHOOSE, sp=kept.sp.astype(bool), act_policy=kept.policy,
    ) if len(keep) else None
    stats["frontier_points"] = len(keep)
    stats["evaluated"] = model.rows
    stats["cells"] = len(cells)
    return FrontierTable(
        grad_accum=grad_accum, shapes=shapes, configs=configs, stable=stable[keep], delta=delta[keep],
        memory_k1=mem1[keep], memory_per_inflight=slope[keep], cells=cells, fit_k=fit_k[keep], stats=stats,
    )


class ExactRows(NamedTuple):
    """Candidates priced exactly: checkpoint counts (raised where a prediction fell short), times and
    memory at one in-flight micro-batch, memory per extra one, and the verified in-flight capacity."""

    ckpt: np.ndarray
    stable: np.ndarray
    delta: np.ndarray
    memory_k1: np.ndarray
    slope: np.ndarray
    fit_k: np.ndarray


def _exact(model: StageCostModel, bases: Bases, shapes: list[DeviceShape], space: SearchSpace, ckpt: np.ndarray,
           offload: np.ndarray, limit: float, stats: dict) -> ExactRows:
    """Exact evaluation at k = 1 (times, memory) and, for stages that can hold more than one micro-batch,
    at their largest k (memory slope); the checkpoint count raised where a prediction fell short."""
    ckpt = ckpt.copy()
    first = evaluate(model, bases, shapes, ckpt, offload, 1)
    mem1 = first.peak_memory_bytes.astype(float)
    _, high = _knob_limits(space, bases.layers)
    slope = _inflight_slope(model, bases, shapes, ckpt, offload, mem1, np.arange(len(bases)))
    for _ in range(3):
        short = ~_fits(mem1, limit) & (ckpt < high) if space.ckpt == "tune" else np.zeros(len(ckpt), bool)
        if not short.any():
            break
        ckpt[short] += 1
        redo_rows = np.flatnonzero(short)
        redo = evaluate(model, bases.take(redo_rows), shapes, ckpt[short], offload[short], 1)
        first.stable_s[short] = redo.stable_s
        first.delta_s[short] = redo.delta_s
        mem1[short] = redo.peak_memory_bytes
        slope[short] = _inflight_slope(model, bases, shapes, ckpt, offload, mem1, redo_rows)
    with np.errstate(divide="ignore", invalid="ignore"):
        fit_k = np.where(slope > 0, np.floor((limit * (1 + MEMORY_TOLERANCE) - mem1) / slope) + 1, np.inf)
    fit_k = np.where(_fits(mem1, limit), np.minimum(fit_k, bases.max_inflight), 0).astype(int)
    fit_k = _verify_fit(model, bases, shapes, ckpt, offload, fit_k, limit, stats)
    return ExactRows(ckpt, first.stable_s.astype(float), first.delta_s.astype(float), mem1, slope, fit_k)


def _policy_variants(bases: Bases, rows: np.ndarray, ckpt: np.ndarray, offload: np.ndarray,
                     policies: Callable[[int, bool], list[int]]) -> Bases:
    """The bases that needed checkpointing or activation offload, once per per-tensor policy of their
    layer's frontier (plain activation offload then only for the checkpointed layers' inputs)."""
    needing = np.unique(rows[(ckpt > 0) | (offload[:, 3] > 0)])
    tried = bases.take(needing)
    variants = []
    for tp, sp in sorted(set(zip(tried.tp.tolist(), tried.sp.tolist()))):
        mode = np.flatnonzero((tried.tp == tp) & (tried.sp == sp))
        for index in policies(int(tp), bool(sp)):
            variant = tried.take(mode)
            variant.policy = np.full(len(mode), index)
            variants.append(variant)
    return Bases.concat(variants) if variants else bases.take(np.zeros(0, dtype=int))


def _inflight_slope(model: StageCostModel, bases: Bases, shapes: list[DeviceShape], ckpt: np.ndarray,
                    offload: np.ndarray, mem1: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Memory per extra in-flight micro-batch of ``rows``, from an evaluation at their largest k."""
    slope = np.zeros(len(rows))
    deep = np.flatnonzero(bases.max_inflight[rows] >= 2)
    if len(deep):
        picked = rows[deep]
        k = bases.max_inflight[picked]
        top = peak_memory(model, bases.take(picked), shapes, ckpt[picked], offload[picked], k)
        slope[deep] = np.maximum((top - mem1[picked]) / (k - 1), 0.0)
    return slope


def _verify_fit(model: StageCostModel, bases: Bases, shapes: list[DeviceShape], ckpt: np.ndarray,
                offload: np.ndarray, fit_k: np.ndarray, limit: float, stats: dict) -> np.ndarray:
    """Check the extrapolated in-flight capacity exactly at its value; where it does not fit (memory
    convex rather than affine in k), bisect between 2 (evaluated exactly) and the failed value."""
    fit_k = fit_k.copy()
    claim = np.flatnonzero(fit_k >= 3)
    if len(claim) == 0:
        return fit_k
    check = peak_memory(model, bases.take(claim), shapes, ckpt[claim], offload[claim], fit_k[claim])
    failed = claim[~_fits(check, limit)]
    stats["fit_corrections"] = stats.get("fit_corrections", 0) + len(failed)
    low, high = np.full(len(failed), 2), fit_k[failed].copy()
    while len(failed) and (high - low > 1).any():
        active = high - low > 1
        mid = (low + high) // 2
        rows = failed[active]
        probe = peak_memory(model, bases.take(rows), shapes, ckpt[rows], offload[rows], mid[active])
        ok = _fits(probe, limit)
        low[np.flatnonzero(active)[ok]] = mid[active][ok]
        high[np.flatnonzero(active)[~ok]] = mid[active][~ok]
    fit_k[failed] = low
    return fit_k


def _capacity_pareto(bases: Bases, fit_k: np.ndarray, stable: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """Rows no other row of their (layers, pp, shape) beats in stable, delta and in-flight capacity at
    once: every row some in-flight need can use (the partition DP takes any need, not only the
    sampled ones, so none of these may be lost between samples)."""
    keep = np.zeros(len(fit_k), dtype=bool)
    if len(fit_k) == 0:
        return keep
    shape_span = int(bases.shape.max()) + 1
    group = (bases.layers.astype(np.int64) * 4 + bases.pp) * shape_span + bases.shape
    order = np.lexsort((delta, stable, group))  # sorted once; each level keeps a subsequence
    ordered_fit = fit_k[order]
    for level in np.unique(fit_k[fit_k >= 1])[::-1]:
        members = order[ordered_fit >= level]
        front = members[_pareto_sorted(group[members], delta[members])]
        keep[front[fit_k[front] == level]] = True
    return keep


def _frontier_cells(bases: Bases, fit_k: np.ndarray, stable: np.ndarray, delta: np.ndarray,
                    memory: np.ndarray, max_points: int, stats: dict) -> dict[tuple[int, int, int, int], np.ndarray]:
    cells: dict[tuple[int, int, int, int], np.ndarray] = {}
    if len(fit_k) == 0:
        return cells
    shape_span = int(bases.shape.max()) + 1
    group = (bases.layers.astype(np.int64) * 4 + bases.pp) * shape_span + bases.shape
    order = np.lexsort((memory, delta, stable, group))
    sorted_group, sorted_delta, sorted_fit = group[order], delta[order], fit_k[order]
    thinned = 0
    for k in inflight_samples(int(fit_k.max())):
        members = np.flatnonzero(sorted_fit >= k)
        keep = order[members[_pareto_sorted(sorted_group[members], sorted_delta[members])]]
        splits = np.flatnonzero(np.diff(group[keep])) + 1
        for chunk in np.split(keep, splits):
            if len(chunk) == 0:
                continue
            thinned += max(0, len(chunk) - max_points)
            row = chunk[0]
            key = (int(bases.layers[row]), int(bases.pp[row]), int(bases.shape[row]), k)
            cells[key] = _thin(chunk, stable, max_points)
    stats["points_thinned"] = thinned
    return cells


