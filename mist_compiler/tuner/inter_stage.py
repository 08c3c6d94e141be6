"""Inter-stage tuning: a MILP that picks the layer split and one Pareto point per stage.

For S stages and G micro-batches it minimises
``(G-1) * max_i T_i + sum_i T_i + max_i (D_i - sum_{j<i} T_j)`` (DESIGN.md 2.3), where ``T_i`` and
``D_i`` are the chosen point's stable and delta times. Stage 0 holds the embedding (in-flight
``min(S, G)``), stage S-1 the head (in-flight 1), stages 1..S-2 neither.

The middle stages share one pool of choices (cell x Pareto point, each with the largest in-flight
count it fits): an integer ``n_c`` says how many middle stages use choice ``c`` and a binary
``y_c`` whether any does, so the program's size does not grow with S. Middle position i needs a
choice that fits ``min(S - i, G)`` in-flight micro-batches; since those needs are nested, Hall's
condition "at least as many chosen middle stages fit >= j as positions need >= j" (for every j)
is exact, and the stages are then ordered by what they fit. The bubble term of a middle stage is
bounded using only the first stage's time before it (conservative; the reported time is
recomputed exactly for the final order).

Solved with HiGHS when python-mip can build a model with it, else CBC (:func:`solver_name`), always under a time limit; the gap is
reported. Choices that cannot beat the incumbent (``G * T_c + sum of the other stages' minimum
times >= incumbent``) are dropped before the program is built.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..cost.stage_api import pipeline_iteration_time
from .intra_stage import PP_BOTH, PP_NONE, PP_POST, PP_PRE, FrontierTable
from .space import Cluster, SearchSpace, TuneError, Workload

MAX_BINARIES = 2000


SOLVERS = ("HIGHS", "CBC")  # preference order
_working: dict[str, bool] = {}


def solver_works(name: str) -> bool:
    """Whether python-mip can build and solve a one-variable MILP with ``name`` (cached per process).

    Importing a solver's Python package proves nothing (TORCH-NOTES section 9: highspy 1.16
    imports but no longer exports the C API mip loads); building a model is the only real test.
    """
    if name not in _working:
        import mip

        try:
            model = mip.Model(sense=mip.MINIMIZE, solver_name=name)
            model.verbose = 0
            x = model.add_var(var_type=mip.BINARY)
            model.objective = mip.minimize(x)
            model.add_constr(x >= 1)
            _working[name] = model.optimize(max_seconds=10) == mip.OptimizationStatus.OPTIMAL and round(x.x) == 1
        except Exception:  # mip raises FileNotFoundError, OSError, ImportError ... for a missing library
            _working[name] = False
    return _working[name]


def solver_name() -> str:
    """The first solver of ``SOLVERS`` that python-mip can really use (HiGHS, else CBC)."""
    for name in SOLVERS:
        if solver_works(name):
            return name
    raise TuneError("no MILP solver works: python-mip can use neither HiGHS (pip install highsbox) nor CBC "
                    "(pip install cbcbox); reinstall mist-compiler to get both")


@dataclass
class ChoicePool:
    """Candidate choices of one stage role: frontier rows with their layers, devices and fit."""

    rows: np.ndarray
    layers: np.ndarray
    devices: np.ndarray
    stable: np.ndarray
    delta: np.ndarray
    fit_k: np.ndarray

    def __len__(self) -> int:
        return len(self.rows)

    def take(self, mask: np.ndarray) -> "ChoicePool":
        return ChoicePool(*(getattr(self, name)[mask] for name in self.__dataclass_fields__))

    def min_stable(self) -> float:
        return float(self.stable.min()) if len(self) else math.inf


@dataclass
class StageSolution:
    """The chosen stages in pipeline order, with the solver's verdict."""

    rows: list[int]  # frontier-table rows, stage order
    layers: list[int]
    inflight: list[int]
    objective: float  # exact iteration time of this order
    milp_objective: float
    bound: float
    gap: float
    status: str
    binaries: int


