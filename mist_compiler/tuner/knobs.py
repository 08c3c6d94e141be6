"""Which knob settings (checkpointed layers, offload ratios) of each base are worth pricing exactly.

Work is kept small by exact-or-checked shortcuts, each relying on a property every sane cost model
has (``tests/test_tune_cli.py`` checks them on the real one):
- *bounds first*: a base whose fastest form (no knobs, memory ignored) cannot be part of a plan
  beating the incumbent is dropped before anything else is evaluated for it;
- *monotone knobs*: checkpointing or offloading more never makes a stage faster (exceptions are
  handled: checkpointing more shrinks offloaded-activation traffic, so with activation offload the
  midpoint and all-layers checkpoint counts are candidates too; an offload family that can lower
  stable or delta is found by probing and all its grid values stay candidates; weights offload
  needs a prefetch buffer, so "fits at all" is also tried without it), so a base that fits with
  no checkpointing and no offload needs nothing else, and one that does not fit with every knob at
  its maximum is dropped;
- *affine in-flight and checkpoint memory*: memory is predicted from corner evaluations (k = 1, 2;
  no and all layers checkpointed) and the result verified exactly later (``intra_stage``);
- *optimizer offload in closed form*: its memory is static, so it is interpolated linearly (an
  upper bound, memory being a maximum of affine terms) and each candidate gets the least ratio that
  fits instead of a grid value.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product

import numpy as np

from ..cost.stage_api import StageCostModel
from .space import Cluster, DeviceShape, SearchSpace
from .stage_configs import PP_BOTH, Bases, _fits, _knob_limits, evaluate, inflight_samples, peak_memory

@dataclass
class IncumbentBound:
    """The best iteration time found so far, used to drop configurations that cannot beat it."""

    grad_accum: int
    incumbent: float
    total_layers: int
    world: int
    cluster: Cluster | None = None
    stage_options: tuple[int, ...] = ()

    def work_bound(self, bases: Bases, fastest: np.ndarray, alive: np.ndarray, shapes: list[DeviceShape]) -> float:
        """``G * L * min(device-seconds per layer) / world``: every plan of this G takes at least this."""
        if not alive.any():
            return math.inf
        counts = np.array([s.count for s in shapes])[bases.shape]
        per_layer = fastest * counts / np.maximum(bases.layers, 1)
        return float(self.grad_accum * self.total_layers * per_layer[alive].min() / self.world)


def _candidate_knobs(model: StageCostModel, bases: Bases, shapes: list[DeviceShape], space: SearchSpace,
                     limit: float, stats: dict, bound: "IncumbentBound",
                     trade: list[int] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of (base index, ckpt layers, offload ratios [n, 4]) worth evaluating exactly.

    A base whose fastest form (no knobs) already gives ``G * stable >= incumbent`` is dropped: no
    plan using it can beat the best plan found so far.
    """
    combos = space.offload_combos()
    n = len(bases)
    low, high = _knob_limits(space, bases.layers)
    no_offload = np.zeros((n, 4))
    if trade is None:
        trade = _trade_families(model, bases, shapes, space, combos, low)
    stats["trade_families"] = list(trade)
    least_saving = evaluate(model, bases, shapes, low, no_offload, bases.max_inflight)
    fastest = least_saving.stable_s.astype(float)
    # the bounds use every base's fastest form, so they need no memory check first; only the
    # survivors are tested for fitting at all
    alive = bound.grad_accum * fastest < bound.incumbent
    alive &= _useful_bases(bases, fastest, alive, shapes, bound, stats)
    survivors = np.flatnonzero(alive)
    alive[survivors] = _fits_most_saving(model, bases.take(survivors), shapes, high[survivors], combos, limit)
    stats["work_bound"] = bound.work_bound(bases, fastest, alive, shapes)
    if stats["work_bound"] >= bound.incumbent:
        alive[:] = False
    easy = alive & _fits(least_saving.peak_memory_bytes, limit)
    tight = np.flatnonzero(alive & ~easy)
    stats["bases"] = stats.get("bases", 0) + n
    stats["bases_fit"] = stats.get("bases_fit", 0) + int(alive.sum())
    stats["bases_tight"] = stats.get("bases_tight", 0) + len(tight)
    easy_rows = np.flatnonzero(easy)
    rows = [easy_rows]
    ckpts = [low[easy_rows]]
    ratios = [np.zeros((len(easy_rows), 4))]
    for family in trade:  # a knob that can lower stable or delta: its grid values are candidates too
        for combo in np.flatnonzero((combos[:, family] > 0) & (np.delete(combos, family, axis=1) == 0).all(axis=1)):
            rows.append(easy_rows)
            ckpts.append(low[easy_rows])
            ratios.append(np.tile(combos[combo], (len(easy_rows), 1)))
    if len(tight):
        picked_base, picked_ckpt, picked_ratios = _minimal_knobs(model, bases.take(tight), shapes, space, combos, limit,
                                                                 trade, least_saving.peak_memory_bytes[tight])
        rows.append(tight[picked_base])
        ckpts.append(picked_ckpt)
        ratios.append(picked_ratios)
    return np.concatenate(rows), np.concatenate(ckpts), np.concatenate(ratios)


