"""Intra-stage tuning: per stage cell, the Pareto frontier of (stable, delta) under the memory limit.

A cell is (layers, pre/post kind, device shape, in-flight micro-batches) for one
gradient-accumulation count ``G`` (which fixes each stage's micro-batch as
``global_batch / (dp * G)``). Inside a cell the free choices are TP (hence DP and micro-batch),
ZeRO level, checkpointed layers and the four offload ratios; all are evaluated vectorised.

Work is kept small by three exact-or-checked shortcuts, each relying on a property every sane
cost model has (the tests check them on the real one):
- *monotone knobs*: checkpointing or offloading more never makes a stage faster (exceptions are
  handled: checkpointing more shrinks offloaded-activation traffic, so with activation offload
  on the midpoint and all-layers checkpoint counts are candidates too; an offload family that
  can lower stable or delta — offloaded gradients move work out of delta — is found by probing
  and all its grid values stay candidates; weights offload needs a prefetch buffer, so
  "fits at all" is also tried without it), so a base
  configuration (layers, devices, TP, ZeRO) that fits with no checkpointing and no offload needs
  nothing else, and one that does not fit with every knob at its maximum is dropped;
- *affine in-flight memory*: peak memory is affine in the in-flight micro-batch count (one more
  micro-batch of saved activations), so two evaluations (k = 1, 2) give every k;
- *affine checkpoint memory*: the smallest checkpointed-layer count that fits is predicted from the
  corners (0 and all layers, k = 1 and 2) and then verified exactly (and raised while it does not fit).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import product

import numpy as np

from ..cost.stage_api import StageCandidates, StageCostModel, StageEstimates
from .space import Cluster, DeviceShape, SearchSpace, Workload

PP_NONE, PP_PRE, PP_POST, PP_BOTH = 0, 1, 2, 3
PP_NAMES = {PP_NONE: "middle", PP_PRE: "first", PP_POST: "last", PP_BOTH: "only"}
EVAL_CHUNK = 250_000
OFFLOAD_NAMES = ("weights", "grads", "opt", "acts")
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

    def take(self, index: np.ndarray) -> "Bases":
        return Bases(**{name: getattr(self, name)[index] for name in self.__dataclass_fields__})

    def __len__(self) -> int:
        return len(self.layers)


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


def evaluate(model: StageCostModel, bases: Bases, shapes: list[DeviceShape], ckpt: np.ndarray,
             offload: np.ndarray, inflight: np.ndarray | int) -> StageEstimates:
    """Evaluate bases with knobs (``offload`` is [n, 4]) in chunks; returns concatenated estimates."""
    n = len(bases)
    if n == 0:
        empty = np.zeros(0)
        return StageEstimates(empty, empty, empty, {})
    nodes = np.array([s.nodes for s in shapes])[bases.shape]
    gpus = np.array([s.gpus for s in shapes])[bases.shape]
    inflight_arr = np.broadcast_to(np.asarray(inflight), (n,))
    parts = []
    for start in range(0, n, EVAL_CHUNK):
        window = slice(start, min(n, start + EVAL_CHUNK))
        candidates = StageCandidates(
            num_layers=bases.layers[window], has_pre=(bases.pp[window] & 1).astype(bool),
            has_post=(bases.pp[window] >= PP_POST), nodes=nodes[window], gpus_per_node=gpus[window],
            micro_batch=bases.micro_batch[window], dp=bases.dp[window], tp=bases.tp[window],
            zero=bases.zero[window], ckpt_layers=ckpt[window],
            offload_weights=offload[window, 0], offload_grads=offload[window, 1],
            offload_opt=offload[window, 2], offload_acts=offload[window, 3], inflight=inflight_arr[window],
            grad_accum=bases.grad_accum[window],
        )
        parts.append(model.evaluate(candidates))
    if len(parts) == 1:
        return parts[0]
    return StageEstimates(
        np.concatenate([p.stable_s for p in parts]), np.concatenate([p.delta_s for p in parts]),
        np.concatenate([p.peak_memory_bytes for p in parts]), {},
    )


def enumerate_bases(work: Workload, cluster: Cluster, space: SearchSpace, grad_accum: int,
                    max_stages: int) -> tuple[Bases, list[DeviceShape]]:
    """All (layers, pp kind, shape, tp, zero) with a whole micro-batch for this G.

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
        for tp in space.tp_options(shape, work.heads):
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
                                                                 trade)
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
    alive = _fits(evaluate(model, bases, shapes, high, np.tile(most, (len(bases), 1)), 1).peak_memory_bytes, limit)
    if most[0] > 0:
        no_weights = most.copy()
        no_weights[0] = 0.0
        rest = np.flatnonzero(~alive)
        if len(rest):
            other = evaluate(model, bases.take(rest), shapes, high[rest], np.tile(no_weights, (len(rest), 1)), 1)
            alive[rest[_fits(other.peak_memory_bytes, limit)]] = True
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
                   combos: np.ndarray, limit: float, trade: list[int] = ()) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each tight base and in-flight count, the minimal (offload ratios, ckpt) settings that fit.

    Returns (base index, ckpt layers, offload ratios [n, 4]).

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
    deepest = evaluate(model, tight, shapes, low_base, np.zeros((n, 4)), tight.max_inflight).peak_memory_bytes
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
    moved = offload.copy()
    moved[:, 2] = opt_top
    # the most-saving corner first: pairs that do not fit even then need no other evaluation
    top_high1 = evaluate(model, sub, shapes, high, moved, 1).peak_memory_bytes.astype(float)
    alive = np.flatnonzero(_fits(top_high1, limit))
    part = sub.take(alive)
    corners = {}  # (opt offloaded?, ckpt corner, k) -> memory
    for opt_on, ratios in ((False, offload), (True, moved)):
        for corner, knob in (("low", low), ("high", high)):
            for k in (1, 2):
                if opt_on and corner == "high" and k == 1:
                    corners[(True, "high", 1)] = top_high1
                    continue
                if not opt_on and opt_top <= 0:
                    continue
                values = np.full(len(sub), np.inf)
                values[alive] = evaluate(model, part, shapes, knob[alive], ratios[alive], k).peak_memory_bytes
                corners[(opt_on, corner, k)] = values
    if opt_top <= 0:  # no optimizer offload: the "offloaded" corners are the plain ones
        for key in list(corners):
            corners[(False,) + key[1:]] = corners[key]
    span = np.maximum(high - low, 1).astype(float)
    picked_pair, picked_ckpt, picked_opt = [], [], []
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
            counts = ckpt[chosen]
            picked_pair.append(chosen)
            picked_ckpt.append((low[chosen] + counts).astype(int))
            picked_opt.append(_least_opt(at_k, chosen, counts, span, limit, opt_value, opt_top))
    pair = np.concatenate(picked_pair) if picked_pair else np.zeros(0, dtype=int)
    ckpts = np.concatenate(picked_ckpt) if picked_ckpt else np.zeros(0, dtype=int)
    opts = np.concatenate(picked_opt) if picked_opt else np.zeros(0)
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
    ratios[:, 2] = np.where(opts > 0, np.minimum(opt_top, np.ceil(opts * 1e6) / 1e6), 0.0)  # rounded up: still fits
    key = np.column_stack([pair, ckpts, np.round(ratios[:, 2] * 1e6).astype(np.int64)])
    _, first = np.unique(key, axis=0, return_index=True)
    return base_of[pair[first]], ckpts[first], ratios[first]