def _pool(table: FrontierTable, pp: int, inflight_needed: int, stages: int, work: Workload,
          cluster: Cluster, space: SearchSpace) -> ChoicePool:
    """Union of the frontier points of every allowed cell of one role, fitting >= inflight_needed."""
    max_layers = work.num_layers - (stages - 1)
    entries = table.entries()
    counts = np.array([shape.count for shape in table.shapes], dtype=int)[entries["shape"]] if len(entries["row"]) else np.zeros(0, int)
    mask = (entries["pp"] == pp) & (entries["k"] >= inflight_needed) & (entries["layers"] <= max_layers)
    mask &= counts <= cluster.world - (stages - 1)
    if space.uniform_devices:
        mask &= counts == cluster.world // stages
    if space.layer_slack is not None:
        allowed = np.array([space.layers_allowed(l, stages, work.num_layers) for l in range(work.num_layers + 1)])
        mask &= allowed[entries["layers"]]
    if not mask.any():
        empty = np.zeros(0, dtype=int)
        return ChoicePool(empty, empty, empty, np.zeros(0), np.zeros(0), empty)
    rows_all = entries["row"][mask]
    fit_all = entries["k"][mask]
    # a row appears in the cells of every k it is on the frontier of; keep it once with its largest k
    order = np.lexsort((-fit_all, rows_all))
    rows_all, fit_all = rows_all[order], fit_all[order]
    first = np.ones(len(rows_all), dtype=bool)
    first[1:] = rows_all[1:] != rows_all[:-1]
    rows_all, fit_all = rows_all[first], fit_all[first]
    configs = table.configs
    return ChoicePool(
        rows=rows_all, layers=configs.num_layers[rows_all],
        devices=(configs.nodes * configs.gpus_per_node)[rows_all],
        stable=table.stable[rows_all], delta=table.delta[rows_all], fit_k=fit_all,
    )


def role_pools(table: FrontierTable, stages: int, work: Workload, cluster: Cluster,
               space: SearchSpace) -> dict[str, ChoicePool]:
    g = table.grad_accum
    if stages == 1:
        return {"only": _pool(table, PP_BOTH, 1, 1, work, cluster, space)}
    pools = {
        "first": _pool(table, PP_PRE, min(stages, g), stages, work, cluster, space),
        "last": _pool(table, PP_POST, 1, stages, work, cluster, space),
    }
    if stages > 2:
        pools["middle"] = _pool(table, PP_NONE, min(2, g), stages, work, cluster, space)
    return pools


def lower_bound(pools: dict[str, ChoicePool], stages: int, grad_accum: int, total_layers: int, world: int,
                least_sum: float = 0.0, least_slowest: float = 0.0) -> float:
    """A bound no plan of this (S, G) beats: stage minima, work over the cluster, the stage with >= L/S
    layers, and ``least_sum`` (a bound on sum_i T_i, see :func:`sum_time_bounds`)."""
    if any(len(pool) == 0 for pool in pools.values()):
        return math.inf
    minima = [pools[role].min_stable() for role in ("first", "last", "only") if role in pools]
    if "middle" in pools:
        minima += [pools["middle"].min_stable()] * (stages - 2)
    per_layer = min(float((p.stable * p.devices / np.maximum(p.layers, 1)).min()) for p in pools.values())
    slowest = max(max(minima), total_layers * per_layer / world, least_sum / stages, least_slowest)
    bound = (grad_accum - 1) * slowest + max(sum(minima), least_sum)
    big = math.ceil(total_layers / stages)
    heaviest = min((float(p.stable[p.layers >= big].min()) for p in pools.values() if (p.layers >= big).any()),
                   default=math.inf)
    return max(bound, grad_accum * heaviest)


def prune_pools(pools: dict[str, ChoicePool], stages: int, grad_accum: int, incumbent: float) -> dict[str, ChoicePool]:
    """Drop choices with ``G * T_c + (other stages' minimum times) >= incumbent``."""
    if not math.isfinite(incumbent):
        return pools
    minima = {role: pool.min_stable() for role, pool in pools.items()}
    counts = {"first": 1, "last": 1, "only": 1, "middle": stages - 2}
    total_min = sum(minima[role] * counts[role] for role in pools)
    pruned = {}
    for role, pool in pools.items():
        others = total_min - minima[role]
        pruned[role] = pool.take(grad_accum * pool.stable + others < incumbent * (1 + 1e-12))
    return pruned


