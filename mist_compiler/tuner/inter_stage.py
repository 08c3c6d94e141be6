"""Inter-stage tuning: the layer split and one frontier point per stage, by dynamic programming.

The layers are identical, so a stage is its layer *count*, its device count and a point of its
cell's frontier; stage order matters only through the in-flight micro-batches a stage must fit
(position i of S holds ``min(S - i, G)``) and which stages hold the embedding (first) and the head
(last). With ``T_i``/``D_i`` the chosen points' stable and delta times, the iteration time
(DESIGN.md 2.3, ``pipeline_iteration_time``) is

    F = (G-1) max_i T_i + sum_i T_i + max(0, max_i (D_i - sum_{j<i} T_j))
      = (G-1) max_i T_i + M,    M = max_i (D_i + Q_i),   Q_i = T_i + ... + T_{S-1}

(``D_i >= 0``). The method, as in Alpa and Metis, fixes a *bottleneck threshold* tau (every
``T_i <= tau``) and solves the rest by a DP over (layers covered, devices covered), placing stages
from the last one backwards so that the number already placed gives the next stage's in-flight
need; one pass serves every stage count S. Per state it keeps the least suffix sum ``Q``.

- *Lower bound*: counting only the first stage's delta (``M >= D_0 + Q_0``), the DP value plus
  ``(G-1)`` times the lower edge of a tau bucket bounds every plan whose slowest stage lies in the
  bucket. A pass evaluates up to ``BUCKETS`` tau buckets at once (the arrays carry a bucket axis).
- *Plans*: the DP's argmins are plans; their exact time is an upper bound.
- *Closing the gap*: buckets whose bound is not within the target gap of the best plan are split
  (down to single distinct stage times); where the rest is exposed delta of a later stage, an
  exposure threshold ``mu`` (every ``D_i + Q_i <= mu``) makes the min-Q DP exact, and ``mu`` is
  bisected (again many values per pass).
- *Pruning*: a state is dropped when its value plus the cheapest way to place the remaining
  layers cannot beat the best plan by more than the gap; a choice with ``G T >= best`` never
  enters.

Devices are counted in units of their gcd. When that grid would be too large (tens of thousands of
GPUs with small stages surviving the bounds), the bound pass rounds device counts down to a coarser
unit (a relaxation: it still bounds every plan) and the plan pass uses only stages whose device
count is a multiple of it; the reported gap says how close that is. The result is exact relative
to the frontier tables (gap 0) when the grid is fine enough and the target gap is 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..cost.stage_api import pipeline_iteration_time
from .intra_stage import PP_BOTH, PP_NONE, PP_POST, PP_PRE, FrontierTable
from .space import Cluster, SearchSpace, Workload

BUCKETS = 16  # thresholds evaluated together in one DP pass
STATE_LIMIT = 12_000  # (layers + 1) x device units of one DP array before the grid is coarsened
MAX_PASSES = 40
ROLES = {"only": PP_BOTH, "first": PP_PRE, "middle": PP_NONE, "last": PP_POST}


@dataclass
class StageSolution:
    """Chosen stages in pipeline order (frontier-table rows) and how good they are known to be."""

    rows: list[int]
    layers: list[int]
    inflight: list[int]
    objective: float  # exact iteration time
    bound: float = 0.0  # lower bound on every plan of the problem it was solved for
    status: str = "OPTIMAL"

    @property
    def gap(self) -> float:
        return max(0.0, 1.0 - self.bound / self.objective) if self.objective > 0 else 0.0


@dataclass
class Choices:
    """Candidate stages of one role: table rows with layers, devices, times and in-flight capacity."""

    rows: np.ndarray
    layers: np.ndarray
    devices: np.ndarray
    stable: np.ndarray
    delta: np.ndarray
    fit: np.ndarray

    def take(self, mask: np.ndarray) -> "Choices":
        return Choices(*(getattr(self, name)[mask] for name in self.__dataclass_fields__))

    def __len__(self) -> int:
        return len(self.rows)


def role_choices(table: FrontierTable) -> dict[str, Choices]:
    """Every table row, by role (pp kind), as DP choices."""
    configs = table.configs
    if configs is None:
        empty = np.zeros(0, dtype=int)
        return {role: Choices(empty, empty, empty, np.zeros(0), np.zeros(0), empty) for role in ROLES}
    pp = configs.has_pre.astype(int) + 2 * configs.has_post.astype(int)
    devices = (configs.nodes * configs.gpus_per_node).astype(int)
    result = {}
    for role, kind in ROLES.items():
        index = np.flatnonzero((pp == kind) & (table.fit_k >= 1))
        result[role] = Choices(index, configs.num_layers[index].astype(int), devices[index],
                               table.stable[index].astype(float), table.delta[index].astype(float),
                               table.fit_k[index].astype(int))
    return result


@dataclass
class PartitionResult:
    """Outcome of one G: the best plan found (None: nothing beats the incumbent) and a lower bound
    on every plan of this G (at least the incumbent where nothing can beat it)."""

    solution: StageSolution | None
    bound: float
    stats: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------
# the DP


@dataclass
class _Kernel:
    """Transitions of one role and in-flight need: per (layers, device-unit column) and bucket, the
    best row (min ``cost``), or in exposure mode every row (its stable and delta)."""

    layers: np.ndarray  # [n] layer count of transition n
    units: np.ndarray  # [n] device units
    cost: np.ndarray  # [K, n] value added (inf: not allowed in that bucket)
    check: np.ndarray | None  # [K, n] Q_old + check <= mu (exposure mode), None otherwise
    rows: np.ndarray  # [K, n] table row


class _Problem:
    """One G's choices, device grid and bounds; runs DP passes."""

    def __init__(self, table: FrontierTable, work: Workload, cluster: Cluster, s_options: list[int],
                 choices: dict[str, Choices], unit: int, relaxed: bool) -> None:
        self.g = table.grad_accum
        self.table = table
        self.total_layers = work.num_layers
        self.unit, self.relaxed = unit, relaxed
        self.width = cluster.world // unit  # device units of the whole cluster
        self.s_options = s_options
        self.choices = {}
        for role, pool in choices.items():
            if not relaxed:
                pool = pool.take(pool.devices % unit == 0)
            self.choices[role] = pool
        self._kernel_cache: dict = {}
        self.dropped_bound = math.inf  # least bound of a state dropped against the incumbent

    # -- kernels -----------------------------------------------------------------------------

    def kernel(self, role: str, need: int, taus: np.ndarray, mu: np.ndarray | None) -> _Kernel:
        key = (role, need, taus.tobytes(), None if mu is None else mu.tobytes())
        if key not in self._kernel_cache:
            self._kernel_cache[key] = self._build_kernel(role, need, taus, mu)
        return self._kernel_cache[key]

    def _build_kernel(self, role: str, need: int, taus: np.ndarray, mu: np.ndarray | None) -> _Kernel:
        pool = self.choices[role]
        pool = pool.take((pool.fit >= need) & (pool.stable <= taus.max()))
        units = pool.devices // self.unit
        with_delta = role in ("first", "only")
        value = pool.stable + (pool.delta if with_delta else 0.0)
        allowed = pool.stable[None, :] <= taus[:, None]  # [K, n]
        if mu is not None:  # exposure mode: every row is its own transition
            cost = np.where(allowed, pool.stable[None, :], np.inf)
            check = np.where(allowed, (pool.stable + pool.delta)[None, :], np.inf)
            rows = np.broadcast_to(pool.rows, allowed.shape).copy()
            return _Kernel(pool.layers, units, cost, check, rows)
        # bound mode: per (layers, units) the cheapest row in each bucket
        key = pool.layers.astype(np.int64) * (self.width + 2) + units
        cells, inverse = np.unique(key, return_inverse=True)
        k = len(taus)
        cost = np.full((k, len(cells)), np.inf)
        rows = np.full((k, len(cells)), -1, dtype=np.int64)
        order = np.argsort(value, kind="stable")
        for bucket in range(k):
            picked = order[allowed[bucket, order]]
            cell = inverse[picked]
            first = np.unique(cell, return_index=True)[1]
            cost[bucket, cell[first]] = value[picked[first]]
            rows[bucket, cell[first]] = pool.rows[picked[first]]
        layers = (cells // (self.width + 2)).astype(int)
        return _Kernel(layers, (cells % (self.width + 2)).astype(int), cost, None, rows)

    # -- one pass ----------------------------------------------------------------------------

    def run(self, taus: np.ndarray, lower: np.ndarray, incumbent: float, gap: float,
            mu: np.ndarray | None = None, s_only: int | None = None) -> "_Pass":
        """A DP pass over K buckets (tau thresholds, or mu values at one tau)."""
        k_count = len(taus) if mu is None else len(mu)
        taus_k = taus if mu is None else np.full(k_count, taus[0])
        layers, width, g = self.total_layers, self.width, self.g
        state = np.full((k_count, layers + 1, width + 1), np.inf)
        state[:, 0, 0] = 0.0
        result = _Pass(k_count)
        history: list[tuple[_Kernel, np.ndarray]] = []
        s_list = [s for s in self.s_options if s_only is None or s == s_only]
        s_max = max(s_list, default=0)
        completion = self._completion_rates(taus_k)
        for placed in range(0, s_max):
            stages = placed + 1  # a plan of this many stages closes here with its first stage
            if stages in s_list:
                role = "only" if stages == 1 else "first"
                need = 1 if stages == 1 else min(stages, g)
                kernel = self.kernel(role, need, taus_k, mu)
                values, where = self._close(state, kernel, mu)
                result.record(stages, values, where, list(history), kernel)
            if stages >= s_max:
                break
            role, need = ("last", 1) if placed == 0 else ("middle", min(placed + 1, g))
            kernel = self.kernel(role, need, taus_k, mu)
            if kernel.cost.shape[1] == 0:
                break
            state, arg = self._step(state, kernel, mu)
            history.append((kernel, arg))
            self._prune(state, lower, completion, incumbent, gap)
            if not np.isfinite(state).any():
                break
        return result

    def _completion_rates(self, taus: np.ndarray) -> tuple[np.ndarray, float]:
        """Per bucket the least stable time per layer of any non-final stage, and the least first-stage delta."""
        rates = np.full(len(taus), np.inf)
        for role in ("middle", "first"):
            pool = self.choices[role]
            if len(pool):
                per_layer = pool.stable / np.maximum(pool.layers, 1)
                for i, tau in enumerate(taus):
                    ok = pool.stable <= tau
                    if ok.any():
                        rates[i] = min(rates[i], float(per_layer[ok].min()))
        first = self.choices["first"]
        least_delta = float(first.delta.min()) if len(first) else 0.0
        return rates, least_delta

    def _prune(self, state: np.ndarray, lower: np.ndarray, completion, incumbent: float, gap: float) -> None:
        if not math.isfinite(incumbent):
            return
        rates, least_delta = completion
        remaining = (self.total_layers - np.arange(self.total_layers + 1)).astype(float)
        with np.errstate(invalid="ignore"):
            rest = np.where(remaining[None, :] > 0, remaining[None, :] * rates[:, None], np.inf) + least_delta
        head = (self.g - 1) * lower if self.g > 1 else np.zeros(len(lower))
        bound = head[:, None, None] + state + rest[:, :, None]
        dropped = (bound * (1 + gap) >= incumbent) & np.isfinite(state)
        if dropped.any():
            self.dropped_bound = min(self.dropped_bound, float(bound[dropped].min()))
        state[dropped] = np.inf

    def _step(self, state: np.ndarray, kernel: _Kernel, mu: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """new[l + lc, d + dc] = min(state[l, d] + cost) over transitions; arg = transition index."""
        k_count, rows_l, cols_d = state.shape
        new = np.full(state.shape, np.inf)
        arg = np.full(state.shape, -1, dtype=np.int32)
        live = np.isfinite(state)
        if not live.any():
            return new, arg
        l_idx = np.flatnonzero(live.any(axis=(0, 2)))
        d_idx = np.flatnonzero(live.any(axis=(0, 1)))
        l0, l1, d0, d1 = l_idx[0], l_idx[-1] + 1, d_idx[0], d_idx[-1] + 1
        box = state[:, l0:l1, d0:d1]
        for n in range(len(kernel.layers)):
            lc, dc = int(kernel.layers[n]), int(kernel.units[n])
            top_l, top_d = min(l1 + lc, rows_l), min(d1 + dc, cols_d)
            if l0 + lc >= rows_l or d0 + dc >= cols_d:
                continue
            source = box[:, :top_l - l0 - lc, :top_d - d0 - dc]
            cost = kernel.cost[:, n]
            candidate = source + cost[:, None, None]
            if mu is not None:
                candidate = np.where(source + kernel.check[:, n][:, None, None] <= mu[:, None, None], candidate, np.inf)
            target = new[:, l0 + lc:top_l, d0 + dc:top_d]
            better = candidate < target
            if better.any():
                target[better] = candidate[better]
                arg[:, l0 + lc:top_l, d0 + dc:top_d][better] = n
        return new, arg

    def _close(self, state: np.ndarray, kernel: _Kernel, mu: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Per bucket the best full plan's DP value (M) and its closing (transition, layer, unit)."""
        k_count = state.shape[0]
        best = np.full(k_count, np.inf)
        where = np.full((k_count, 3), -1, dtype=np.int64)
        layers, width = self.total_layers, self.width
        if self.relaxed:  # devices rounded down: the others may use at most what is left
            reach = np.minimum.accumulate(state, axis=2)
        for n in range(len(kernel.layers)):
            lc, dc = int(kernel.layers[n]), int(kernel.units[n])
            if lc > layers or dc > width:
                continue
            if self.relaxed:
                before = reach[:, layers - lc, width - dc]
            else:
                before = state[:, layers - lc, width - dc]
            value = before + kernel.cost[:, n]
            if mu is not None:
                value = np.where(before + kernel.check[:, n] <= mu, value, np.inf)
            better = value < best
            best[better] = value[better]
            where[better] = (n, layers - lc, width - dc)
        return best, where


class _Pass:
    """Per stage count: the DP value per bucket and what is needed to recover the plan."""

    def __init__(self, k_count: int) -> None:
        self.k_count = k_count
        self.closings: dict[int, tuple] = {}

    def record(self, stages: int, values: np.ndarray, where: np.ndarray, history: list, kernel: _Kernel) -> None:
        self.closings[stages] = (values, where, history, kernel)

    def plan_rows(self, problem: _Problem, stages: int, bucket: int) -> list[int] | None:
        """Rows in pipeline order of the plan behind (stages, bucket); None if there is none."""
        values, where, history, kernel = self.closings[stages]
        if not np.isfinite(values[bucket]):
            return None
        n, l, d = (int(x) for x in where[bucket])
        rows = [int(kernel.rows[bucket, n])]
        for step_kernel, arg in reversed(history):
            m = int(arg[bucket, l, d])
            if m < 0:
                return None
            rows.append(int(step_kernel.rows[bucket, m]))
            l -= int(step_kernel.layers[m])
            d -= int(step_kernel.units[m])
        if l != 0 or d != 0:
            return None
        return rows  # first stage first: the closing stage is the first, history runs last -> first


# ------------------------------------------------------------------------------------------------
# the search over thresholds


def _stage_filter(choices: dict[str, Choices], stages: int, work: Workload, cluster: Cluster,
                  space: SearchSpace) -> dict[str, Choices]:
    """Choices allowed in an S-stage plan by the space's per-S rules (equal devices, layer slack)."""
    result = {}
    for role, pool in choices.items():
        mask = np.ones(len(pool), dtype=bool)
        if space.uniform_devices:
            mask &= pool.devices * stages == cluster.world
        if space.layer_slack is not None:
            allowed = np.array([space.layers_allowed(l, stages, work.num_layers) for l in range(work.num_layers + 1)])
            mask &= allowed[np.minimum(pool.layers, work.num_layers)]
        result[role] = pool.take(mask)
    return result


def _unit(choices: dict[str, Choices], world: int, total_layers: int) -> tuple[int, int]:
    """(exact unit = gcd of device counts, unit used: the smallest power-of-two multiple within STATE_LIMIT)."""
    devices = np.concatenate([pool.devices for pool in choices.values()] + [np.array([world])])
    exact = int(np.gcd.reduce(devices.astype(np.int64)))
    unit = exact
    while (total_layers + 1) * (world // unit + 1) > STATE_LIMIT and world % (unit * 2) == 0:
        unit *= 2
    return exact, unit


def _initial_buckets(values: np.ndarray, low: float, high: float) -> np.ndarray:
    """Up to BUCKETS thresholds among the distinct stable times in [low, high], spread by count."""
    inside = values[(values >= low) & (values <= high)]
    if len(inside) == 0:
        return np.array([high])
    if len(inside) <= BUCKETS:
        return inside
    picks = np.unique(np.round(np.linspace(0, len(inside) - 1, BUCKETS)).astype(int))
    return inside[picks]


def solve_partition(table: FrontierTable, work: Workload, cluster: Cluster, space: SearchSpace,
                    incumbent: float = math.inf) -> PartitionResult:
    """The best plan of this G (if it beats ``incumbent``) and a lower bound on every plan of this G."""
    g = table.grad_accum
    gap = space.gap
    stats = {"passes": 0, "dp_states": 0}
    choices = role_choices(table)
    s_options = [s for s in space.stage_count_options(work.num_layers, cluster.world)]
    best: StageSolution | None = None
    upper = incumbent
    if space.uniform_devices or space.layer_slack is not None:
        groups = [([s], _stage_filter(choices, s, work, cluster, space)) for s in s_options]
    else:
        groups = [(s_options, choices)]
    bound = math.inf
    for s_list, pool in groups:
        solution, group_bound = _solve_group(table, work, cluster, s_list, pool, upper, gap, stats)
        bound = min(bound, group_bound)
        if solution is not None and solution.objective < upper:
            best, upper = solution, solution.objective
    if best is not None:
        best.bound = min(bound, best.objective)
    return PartitionResult(best, min(bound, upper), stats)


def _prune_choices(choices: dict[str, Choices], g: int, upper: float) -> dict[str, Choices]:
    """A stage with ``G T >= best`` (first stage: ``G T + D``) is in no better plan."""
    if not math.isfinite(upper):
        return choices
    result = {}
    for role, pool in choices.items():
        least = g * pool.stable + (pool.delta if role in ("first", "only") else 0.0)
        result[role] = pool.take(least < upper)
    return result


def _solve_group(table: FrontierTable, work: Workload, cluster: Cluster, s_list: list[int],
                 choices: dict[str, Choices], upper: float, gap: float, stats: dict) -> tuple[StageSolution | None, float]:
    g = table.grad_accum
    choices = _prune_choices(choices, g, upper)
    if not s_list or all(len(pool) == 0 for pool in choices.values()):
        return None, math.inf
    exact_unit, unit = _unit(choices, cluster.world, work.num_layers)
    stats["unit"] = max(stats.get("unit", 0), unit)
    plan_problem = _Problem(table, work, cluster, s_list, choices, unit, relaxed=False)
    bound_problem = plan_problem if unit == exact_unit else _Problem(table, work, cluster, s_list, choices, unit, True)
    stable = np.unique(np.concatenate([pool.stable for pool in choices.values()]))
    if len(stable) == 0:
        return None, math.inf
    best: StageSolution | None = None
    # intervals of the bottleneck threshold still open: (low edge, thresholds inside)
    if g == 1:  # the bottleneck term vanishes: one threshold, every stage allowed
        open_sets = [(0.0, np.array([stable[-1]]))]
    else:
        open_sets = [(0.0, stable)]
    settled = math.inf  # least bound over the buckets closed so far
    passes = 0
    while open_sets and passes < MAX_PASSES:
        taus, lowers, members = _next_buckets(open_sets)
        passes += 1
        bound_pass = bound_problem.run(taus, lowers, upper, gap)
        plan_pass = bound_pass if bound_problem is plan_problem else plan_problem.run(taus, lowers, upper, gap)
        values = _bucket_values(bound_pass, g, lowers)  # [S, K] lower bounds
        best, upper = _harvest(plan_pass, plan_problem, table, g, best, upper, taus, lowers)
        open_sets = []
        for k in range(len(taus)):
            low_k = float(values[:, k].min()) if values.size else math.inf
            if low_k * (1 + gap) >= upper:
                settled = min(settled, low_k)
                continue
            inside = members[k]
            if len(inside) > 1:
                open_sets.append((lowers[k], inside))
                continue
            # a single threshold: what is left is a later stage's exposed delta (exposure mode), or
            # a coarsened device grid (nothing finer to do here)
            if bound_problem is plan_problem:
                refined, best, upper = _close_exposure(plan_problem, table, g, taus[k], lowers[k], low_k, best,
                                                       upper, gap, stats)
                settled = min(settled, refined)
            else:
                settled = min(settled, low_k)
    for low, inside in open_sets:  # out of passes: their lower edge bounds them
        settled = min(settled, (g - 1) * low)
    stats["passes"] += passes
    return best, min(settled, bound_problem.dropped_bound, upper)


def _next_buckets(open_sets: list[tuple[float, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Split the open threshold sets into at most BUCKETS buckets: (upper thresholds, lower edges, members)."""
    per_set = max(1, BUCKETS // max(1, len(open_sets)))
    taus, lowers, members = [], [], []
    for low, inside in open_sets:
        count = min(per_set, len(inside))
        cuts = np.unique(np.round(np.linspace(0, len(inside), count + 1)).astype(int))
        for a, b in zip(cuts[:-1], cuts[1:]):
            if b <= a:
                continue
            part = inside[a:b]
            taus.append(part[-1])
            lowers.append(part[0])  # a plan whose slowest stage is in this bucket has one of these times
            members.append(part)
    order = np.argsort(taus)
    return np.array(taus)[order], np.array(lowers)[order], [members[i] for i in order]


def _bucket_values(run: _Pass, g: int, lowers: np.ndarray) -> np.ndarray:
    """[S, K] lower bounds: (G-1) * lower edge + the DP value."""
    if not run.closings:
        return np.full((1, len(lowers)), np.inf)
    return np.array([(g - 1) * lowers + values for values, *_ in run.closings.values()])


def _harvest(run: _Pass, problem: _Problem, table: FrontierTable, g: int, best: StageSolution | None,
             upper: float, taus: np.ndarray, lowers: np.ndarray, limit: int = 8) -> tuple[StageSolution | None, float]:
    """Recover the plans behind the most promising (S, bucket) values (by ``(G-1) tau + value``, at
    most ``limit``) and keep the fastest by exact time."""
    picks = []
    for stages, (values, *_rest) in run.closings.items():
        for bucket in np.flatnonzero(np.isfinite(values)):
            if (g - 1) * lowers[bucket] + values[bucket] < upper:
                picks.append(((g - 1) * taus[bucket] + values[bucket], stages, int(bucket)))
    for _, stages, bucket in sorted(picks)[:limit]:
        rows = run.plan_rows(problem, stages, bucket)
        if rows is None:
            continue
        exact = pipeline_iteration_time(table.stable[rows], table.delta[rows], g)
        if exact < upper:
            upper, best = exact, _solution(table, rows, g)
    return best, upper


def _solution(table: FrontierTable, rows: list[int], g: int) -> StageSolution:
    stages = len(rows)
    layers = [int(table.configs.num_layers[r]) for r in rows]
    value = pipeline_iteration_time(table.stable[rows], table.delta[rows], g)
    return StageSolution(rows, layers, [min(stages - i, g) for i in range(stages)], value)


def _close_exposure(problem: _Problem, table: FrontierTable, g: int, tau: float, lower: float, low: float,
                    best: StageSolution | None, upper: float, gap: float, stats: dict) -> tuple[float, StageSolution | None, float]:
    """At one threshold, bisect the exposure bound mu (K values per pass) between the bound and the
    best plan; returns the refined lower bound of this threshold."""
    taus = np.array([tau])
    head = (g - 1) * lower
    mu_low, mu_high = low - head, upper - head  # M of any plan here lies above mu_low; mu_high is no use
    for _ in range(MAX_PASSES):
        if (head + mu_low) * (1 + gap) >= upper or mu_high - mu_low <= 1e-12 * max(1.0, upper):
            break
        mus = np.linspace(mu_low, mu_high, BUCKETS + 1)[1:]
        run = problem.run(taus, np.full(len(mus), lower), upper, gap, mu=mus)
        stats["passes"] += 1
        feasible = np.zeros(len(mus), dtype=bool)
        for values, *_rest in run.closings.values():
            feasible |= np.isfinite(values)
        best, upper = _harvest(run, problem, table, g, best, upper, np.full(len(mus), tau), np.full(len(mus), lower))
        if not feasible.any():
            mu_low = mus[-1]
            break
        first = int(np.argmax(feasible))
        mu_high = min(mus[first], upper - head)
        mu_low = mus[first - 1] if first > 0 else mu_low
    return min(head + mu_low, upper), best, upper


# ------------------------------------------------------------------------------------------------
# a quick incumbent


def uniform_solution(table: FrontierTable, stages: int, work: Workload, cluster: Cluster,
                     space: SearchSpace) -> StageSolution | None:
    """A quick incumbent: equal devices per stage, layers split as evenly as possible, and per stage
    the point that minimises ``G * stable + delta``. Exact time; used to prune before the DP."""
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
                best = StageSolution(rows, list(arrangement), [min(stages - i, g) for i in range(stages)], value,
                                     0.0, "HEURISTIC")
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