def _useful_bases(bases: Bases, fastest: np.ndarray, alive: np.ndarray, shapes: list[DeviceShape],
                  bound: IncumbentBound, stats: dict) -> np.ndarray:
    """Bases that can be part of a plan beating the incumbent, judged by each base's fastest time
    (no knobs, memory ignored). A plan holding base b (l layers on d devices, time t) takes at
    least ``(G-1) max(t, r) + t + (L - l) least_per_layer``: the other stages hold ``L - l`` layers,
    each costing at least the fastest per-layer time, and the slowest of them is at least their
    work over their ``W - d`` devices (``r``), at the least device-seconds per layer."""
    if not math.isfinite(bound.incumbent) or not alive.any():
        return np.ones(len(bases), dtype=bool)
    counts = np.array([s.count for s in shapes])[bases.shape].astype(float)
    layers = np.maximum(bases.layers, 1).astype(float)
    split = alive & (bases.pp != PP_BOTH)
    per_layer = float((fastest[split] / layers[split]).min()) if split.any() else math.inf
    device_seconds = float((fastest[split] * counts[split] / layers[split]).min()) if split.any() else math.inf
    rest_layers = bound.total_layers - bases.layers
    with np.errstate(divide="ignore", invalid="ignore"):
        rest_slowest = np.where(rest_layers > 0, rest_layers * device_seconds / (bound.world - counts), 0.0)
        rest_sum = np.where(rest_layers > 0, rest_layers * per_layer, 0.0)
    rest_slowest = np.where((rest_layers > 0) & (counts >= bound.world), np.inf, rest_slowest)
    slowest = np.maximum(fastest, rest_slowest) if bound.grad_accum > 1 else 0.0
    least = (bound.grad_accum - 1) * slowest + fastest + rest_sum
    return least < bound.incumbent


def _fits_most_saving(model: StageCostModel, bases: Bases, shapes: list[DeviceShape], high: np.ndarray,
                      combos: np.ndarray, limit: float) -> np.ndarray:
    """Fits one micro-batch with every knob at its maximum (weights offload also tried at 0: its
    prefetch buffer can cost more than it frees on a small stage)."""
    most = combos.max(axis=0)
    alive = _fits(peak_memory(model, bases, shapes, high, np.tile(most, (len(bases), 1)), 1), limit)
    if most[0] > 0:
        no_weights = most.copy()
        no_weights[0] = 0.0
        rest = np.flatnonzero(~alive)
        if len(rest):
            other = peak_memory(model, bases.take(rest), shapes, high[rest], np.tile(no_weights, (len(rest), 1)), 1)
            alive[rest[_fits(other, limit)]] = True
    return alive


def _trade_families(model: StageCostModel, bases: Bases, shapes: list[DeviceShape], space: SearchSpace,
                    combos: np.ndarray, low: np.ndarray, sample: int = 256) -> list[int]:
    """Offload families that can make stable or delta *smaller* (e.g. offloaded gradients move
    optimizer traffic out of delta), found by probing a sample of bases with each family at its
    largest ratio. Such a knob is a time trade-off, not only a memory saving, so no shortcut may
    assume its zero setting dominates."""
    if len(bases) == 0:
        return []
    pick = np.unique(np.linspace(0, len(bases) - 1, min(sample, len(bases))).astype(int))
    probe = bases.take(pick)
    plain = evaluate(model, probe, shapes, low[pick], np.zeros((len(pick), 4)), 1)
    trade = []
    for family in range(4):
        top = combos[:, family].max()
        if top <= 0:
            continue
        ratios = np.zeros((len(pick), 4))
        ratios[:, family] = top
        moved = evaluate(model, probe, shapes, low[pick], ratios, 1)
        if (moved.stable_s < plain.stable_s * (1 - 1e-9)).any() or (moved.delta_s < plain.delta_s * (1 - 1e-9)).any():
            trade.append(family)
    return trade