def _cap_size(pools: dict[str, ChoicePool], budget: int) -> tuple[dict[str, ChoicePool], int]:
    """Keep at most ``budget`` choices in total: the fastest per (role, layers, devices) first."""
    size = sum(len(p) for p in pools.values())
    if size <= budget:
        return pools, 0
    dropped = 0
    per_cell = max(1, max(len(p) for p in pools.values()))
    while size > budget and per_cell > 1:
        per_cell = max(1, per_cell // 2)
        capped = {}
        for role, pool in pools.items():
            key = pool.layers.astype(np.int64) * 100_003 + pool.devices
            order = np.lexsort((pool.delta, pool.stable, key))
            sorted_key = key[order]
            starts = np.r_[0, np.flatnonzero(np.diff(sorted_key)) + 1]
            rank = np.arange(len(order)) - np.repeat(starts, np.diff(np.r_[starts, len(order)]))
            mask = np.zeros(len(pool), dtype=bool)
            mask[order[rank < per_cell]] = True
            capped[role] = pool.take(mask)
        size = sum(len(p) for p in capped.values())
        dropped = sum(len(p) for p in pools.values()) - size
        result = capped
    return (result if dropped else pools), dropped


def solve_stages(table: FrontierTable, stages: int, work: Workload, cluster: Cluster, space: SearchSpace,
                 incumbent: float = math.inf, pools: dict[str, ChoicePool] | None = None) -> StageSolution | None:
    """Best split for (S, G) better than ``incumbent``; None if none exists (or none was found in time)."""
    g = table.grad_accum
    pools = pools if pools is not None else role_pools(table, stages, work, cluster, space)
    pools = prune_pools(pools, stages, g, incumbent)
    if any(len(pool) == 0 for pool in pools.values()):
        return None
    if stages == 1:
        return _solve_single(table, pools["only"], work, cluster, incumbent)
    pools, dropped = _cap_size(pools, MAX_BINARIES)
    return _solve_milp(table, pools, stages, work, cluster, space, incumbent, dropped)


def _solve_single(table: FrontierTable, pool: ChoicePool, work: Workload, cluster: Cluster,
                  incumbent: float) -> StageSolution | None:
    usable = (pool.devices == cluster.world) & (pool.layers == work.num_layers)
    if not usable.any():
        return None
    times = (table.grad_accum - 1) * pool.stable + pool.stable + pool.delta
    times = np.where(usable, times, np.inf)
    best = int(np.argmin(times))
    if times[best] >= incumbent:
        return None
    value = float(times[best])
    return StageSolution([int(pool.rows[best])], [work.num_layers], [1], value, value, value, 0.0, "OPTIMAL", 0)


def _solve_milp(table: FrontierTable, pools: dict[str, ChoicePool], stages: int, work: Workload, cluster: Cluster,
                space: SearchSpace, incumbent: float, dropped: int) -> StageSolution | None:
    import mip

    g = table.grad_accum
    model = mip.Model(sense=mip.MINIMIZE, solver_name=solver_name())
    model.verbose = 0
    model.threads = 1
    first, last = pools["first"], pools["last"]
    x_first = [model.add_var(var_type=mip.BINARY) for _ in range(len(first))]
    x_last = [model.add_var(var_type=mip.BINARY) for _ in range(len(last))]
    model += mip.xsum(x_first) == 1
    model += mip.xsum(x_last) == 1
    t_first = mip.xsum(float(first.stable[c]) * x_first[c] for c in range(len(first)))
    t_last = mip.xsum(float(last.stable[c]) * x_last[c] for c in range(len(last)))
    d_first = mip.xsum(float(first.delta[c]) * x_first[c] for c in range(len(first)))
    d_last = mip.xsum(float(last.delta[c]) * x_last[c] for c in range(len(last)))
    layers = mip.xsum(int(first.layers[c]) * x_first[c] for c in range(len(first))) + \
        mip.xsum(int(last.layers[c]) * x_last[c] for c in range(len(last)))
    devices = mip.xsum(int(first.devices[c]) * x_first[c] for c in range(len(first))) + \
        mip.xsum(int(last.devices[c]) * x_last[c] for c in range(len(last)))
    t_max = model.add_var(lb=0.0)
    bubble = model.add_var(lb=0.0)
    model += t_max >= t_first
    model += t_max >= t_last
    model += bubble >= d_first
    middle_count = stages - 2
    t_middle_sum = 0
    n_mid, y_mid = [], []
    if middle_count > 0:
        middle = pools["middle"]
        n_mid = [model.add_var(var_type=mip.INTEGER, lb=0, ub=middle_count) for _ in range(len(middle))]
        y_mid = [model.add_var(var_type=mip.BINARY) for _ in range(len(middle))]
        model += mip.xsum(n_mid) == middle_count
        for c in range(len(middle)):
            model += n_mid[c] <= middle_count * y_mid[c]
            model += n_mid[c] >= y_mid[c]
            model += t_max >= float(middle.stable[c]) * y_mid[c]
            model += bubble >= float(middle.delta[c]) * y_mid[c] - t_first
        layers = layers + mip.xsum(int(middle.layers[c]) * n_mid[c] for c in range(len(middle)))
        devices = devices + mip.xsum(int(middle.devices[c]) * n_mid[c] for c in range(len(middle)))
        t_middle_sum = mip.xsum(float(middle.stable[c]) * n_mid[c] for c in range(len(middle)))
        # Hall's condition for the nested in-flight needs of positions 1..S-2
        for need in range(3, min(stages - 1, g) + 1):
            positions = min(stages - 2, stages - need)
            fitting = [n_mid[c] for c in range(len(middle)) if middle.fit_k[c] >= need]
            model += mip.xsum(fitting) >= positions
    t_sum = t_first + t_last + t_middle_sum
    model += bubble >= d_last - t_sum + t_last
    # redundant cuts that tighten the relaxation: the slowest stage is at least the average
    # stage, and at least the device-weighted average (work conservation over the cluster)
    model += stages * t_max >= t_sum
    device_seconds = mip.xsum(float(first.stable[c] * first.devices[c]) * x_first[c] for c in range(len(first))) + \
        mip.xsum(float(last.stable[c] * last.devices[c]) * x_last[c] for c in range(len(last)))
    if middle_count > 0:
        device_seconds = device_seconds + mip.xsum(float(middle.stable[c] * middle.devices[c]) * n_mid[c] for c in range(len(middle)))
    model += cluster.world * t_max >= device_seconds
    model += layers == work.num_layers
    model += devices == cluster.world
    model.objective = (g - 1) * t_max + t_sum + bubble
    model.max_mip_gap = space.milp_gap
    if math.isfinite(incumbent):
        model.cutoff = incumbent
    status = model.optimize(max_seconds=space.milp_seconds)
    if status not in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE) or model.num_solutions == 0:
        return None
    pick_first = int(np.argmax([v.x for v in x_first]))
    pick_last = int(np.argmax([v.x for v in x_last]))
    middle_rows: list[tuple[int, int]] = []
    if middle_count > 0:
        for c, var in enumerate(n_mid):
            middle_rows += [(c, 0)] * int(round(var.x))
    order = _order_middle(pools.get("middle"), [c for c, _ in middle_rows])
    rows = [int(first.rows[pick_first])] + [int(pools["middle"].rows[c]) for c in order] + [int(last.rows[pick_last])]
    stage_layers = [int(first.layers[pick_first])] + [int(pools["middle"].layers[c]) for c in order] + [int(last.layers[pick_last])]
    inflight = [min(stages - i, g) for i in range(stages)]
    exact = pipeline_iteration_time(table.stable[rows], table.delta[rows], g)
    value = float(model.objective_value)
    bound = float(model.objective_bound)
    gap = max(0.0, (value - bound) / value) if value > 0 else 0.0
    status_name = "OPTIMAL" if status == mip.OptimizationStatus.OPTIMAL else "FEASIBLE"
    if dropped:
        status_name += f" (choices capped, {dropped} dropped)"
    binaries = len(x_first) + len(x_last) + len(y_mid)
    return StageSolution(rows, stage_layers, inflight, exact, value, bound, gap, status_name, binaries)