def _least_opt(at_k: dict, chosen: np.ndarray, counts: np.ndarray, span: np.ndarray, limit: float,
               opt_value: float, opt_top: float) -> np.ndarray:
    """The least optimizer-offload ratio (<= ``opt_value``) that fits at the chosen checkpoint
    counts: memory is interpolated linearly between no and all optimizer states offloaded."""
    if opt_top <= 0 or len(chosen) == 0:
        return np.zeros(len(chosen))
    fraction = counts / span[chosen]

    def at_count(opt_on: bool) -> np.ndarray:
        low, high = at_k[(opt_on, "low")][chosen], at_k[(opt_on, "high")][chosen]
        return low - fraction * (low - high)

    plain, offloaded = at_count(False), at_count(True)
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(plain > offloaded, (plain - limit * (1 - 1e-7)) / (plain - offloaded), 0.0)
    least = np.clip(np.where(np.isfinite(share), share, opt_value / opt_top), 0.0, 1.0) * opt_top
    return np.minimum(least, opt_value)


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
    return evaluate(model, bases, shapes, ckpt, moved, bases.max_inflight).peak_memory_bytes < plain * (1 - 1e-9)


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


class CountingModel:
    """Passes evaluations through to a cost model, counting the candidates priced."""

    def __init__(self, model: StageCostModel) -> None:
        self.model = model
        self.device_memory_bytes = model.device_memory_bytes
        self.rows = 0

    def evaluate(self, candidates: StageCandidates) -> StageEstimates:
        self.rows += len(candidates)
        return self.model.evaluate(candidates)


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


