"""Inter-stage tuning: the layer split and one frontier point per stage, by dynamic programming.

The layers are identical, so a stage is its layer *count*, its device count and a point of its
cell's frontier; stage order matters only through the in-flight micro-batches a stage must fit
(position i of S holds ``min(S - i, G)``) and which stages hold the embedding (first) and the head
(last). With ``T_i``/``D_i`` the chosen points' stable and delta times, the iteration time
(DESIGN.md 2.3, ``pipeline_iteration_time``) is

    F = (G-1) max_i T_i + sum_i T_i + max(0, max_i (D_i - sum_{j<i} T_j))
      = (G-1) max_i T_i + M,    M = max_i (D_i + Q_i),   Q_i = T_i + ... + T_{S-1}

(``D_i >= 0``). As in Alpa and Metis, a *bottleneck threshold* tau (every ``T_i <= tau``) leaves a
min-sum problem that a DP over layer counts solves (``partition``). The distinct stage times are
cut into buckets; a pass evaluates many buckets at once, and a bucket whose lower bound
``(G-1) tau_low + DP value`` is within the target gap of the best plan is settled, otherwise split,
down to single stage times. Plans come from the DP's argmins and are timed exactly.

- Where (layers x device units) is small, the exact grid DP runs; at a single threshold the last
  gap (a later stage's delta exposed) is closed by bisecting an exposure bound ``mu``.
- On big clusters the device dimension is priced instead (Lagrangian relaxation, lambda searched
  per bucket), and each layer split the DP finds gets its device counts from a DP over devices.
  The bound stays valid; the reported gap says how tight it is.

Every bound is relative to the frontier tables; stages with ``G T >= best`` never enter and DP
states that cannot beat the best plan by the gap are dropped (their bound is kept).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..cost.stage_api import pipeline_iteration_time
from .intra_stage import FrontierTable
from .stage_configs import PP_BOTH, PP_NONE, PP_POST, PP_PRE
from .partition import Choices, DPRun, GridDP, LagrangeDP, repair_devices, role_choices
from .space import Cluster, SearchSpace, Workload

BUCKETS = 16  # lanes of one DP pass
FIRST_BUCKETS = 4  # lanes of a grid DP's first pass
GRID_STATES = 40_000  # (layers + 1) x device units up to which the exact grid DP is used
LAMBDA_STEPS = 8  # device prices tried per bucket and round (Lagrangian mode)
QUICK_PLAN_STATES = 3_000  # grids larger than this first get a plan from the Lagrangian DP
LAMBDA_BUCKETS = 8  # threshold buckets per pass in Lagrangian mode (lanes: buckets x prices)
MAX_PASSES = 40


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
class PartitionResult:
    """Outcome of one G: the best plan found (None: nothing beats the incumbent) and a lower bound
    on every plan of this G (at least the incumbent where nothing can beat it)."""

    solution: StageSolution | None
    bound: float
    stats: dict = field(default_factory=dict)


def solve_partition(table: FrontierTable, work: Workload, cluster: Cluster, space: SearchSpace,
                    incumbent: float = math.inf, method: str | None = None) -> PartitionResult:
    """The best plan of this G (if it beats ``incumbent``) and a lower bound on every plan of this G.

    ``method``: ``"grid"`` or ``"lagrange"`` to force a DP (default: by the grid's size)."""
    stats = {"passes": 0, "method": set()}
    choices = role_choices(table)
    s_options = space.stage_count_options(work.num_layers, cluster.world)
    if space.uniform_devices or space.layer_slack is not None:
        groups = [([s], _stage_filter(choices, s, work, cluster, space)) for s in s_options]
    else:
        groups = [(s_options, choices)]
    best, upper, bound = None, incumbent, math.inf
    for s_list, pool in groups:
        solution, group_bound = _solve_group(table, work, cluster, s_list, pool, upper, space.gap, stats, method)
        bound = min(bound, group_bound)
        if solution is not None and solution.objective < upper:
            best, upper = solution, solution.objective
    if best is not None:
        best.bound = min(bound, best.objective)
    stats["method"] = "+".join(sorted(stats["method"]))
    return PartitionResult(best, min(bound, upper), stats)


def _stage_filter(choices: dict[str, Choices], stages: int, work: Workload, cluster: Cluster,
                  space: SearchSpace) -> dict[str, Choices]:
    """Choices allowed in an S-stage plan by the space's per-S rules (equal devices, layer slack)."""
    allowed = np.array([space.layers_allowed(l, stages, work.num_layers) for l in range(work.num_layers + 1)])
    result = {}
    for role, pool in choices.items():
        mask = allowed[np.minimum(pool.layers, work.num_layers)]
        if space.uniform_devices:
            mask &= pool.devices * stages == cluster.world
        result[role] = pool.take(mask)
    return result


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
                 choices: dict[str, Choices], upper: float, gap: float, stats: dict,
                 method: str | None) -> tuple[StageSolution | None, float]:
    g = table.grad_accum
    choices = _prune_choices(choices, g, upper)
    stable = np.unique(np.concatenate([pool.stable for pool in choices.values()]))
    if not s_list or len(stable) == 0:
        return None, math.inf
    devices = np.concatenate([pool.devices for pool in choices.values()] + [np.array([cluster.world])])
    unit = int(np.gcd.reduce(devices.astype(np.int64)))
    states = (work.num_layers + 1) * (cluster.world // unit + 1)
    method = method or ("grid" if states <= GRID_STATES else "lagrange")
    stats["method"].add(method)
    open_sets = [(np.array([stable[-1]]) if g == 1 else stable)]  # G = 1: no bottleneck term
    if method == "grid":
        best = None
        if states > QUICK_PLAN_STATES and len(s_list) > 1:  # a good plan first makes the exact DP prune far more
            best, upper = _quick_plan(table, work, cluster, s_list, choices, stable, upper)
        dp = GridDP(g, work.num_layers, cluster.world, s_list, choices, unit)
        found, bound = _grid_search(dp, table, g, open_sets, upper, gap, stats)
        return (found or best), bound
    dp = LagrangeDP(g, work.num_layers, cluster.world, s_list, choices)
    return _lagrange_search(dp, choices, table, g, cluster.world, open_sets, upper, gap, stats)


def _quick_plan(table: FrontierTable, work: Workload, cluster: Cluster, s_list: list[int],
                choices: dict[str, Choices], stable: np.ndarray, upper: float) -> tuple[StageSolution | None, float]:
    """A plan from the Lagrangian DP (layer splits, devices repaired) at a few thresholds: cheap, and
    usually close to the optimum, so the exact DP that follows drops most states at once."""
    dp = LagrangeDP(table.grad_accum, work.num_layers, cluster.world, s_list, choices)
    picks = np.unique(np.round(np.linspace(0, len(stable) - 1, 4)).astype(int))
    tops = stable[picks]
    pooled = [pool for pool in choices.values() if len(pool)]
    price = float(np.median(np.concatenate([p.stable / p.devices for p in pooled])))
    _, best, upper, _ = _dual_bounds(dp, choices, table, table.grad_accum, cluster.world, tops, tops, price, None,
                                     upper, rounds=2)
    return best, upper


def _next_buckets(open_sets: list[np.ndarray], count: int) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Cut the open sets of stage times into at most ``count`` buckets: (top, bottom, members) each;
    a plan whose slowest stage lies in a bucket has one of its times."""
    per_set = max(2, count // max(1, len(open_sets)))  # every open set is split: progress each pass
    tops, bottoms, members = [], [], []
    for inside in open_sets:
        cuts = np.unique(np.round(np.linspace(0, len(inside), min(per_set, len(inside)) + 1)).astype(int))
        for a, b in zip(cuts[:-1], cuts[1:]):
            if b > a:
                tops.append(inside[b - 1])
                bottoms.append(inside[a])
                members.append(inside[a:b])
    order = np.argsort(tops)
    return np.array(tops)[order], np.array(bottoms)[order], [members[i] for i in order]


def _solution(table: FrontierTable, rows: list[int], g: int) -> StageSolution:
    stages = len(rows)
    layers = [int(table.configs.num_layers[r]) for r in rows]
    value = pipeline_iteration_time(table.stable[rows], table.delta[rows], g)
    return StageSolution(rows, layers, [min(stages - i, g) for i in range(stages)], value)


def _keep_best(table: FrontierTable, g: int, rows: list[int] | None, best: StageSolution | None,
               upper: float) -> tuple[StageSolution | None, float]:
    if rows is None:
        return best, upper
    exact = pipeline_iteration_time(table.stable[rows], table.delta[rows], g)
    if exact < upper:
        return _solution(table, rows, g), exact
    return best, upper


def _promising(run: DPRun, g: int, tops: np.ndarray, bottoms: np.ndarray, upper: float,
               limit: int = 8) -> list[tuple[int, int]]:
    """(stages, lane) of the best-looking plans (by ``(G-1) top + value``) that may beat ``upper``."""
    picks = []
    for stages, values in run.values().items():
        for lane in np.flatnonzero(np.isfinite(values)):
            if (g - 1) * bottoms[lane] + values[lane] < upper:
                picks.append(((g - 1) * tops[lane] + values[lane], stages, int(lane)))
    return [(stages, lane) for _, stages, lane in sorted(picks)[:limit]]


def _lane_bounds(run: DPRun, g: int, bottoms: np.ndarray) -> np.ndarray:
    """Per lane: ``(G-1) * bottom + least DP value over stage counts``."""
    values = list(run.values().values())
    least = np.min(np.array(values), axis=0) if values else np.full(len(bottoms), np.inf)
    return (g - 1) * bottoms + least


# ------------------------------------------------------------------------------------------------
# exact grid mode


def _grid_search(dp: GridDP, table: FrontierTable, g: int, open_sets: list[np.ndarray], upper: float, gap: float,
                 stats: dict) -> tuple[StageSolution | None, float]:
    """Threshold passes until every bucket is settled or down to one stage time; those left (a later
    stage's delta exposed) go to exposure passes: is there a plan at that threshold whose M beats
    the best plan by the gap (``mu`` just under it)? No: the threshold is settled. Yes: its plan is
    kept, and the threshold is asked again with a ladder of lower ``mu`` values, so a much better
    plan is found in a few passes. Many thresholds share a pass; the most promising buckets go
    first, and exposure passes alternate with threshold passes (a better plan settles buckets)."""
    best, settled, passes = None, math.inf, 0
    waiting = [(-math.inf, inside) for inside in open_sets]  # (bound, stage times) of open buckets
    exposed: dict[float, bool] = {}  # threshold -> whether a plan beating the target was found there
    last_was_threshold = False
    while (waiting or exposed) and passes < MAX_PASSES:
        passes += 1
        if waiting and not (exposed and last_was_threshold):
            last_was_threshold = True
            waiting.sort(key=lambda item: item[0])
            lanes = BUCKETS if passes > 1 else FIRST_BUCKETS
            taken, waiting = _take_sets(waiting, lanes)
            tops, bottoms, members = _next_buckets(taken, lanes)
            run = dp.run(tops, bottoms, upper, gap)
            for rows in dp.plans(run, _promising(run, g, tops, bottoms, upper)):
                best, upper = _keep_best(table, g, rows, best, upper)
            bounds = _lane_bounds(run, g, bottoms)
            for k in range(len(tops)):
                if bounds[k] * (1 + gap) >= upper:
                    settled = min(settled, bounds[k])
                elif len(members[k]) > 1:
                    waiting.append((bounds[k], members[k]))
                else:
                    exposed[float(tops[k])] = False
            kept = [(bound, inside) for bound, inside in waiting if bound * (1 + gap) < upper]
            for bound, _ in waiting:
                if bound * (1 + gap) >= upper:
                    settled = min(settled, bound)  # a better plan settled it
            waiting = kept
            continue
        last_was_threshold = False
        best, upper, closed = _exposure_pass(dp, table, g, exposed, best, upper, gap)
        settled = min(settled, closed)
    for bound, inside in waiting:  # out of passes: the better of the bound found and the lower edge
        settled = min(settled, max(bound, (g - 1) * inside[0]))
    for tau in exposed:
        settled = min(settled, (g - 1) * tau)
    stats["passes"] += passes
    return best, min(settled, dp.dropped_bound, upper)


def _take_sets(waiting: list[tuple[float, np.ndarray]], lanes: int) -> tuple[list[np.ndarray], list]:
    """The open sets a pass of ``lanes`` lanes splits (lowest bound first, two lanes or more each)."""
    count = max(1, min(len(waiting), lanes // 2))
    return [inside for _, inside in waiting[:count]], waiting[count:]


EXPOSURE_LADDER = (0.0, 0.005, 0.01, 0.02, 0.04)  # relative steps below the target once a threshold had a plan


def _exposure_pass(dp: GridDP, table: FrontierTable, g: int, exposed: dict[float, bool], best: StageSolution | None,
                   upper: float, gap: float) -> tuple[StageSolution | None, float, float]:
    """One pass of exposure checks; returns the best plan, its time and the least bound of the
    thresholds it settled (removed from ``exposed``)."""
    target = upper / (1 + gap) * (1 - 1e-12)  # strictly better than the best plan by the gap
    taus, mus, owners = [], [], []
    for tau, had_plan in sorted(exposed.items()):
        for step in (EXPOSURE_LADDER if had_plan else (0.0,)):
            if len(taus) < BUCKETS:
                taus.append(tau)
                mus.append(target * (1 - step) - (g - 1) * tau)
                owners.append(step)
    taus, mus, owners = np.array(taus), np.array(mus), np.array(owners)
    run = dp.run(taus, taus, upper, gap, mu=mus)
    feasible = np.zeros(len(mus), dtype=bool)
    for values in run.values().values():
        feasible |= np.isfinite(values)
    for rows in dp.plans(run, _promising(run, g, taus, taus, math.inf)):
        best, upper = _keep_best(table, g, rows, best, upper)
    closed = math.inf
    for tau in np.unique(taus):
        at_target = (taus == tau) & (owners == 0.0)
        if at_target.any() and not feasible[at_target].any():
            closed = min(closed, target)  # no plan at this threshold beats the best by the gap
            del exposed[float(tau)]
        else:
            exposed[float(tau)] = True
    return best, upper, closed


# ------------------------------------------------------------------------------------------------
# Lagrangian mode (big clusters)


def _lagrange_search(dp: LagrangeDP, choices: dict[str, Choices], table: FrontierTable, g: int, world: int,
                     open_sets: list[np.ndarray], upper: float, gap: float, stats: dict) -> tuple[StageSolution | None, float]:
    best, settled, passes = None, math.inf, 0
    pooled = [pool for pool in choices.values() if len(pool)]
    price = float(np.median(np.concatenate([p.stable / p.devices for p in pooled])))  # seconds per device
    while open_sets and passes < MAX_PASSES:
        tops, bottoms, members = _next_buckets(open_sets, LAMBDA_BUCKETS)
        bounds, best, upper, rounds = _dual_bounds(dp, choices, table, g, world, tops, bottoms, price, best, upper)
        passes += rounds
        open_sets = []
        for k in range(len(tops)):
            if bounds[k] * (1 + gap) >= upper:
                settled = min(settled, bounds[k])
            elif len(members[k]) > 1:
                open_sets.append(members[k])
            else:  # the relaxation's own gap: nothing finer to try here
                settled = min(settled, bounds[k])
    for inside in open_sets:
        settled = min(settled, (g - 1) * inside[0])
    stats["passes"] += passes
    return best, min(settled, upper)


def _dual_bounds(dp: LagrangeDP, choices: dict[str, Choices], table: FrontierTable, g: int, world: int,
                 tops: np.ndarray, bottoms: np.ndarray, price: float, best: StageSolution | None,
                 upper: float, rounds: int = 4) -> tuple[np.ndarray, StageSolution | None, float, int]:
    """Per bucket the best Lagrangian bound over device prices lambda >= 0 (the dual is concave in
    lambda: log-spaced grids, each narrowed to the neighbours of its best point, widened when the
    best is at the top end), and plans repaired from the most promising splits."""
    count = len(tops)
    bounds = np.full(count, -np.inf)
    low, high = np.full(count, price * 1e-4), np.full(count, price * 1e4)
    for round_ in range(rounds):
        lams = np.exp(np.linspace(np.log(low), np.log(high), LAMBDA_STEPS)).T
        if round_ == 0:
            lams[:, 0] = 0.0
        lane_tops, lane_bottoms = np.repeat(tops, LAMBDA_STEPS), np.repeat(bottoms, LAMBDA_STEPS)
        run = dp.run(lane_tops, lams.ravel(), lane_bottoms, upper)
        lane_bounds = _lane_bounds(run, g, lane_bottoms).reshape(lams.shape)
        pick = np.argmax(lane_bounds, axis=1)
        everyone = np.arange(count)
        bounds = np.maximum(bounds, lane_bounds[everyone, pick])
        at_top = pick == LAMBDA_STEPS - 1
        low = np.where(at_top, lams[everyone, pick], np.maximum(lams[everyone, np.maximum(pick - 1, 0)], price * 1e-9))
        high = np.where(at_top, lams[everyone, pick] * 1e4, lams[everyone, np.minimum(pick + 1, LAMBDA_STEPS - 1)])
        best, upper = _repair_plans(dp, run, choices, table, g, world, lane_tops,
                                    everyone * LAMBDA_STEPS + pick, best, upper)
    return bounds, best, upper, rounds


def _repair_plans(dp: LagrangeDP, run: DPRun, choices: dict[str, Choices], table: FrontierTable, g: int, world: int,
                  tops: np.ndarray, lanes: np.ndarray, best: StageSolution | None,
                  upper: float, per_lane: int = 3) -> tuple[StageSolution | None, float]:
    """Plans from the splits of the given lanes (their best few stage counts), with device counts
    chosen by a DP over devices to add up exactly."""
    values = run.values()
    for lane in lanes:
        ranked = sorted((float(v[lane]), stages) for stages, v in values.items() if np.isfinite(v[lane]))
        for _, stages in ranked[:per_lane]:
            split = dp.split(run, stages, int(lane))
            if split is not None:
                rows = repair_devices(choices, split, world, tops[lane])
                best, upper = _keep_best(table, g, rows, best, upper)
    return best, upper


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