def _order_middle(pool: ChoicePool | None, chosen: list[int]) -> list[int]:
    """Middle stages in pipeline order: those fitting more in-flight micro-batches first, larger delta later."""
    if not chosen or pool is None:
        return []
    return sorted(chosen, key=lambda c: (-int(pool.fit_k[c]), float(pool.delta[c]), int(pool.rows[c])))


def uniform_solution(table: FrontierTable, stages: int, work: Workload, cluster: Cluster,
                     space: SearchSpace) -> StageSolution | None:
    """A quick incumbent: equal devices per stage, layers split as evenly as possible, and per stage
    the point that minimises ``G * stable + delta``. Exact time; used to prune before any MILP."""
    if cluster.world % stages or work.num_layers < stages:
        return None
    per_stage = cluster.world // stages
    shapes = [i for i, s in enumerate(table.shapes) if s.count == per_stage]
    if not shapes:
        return None
    g = table.grad_accum
    base, extra = divmod(work.num_layers, stages)
    best = None
    for arrangement in _even_splits(stages, base, extra):
        if not all(space.layers_allowed(l, stages, work.num_layers) for l in arrangement):
            continue
        for shape in shapes:
            rows = []
            for i, layers in enumerate(arrangement):
                pp = PP_BOTH if stages == 1 else PP_PRE if i == 0 else PP_POST if i == stages - 1 else PP_NONE
                inflight = 1 if pp in (PP_BOTH, PP_POST) else min(stages - i, g)
                members = table.cell(layers, pp, shape, inflight)
                if len(members) == 0:
                    rows = None
                    break
                rows.append(int(members[np.argmin(g * table.stable[members] + table.delta[members])]))
            if rows is None:
                continue
            value = pipeline_iteration_time(table.stable[rows], table.delta[rows], g)
            if best is None or value < best.objective:
                inflight = [min(stages - i, g) for i in range(stages)]
                best = StageSolution(rows, list(arrangement), inflight, value, value, value, 0.0, "HEURISTIC", 0)
    return best