def build_frontiers(model: StageCostModel, work: Workload, cluster: Cluster, space: SearchSpace,
                    grad_accum: int, max_stages: int, incumbent: float = math.inf,
                    trade: list[int] | None = None) -> FrontierTable:
    """Evaluate every stage configuration for this G and keep each cell's Pareto frontier.

    ``trade``: the offload families found to lower stable or delta (``stats['trade_families']`` of
    an earlier table of the same model), to skip probing again."""
    stats: dict = {"grad_accum": grad_accum}
    model = CountingModel(model)
    options = tuple(space.stage_count_options(work.num_layers, cluster.world))
    bound = IncumbentBound(grad_accum, incumbent, work.num_layers, cluster.world, cluster, options)
    limit = float(model.device_memory_bytes)
    bases, shapes = enumerate_bases(work, cluster, space, grad_accum, max_stages)
    rows, ckpt, offload = _candidate_knobs(model, bases, shapes, space, limit, stats, bound, trade) if len(bases) else (
        np.zeros(0, dtype=int), np.zeros(0, dtype=int), np.zeros((0, 4)))
    table_bases = bases.take(rows)
    ckpt = ckpt.copy()
    # exact evaluation at k = 1 (times, memory) and, for stages that can hold more than one
    # micro-batch, at their largest k (memory slope); raise the checkpoint count where a
    # prediction fell short
    first = evaluate(model, table_bases, shapes, ckpt, offload, 1)
    mem1 = first.peak_memory_bytes.astype(float)
    _, high = _knob_limits(space, table_bases.layers)
    slope = _inflight_slope(model, table_bases, shapes, ckpt, offload, mem1, np.arange(len(rows)))
    for _ in range(3):
        short = ~_fits(mem1, limit) & (ckpt < high) if space.ckpt == "tune" else np.zeros(len(ckpt), bool)
        if not short.any():
            break
        ckpt[short] += 1
        redo_rows = np.flatnonzero(short)
        redo = evaluate(model, table_bases.take(redo_rows), shapes, ckpt[short], offload[short], 1)
        first.stable_s[short] = redo.stable_s
        first.delta_s[short] = redo.delta_s
        mem1[short] = redo.peak_memory_bytes
        slope[short] = _inflight_slope(model, table_bases, shapes, ckpt, offload, mem1, redo_rows)
    with np.errstate(divide="ignore", invalid="ignore"):
        fit_k = np.where(slope > 0, np.floor((limit * (1 + MEMORY_TOLERANCE) - mem1) / slope) + 1, np.inf)
    fit_k = np.where(_fits(mem1, limit), np.minimum(fit_k, table_bases.max_inflight), 0).astype(int)
    fit_k = _verify_fit(model, table_bases, shapes, ckpt, offload, fit_k, limit, stats)
    stable, delta = first.stable_s.astype(float), first.delta_s.astype(float)
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
    ) if len(keep) else None
    stats["frontier_points"] = len(keep)
    stats["evaluated"] = model.rows
    stats["cells"] = len(cells)
    return FrontierTable(
        grad_accum=grad_accum, shapes=shapes, configs=configs, stable=stable[keep], delta=delta[keep],
        memory_k1=mem1[keep], memory_per_inflight=slope[keep], cells=cells, fit_k=fit_k[keep], stats=stats,
    )


def _inflight_slope(model: StageCostModel, bases: Bases, shapes: list[DeviceShape], ckpt: np.ndarray,
                    offload: np.ndarray, mem1: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Memory per extra in-flight micro-batch of ``rows``, from an evaluation at their largest k."""
    slope = np.zeros(len(rows))
    deep = np.flatnonzero(bases.max_inflight[rows] >= 2)
    if len(deep):
        picked = rows[deep]
        k = bases.max_inflight[picked]
        top = evaluate(model, bases.take(picked), shapes, ckpt[picked], offload[picked], k).peak_memory_bytes
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
    check = evaluate(model, bases.take(claim), shapes, ckpt[claim], offload[claim], fit_k[claim])
    failed = claim[~_fits(check.peak_memory_bytes, limit)]
    stats["fit_corrections"] = len(failed)
    low, high = np.full(len(failed), 2), fit_k[failed].copy()
    while len(failed) and (high - low > 1).any():
        active = high - low > 1
        mid = (low + high) // 2
        rows = failed[active]
        probe = evaluate(model, bases.take(rows), shapes, ckpt[rows], offload[rows], mid[active])
        ok = _fits(probe.peak_memory_bytes, limit)
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
    for level in np.unique(fit_k[fit_k >= 1])[::-1]:
        members = np.flatnonzero(fit_k >= level)
        order = members[np.lexsort((delta[members], stable[members], group[members]))]
        front = order[_pareto_sorted(group[order], delta[order])]
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


def probe_work_bound(model: StageCostModel, work: Workload, cluster: Cluster, space: SearchSpace,
                     grad_accum: int, max_stages: int) -> float:
    """A cheap lower bound on any plan of this G (two evaluations per base), to order and skip G values."""
    bases, shapes = enumerate_bases(work, cluster, space, grad_accum, max_stages)
    if len(bases) == 0:
        return math.inf
    combos = space.offload_combos()
    low, high = _knob_limits(space, bases.layers)
    alive = _fits_most_saving(model, bases, shapes, high, combos, float(model.device_memory_bytes))
    fastest = evaluate(model, bases, shapes, low, np.zeros((len(bases), 4)), 1).stable_s.astype(float)
    bound = IncumbentBound(grad_accum, math.inf, work.num_layers, cluster.world)
    return bound.work_bound(bases, fastest, alive, shapes)