def _minimal_knobs(model: StageCostModel, tight: Bases, shapes: list[DeviceShape], space: SearchSpace,
                   combos: np.ndarray, limit: float, trade: list[int] = (),
                   deepest: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each tight base and in-flight count, the minimal (offload ratios, ckpt) settings that fit.

    Returns (base index, ckpt layers, offload ratios [n, 4]). ``deepest``: the bases' memory with no
    knobs at their largest in-flight count, if already evaluated.

    - *Optimizer states* only cost delta and their memory is static (the same in every program
      point), so they are not gridded: memory is evaluated with none and with all of them offloaded
      and interpolated linearly in between (memory is a maximum of affine terms, so the line lies
      above it: the ratio it gives always fits), and each candidate gets the least ratio that fits.
    - *Weights, gradients, activations* (whose memory is not linear: prefetch buffers, the order
      in which saved tensors are offloaded) stay on the grid; a family whose largest ratio frees no
      memory on a base (at its deepest in-flight count) is not offered there. For every grid point
      and every grid value of the optimizer ratio the smallest fitting checkpoint count is predicted
      from corner evaluations (ckpt none/max x k = 1, 2), then the optimizer ratio is lowered to the
      least that fits at that count. A grid point is kept only if lowering one of its ratios by a
      grid step would need strictly more checkpointing (the lower one fits with no more recompute
      and dominates it, knobs being monotone); trade-off families (``trade``) are exempt.
    """
    grids = [np.array(sorted(set(combos[:, f]))) for f in range(4)]
    opt_grid, rest_grid = grids[2], [grids[0], grids[1], grids[3]]
    opt_top = float(opt_grid[-1])
    n = len(tight)
    low_base, high_base = _knob_limits(space, tight.layers)
    if deepest is None:
        deepest = peak_memory(model, tight, shapes, low_base, np.zeros((n, 4)), tight.max_inflight)
    relevant = [_frees_memory(model, tight, shapes, low_base, family, float(grid[-1]), deepest)
                for family, grid in zip((0, 1, 3), rest_grid)]
    rest = np.array(list(product(*rest_grid)), dtype=float).reshape(-1, 3)  # (w, g, a) grid points
    grid_shape = tuple(len(g) for g in rest_grid)
    c = len(rest)
    # a grid point using a family that frees nothing on that base is never minimal
    useful_point = np.ones((n, c), dtype=bool)
    for axis in range(3):
        useful_point &= relevant[axis][:, None] | (rest[None, :, axis] == 0) | (axis_family(axis) in trade)
    pairs = np.flatnonzero(useful_point.ravel())
    base_of, point_of = pairs // c, pairs % c
    sub = tight.take(base_of)
    offload = np.zeros((len(pairs), 4))
    offload[:, 0], offload[:, 1], offload[:, 3] = rest[point_of, 0], rest[point_of, 1], rest[point_of, 2]
    low, high = low_base[base_of], high_base[base_of]
    # memory with none (False) and with all (True) of the optimizer states offloaded, summed over the program
    # points once for both (without optimizer offload, only the True corners, at ratio 0)
    opt_on = (True,) if opt_top <= 0 else (False, True)
    opt_values = tuple(opt_top if on else 0.0 for on in opt_on)
    # the most-saving corner first: pairs that do not fit even then need no other evaluation
    high1 = peak_memory(model, sub, shapes, high, offload, 1, opt_values).astype(float)
    top_high1 = high1[-1]
    alive = np.flatnonzero(_fits(top_high1, limit))
    corners = {}  # (opt offloaded?, ckpt corner, k) -> memory
    for i, on in enumerate(opt_on):
        corners[(on, "high", 1)] = np.full(len(sub), np.inf)
        corners[(on, "high", 1)][alive] = high1[i, alive]
    corners[(True, "high", 1)] = top_high1
    deep = alive[sub.max_inflight[alive] >= 2]  # stages that never hold two micro-batches need no k = 2 corner
    for corner, knob, k in (("low", low, 1), ("low", low, 2), ("high", high, 2)):
        rows = alive if k == 1 else deep
        found = peak_memory(model, sub.take(rows), shapes, knob[rows], offload[rows], k, opt_values)
        for i, on in enumerate(opt_on):
            values = corners[(on, corner, 1)].copy() if k == 2 else np.full(len(sub), np.inf)
            values[rows] = found[i]
            corners[(on, corner, k)] = values
    if opt_top <= 0:  # no optimizer offload: the "offloaded" corners are the plain ones
        for key in list(corners):
            corners[(False,) + key[1:]] = corners[key]
    span = np.maximum(high - low, 1).astype(float)
    picked_pair, picked_ckpt, picked_opt, picked_k = [], [], [], []
    samples = inflight_samples(int(sub.max_inflight.max()) if len(sub) else 1)
    for k in samples + [sub.max_inflight]:  # the sampled counts, then each base's own deepest
        active = sub.max_inflight >= k
        at_k = {}
        with np.errstate(invalid="ignore"):  # dead rows hold inf
            for opt_on in (False, True):
                for corner in ("low", "high"):
                    one, two = corners[(opt_on, corner, 1)], corners[(opt_on, corner, 2)]
                    at_k[(opt_on, corner)] = np.where(np.isfinite(two), one + (k - 1) * (two - one), np.inf)
        for opt_value in opt_grid:
            share = opt_value / opt_top if opt_top > 0 else 0.0
            with np.errstate(invalid="ignore"):  # dead rows hold inf
                m_low = (1 - share) * at_k[(False, "low")] + share * at_k[(True, "low")]
                m_high = (1 - share) * at_k[(False, "high")] + share * at_k[(True, "high")]
            ckpt = _needed_ckpt(space, m_low, m_high, span, high - low, limit)
            ok = active & np.isfinite(ckpt)
            cost = np.full((n, c), np.inf)
            cost[base_of, point_of] = np.where(ok, ckpt, np.inf)
            keep = _minimal_points(cost.reshape((n,) + grid_shape), [axis_family(a) in trade for a in range(3)])
            index = np.full((n, c), -1)
            index[base_of, point_of] = np.arange(len(pairs))
            chosen = index.ravel()[keep]
            chosen = chosen[chosen >= 0]
            picked_pair.append(chosen)
            picked_ckpt.append((low[chosen] + ckpt[chosen]).astype(int))
            picked_opt.append(np.full(len(chosen), float(opt_value)))
            picked_k.append(np.broadcast_to(np.asarray(k), (len(sub),))[chosen])
    pair = np.concatenate(picked_pair) if picked_pair else np.zeros(0, dtype=int)
    ckpts = np.concatenate(picked_ckpt) if picked_ckpt else np.zeros(0, dtype=int)
    opts = np.concatenate(picked_opt) if picked_opt else np.zeros(0)
    ks = np.concatenate(picked_k).astype(int) if picked_k else np.zeros(0, dtype=int)
    first = _first_of_each_row([pair, ckpts, np.round(opts * 1e6).astype(np.int64), ks])
    pair, ckpts, opts, ks = pair[first], ckpts[first], opts[first], ks[first]
    opts = _least_opt(model, sub, shapes, offload, pair, ckpts, opts, ks, opt_top, limit)
    if space.ckpt == "tune" and len(pair):
        # with activations offloaded, checkpointing more also means less to copy, so a stage can
        # get faster with more checkpointing: offer the midpoint and all-layers points as well
        offloading = (offload[pair, 3] > 0) & (ckpts < high[pair])
        extra = pair[offloading]
        middle = (ckpts[offloading] + high[extra] + 1) // 2
        pair = np.concatenate([pair, extra, extra])
        ckpts = np.concatenate([ckpts, middle, high[extra]])
        opts = np.concatenate([opts, opts[offloading], opts[offloading]])
    ratios = offload[pair].copy()
    ratios[:, 2] = opts
    first = _first_of_each_row([pair, ckpts, np.round(ratios[:, 2] * 1e6).astype(np.int64)])
    return base_of[pair[first]], ckpts[first], ratios[first]


def _first_of_each_row(columns: list[np.ndarray]) -> np.ndarray:
    """``np.unique(np.column_stack(columns), axis=0, return_index=True)[1]`` (each distinct row's first
    index, rows in lexicographic order) without the structured-array sort that made it a tenth of a
    knob search: a stable lexicographic sort of the integer columns, then where a row changes."""
    if not len(columns[0]):
        return np.zeros(0, dtype=np.int64)
    order = np.lexsort([np.asarray(column, dtype=np.int64) for column in reversed(columns)])
    changed = np.zeros(len(order), dtype=bool)
    changed[0] = True
    for column in columns:
        ordered = np.asarray(column, dtype=np.int64)[order]
        changed[1:] |= ordered[1:] != ordered[:-1]
    return order[changed]


def _least_opt(model: StageCostModel, sub: Bases, shapes: list[DeviceShape], offload: np.ndarray, pair: np.ndarray,
               ckpts: np.ndarray, opts: np.ndarray, ks: np.ndarray, opt_top: float, limit: float) -> np.ndarray:
    """Per candidate (grid optimizer ratio ``opts``, chosen for ``ks`` in-flight micro-batches) the least
    ratio that fits at its checkpoint count: memory evaluated there with none and with all optimizer
    states offloaded, interpolated linearly in between (an upper bound: memory is a maximum of affine
    terms). Where even all of them would not fit (a short checkpoint prediction) the grid value stays."""
    result = opts.copy()
    todo = np.flatnonzero(opts > 0)
    if opt_top <= 0 or len(todo) == 0:
        return result
    plain, offloaded = peak_memory(model, sub.take(pair[todo]), shapes, ckpts[todo], offload[pair[todo]], ks[todo],
                                   (0.0, opt_top))
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(plain > offloaded, (plain - limit * (1 - 1e-7)) / (plain - offloaded), 0.0)
    least = np.clip(np.where(np.isfinite(share), share, 1.0), 0.0, 1.0) * opt_top
    least = np.where(_fits(offloaded, limit), np.minimum(least, opts[todo]), opts[todo])
    result[todo] = np.where(least > 0, np.minimum(opt_top, np.ceil(least * 1e6) / 1e6), 0.0)  # rounded up: fits
    return result


def axis_family(axis: int) -> int:
    """Offload family of an axis of the (weights, grads, acts) grid."""
    return (0, 1, 3)[axis]


def _frees_memory(model: StageCostModel, bases: Bases, shapes: list[DeviceShape], ckpt: np.ndarray, family: int,
                  ratio: float, plain: np.ndarray) -> np.ndarray:
    """Per base: whether offloading ``family`` at ``ratio`` lowers peak memory (at its deepest in-flight count)."""
    if ratio <= 0:
        return np.zeros(len(bases), dtype=bool)
    moved = np.zeros((len(bases), 4))
    moved[:, family] = ratio
    return peak_memory(model, bases, shapes, ckpt, moved, bases.max_inflight) < plain * (1 - 1e-9)


def _needed_ckpt(space: SearchSpace, m_low: np.ndarray, m_high: np.ndarray, span: np.ndarray, room: np.ndarray,
                 limit: float) -> np.ndarray:
    """Checkpointed layers beyond the minimum that make memory fit (affine prediction; inf: none)."""
    if space.ckpt == "tune":
        with np.errstate(divide="ignore", invalid="ignore"):
            saving_per_layer = (m_low - m_high) / span
            needed = np.where(saving_per_layer > 0, (m_low - limit) / saving_per_layer, np.inf)
        ckpt = np.where(_fits(m_low, limit), 0.0, np.ceil(needed - 1e-9))
    else:
        ckpt = np.where(_fits(m_low, limit), 0.0, np.where(_fits(m_high, limit), room.astype(float), np.inf))
    return np.where((ckpt <= room) & _fits(m_high, limit), ckpt, np.inf)


def _minimal_points(cost: np.ndarray, exempt: list[bool]) -> np.ndarray:
    """Flat indices of grid points (axes 1..) whose cost is finite and not matched by a point one
    grid step lower on some non-exempt axis."""
    minimal = np.isfinite(cost)
    for axis in range(1, cost.ndim):
        if cost.shape[axis] < 2 or exempt[axis - 1]:
            continue
        lower = np.take(cost, np.arange(cost.shape[axis] - 1), axis=axis)
        upper = np.take(cost, np.arange(1, cost.shape[axis]), axis=axis)
        beaten = np.concatenate([np.zeros_like(np.take(minimal, [0], axis=axis)), lower <= upper], axis=axis)
        minimal &= ~beaten
    return np.flatnonzero(minimal.ravel())