def _even_splits(stages: int, base: int, extra: int) -> list[tuple[int, ...]]:
    """Layer counts differing by at most one: the extra layers on the middle, the front or the back."""
    if extra == 0:
        return [(base,) * stages]
    front = tuple(base + (i < extra) for i in range(stages))
    back = tuple(base + (i >= stages - extra) for i in range(stages))
    middle_order = list(range(1, stages - 1)) + [0, stages - 1]
    middle_set = set(middle_order[:extra])
    middle = tuple(base + (i in middle_set) for i in range(stages))
    return sorted({front, back, middle})


def _min_table(pool: ChoicePool, total_layers: int, world: int) -> np.ndarray:
    """table[l, d] = the fastest stable time of a choice with l layers on d devices (inf: none)."""
    table = np.full((total_layers + 1, world + 1), np.inf)
    if len(pool):
        np.minimum.at(table, (pool.layers, pool.devices), pool.stable)
    return table


def _min_plus(left: np.ndarray, right: np.ndarray, combine=np.add) -> np.ndarray:
    """(left (+) right)[l, d] = min over splits of combine(left[l1, d1], right[l - l1, d - d1]).

    ``combine=np.add`` gives the least sum, ``np.maximum`` the least bottleneck."""
    result = np.full_like(left, np.inf)
    layers, devices = left.shape
    for l, d in zip(*np.nonzero(np.isfinite(right))):
        np.minimum(result[l:, d:], combine(left[:layers - l, :devices - d], right[l, d]), out=result[l:, d:])
    return result


class StageSumBounds:
    """Lower bounds on ``sum_i T_i`` by a DP over (layers, devices) with relaxed filters.

    ``total(S)`` bounds the sum over all S stages; ``prune(pools, S, ...)`` drops a choice when even
    the fastest way to cover the remaining layers and devices with the other S-1 stages cannot
    beat the incumbent. Disabled (no pruning, bound 0) when the table would be too large.
    """

    def __init__(self, total_layers: int, cluster: Cluster, grad_accum: int, middle: ChoicePool, last: ChoicePool,
                 only: ChoicePool, first_pool: Callable[[int], ChoicePool]) -> None:
        self.total_layers, self.world = total_layers, cluster.world
        self.grad_accum = grad_accum
        # big clusters: count devices in whole nodes (rounded down), a relaxation that keeps it a bound
        self.unit = cluster.gpus_per_node if (total_layers + 1) * (cluster.world + 1) > 30_000 else 1
        self.width = cluster.world // self.unit
        self.enabled = (self.total_layers + 1) * (self.width + 1) <= 200_000
        self._first_pool = first_pool
        self._firsts: dict[int, np.ndarray] = {}
        self._rests: dict[tuple[str, int], np.ndarray] = {}
        if not self.enabled:
            return
        self.middle, self.last, self.only = self._min(middle), self._min(last), self._min(only)
        start = np.full_like(self.middle, np.inf)
        start[0, 0] = 0.0
        self._chains = {0: start}
        self._bottleneck_chains = {0: start}

    @classmethod
    def for_table(cls, table: FrontierTable, work: Workload, cluster: Cluster, space: SearchSpace) -> "StageSumBounds":
        """Bounds over a frontier table's choices (filters relaxed: any split, any devices)."""
        relaxed = space.restrict(layer_slack=None, uniform_devices=False)
        g = table.grad_accum

        def first_pool(stages: int) -> ChoicePool:
            return _pool(table, PP_PRE, min(stages, g), stages, work, cluster, relaxed)

        return cls(work.num_layers, cluster, g, _pool(table, PP_NONE, min(2, g), 3, work, cluster, relaxed),
                   _pool(table, PP_POST, 1, 2, work, cluster, relaxed), _pool(table, PP_BOTH, 1, 1, work, cluster, relaxed),
                   first_pool)

    def least_iteration(self, stages: int) -> float:
        """``(G-1) * least slowest stage + least sum``: no plan of S stages is faster."""
        total = self.total(stages)
        return (self.grad_accum - 1) * max(self.slowest(stages), total / stages) + total

    def _min(self, pool: ChoicePool) -> np.ndarray:
        table = np.full((self.total_layers + 1, self.width + 1), np.inf)
        if len(pool):
            np.minimum.at(table, (pool.layers, pool.devices // self.unit), pool.stable)
        return table

    def _relax(self, table: np.ndarray) -> np.ndarray:
        """With rounded device counts, 'uses exactly d units' becomes 'at most d units'."""
        return np.minimum.accumulate(table, axis=1) if self.unit > 1 else table

    def chain(self, count: int) -> np.ndarray:
        """Fastest sum of ``count`` middle stages per (layers, devices)."""
        while max(self._chains) < count:
            top = max(self._chains)
            self._chains[top + 1] = _min_plus(self._chains[top], self.middle)
        return self._chains[count]

    def bottleneck_chain(self, count: int) -> np.ndarray:
        """Least possible slowest-stage time of ``count`` middle stages per (layers, devices)."""
        while max(self._bottleneck_chains) < count:
            top = max(self._bottleneck_chains)
            self._bottleneck_chains[top + 1] = _min_plus(self._bottleneck_chains[top], self.middle, np.maximum)
        return self._bottleneck_chains[count]

    def slowest(self, stages: int) -> float:
        """Least possible ``max_i T_i`` of any S stages covering all layers and devices."""
        if not self.enabled:
            return 0.0
        if stages == 1:
            return float(self._relax(self.only)[self.total_layers, self.width])
        head = self.first(stages)
        if stages > 2:
            head = _min_plus(self.bottleneck_chain(stages - 2), head, np.maximum)
        return float(np.min(np.maximum(head[::-1, ::-1], self._relax(self.last))))

    def first(self, stages: int) -> np.ndarray:
        if stages not in self._firsts:
            self._firsts[stages] = self._min(self._first_pool(stages))
        return self._firsts[stages]

    def rest(self, role: str, stages: int) -> np.ndarray:
        """Fastest sum of the other S-1 stages per (layers, devices) they cover, for a choice of ``role``."""
        key = (role, stages)
        if key not in self._rests:
            self._rests[key] = self._relax(self._rest(role, stages))
        return self._rests[key]

    def _rest(self, role: str, stages: int) -> np.ndarray:
        if role == "first":
            return _min_plus(self.chain(stages - 2), self.last)
        if role == "last":
            return _min_plus(self.chain(stages - 2), self.first(stages))
        return _min_plus(_min_plus(self.chain(stages - 3), self.first(stages)), self.last)

    def total(self, stages: int) -> float:
        if not self.enabled:
            return 0.0
        if stages == 1:
            return float(self._relax(self.only)[self.total_layers, self.width])
        rest = self.rest("first", stages)
        return float(np.min(self.first(stages)[::-1, ::-1] + rest))

    def prune(self, pools: dict[str, ChoicePool], stages: int, incumbent: float, work_slowest: float) -> dict[str, ChoicePool]:
        if not self.enabled or stages == 1 or not math.isfinite(incumbent):
            return pools
        g = self.grad_accum
        pruned = {}
        for role, pool in pools.items():
            rest = self.rest(role, stages)
            other = rest[self.total_layers - pool.layers, self.width - pool.devices // self.unit]
            total = pool.stable + other
            slowest = np.maximum(np.maximum(pool.stable, total / stages), work_slowest)
            with np.errstate(invalid="ignore"):
                bound = np.where(np.isfinite(total), (g - 1) * slowest + total, np.inf)
            pruned[role] = pool.take(bound < incumbent * (1 + 1e-12))
        return pruned


def work_slowest_bound(pools: dict[str, ChoicePool], total_layers: int, world: int) -> float:
    """The slowest stage takes at least the cluster's best device-seconds per layer spread evenly."""
    if any(len(pool) == 0 for pool in pools.values()):
        return math.inf
    per_layer = min(float((p.stable * p.devices / np.maximum(p.layers, 1)).min()) for p in pools.values())
    return total_layers * per_layer / world
