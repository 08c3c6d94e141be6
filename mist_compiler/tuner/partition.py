"""DP engines for the stage partition (``inter_stage`` drives them).

Both place stages from the last one backwards over layer counts (the layers are identical), so the
number of stages already placed gives the next stage's in-flight need and one pass serves every
stage count S. Each works on K *lanes* at once (the arrays carry a leading lane axis): a lane is a
bottleneck threshold tau (stages with ``T > tau`` are not allowed), plus an exposure bound mu or
a device price lambda. Per state they keep the least suffix sum ``Q`` of stage times (the first
stage adds its delta): with every ``T <= tau`` a plan costs at most ``(G-1) tau + M`` and at least
``(G-1) tau_low + M`` where ``M = max_i (D_i + Q_i)``; counting only the first stage's delta
gives the lower bound, and an exposure bound (``D_i + Q_i <= mu`` on every stage) makes the min-Q
DP exact for M.

- :class:`GridDP`: states (layers covered, devices covered in units of their gcd); exact.
- :class:`LagrangeDP`: states are layers only; the device total is priced instead: every stage
  pays ``lambda * devices`` and the plan gets ``lambda * world`` back, which bounds every plan from
  below for any lambda (Lagrangian relaxation). Its layer splits become plans through
  :func:`repair_devices`, a DP over devices for that split. Used where the grid would be large.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .intra_stage import FrontierTable, _pareto_sorted
from .stage_configs import PP_BOTH, PP_NONE, PP_POST, PP_PRE

ROLES = {"only": PP_BOTH, "first": PP_PRE, "middle": PP_NONE, "last": PP_POST}
WITH_DELTA = ("first", "only")  # the first stage's delta is counted in the bound


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


def stage_role(placed: int) -> str:
    """Role of the stage placed after ``placed`` later ones (0: the last stage)."""
    return "last" if placed == 0 else "middle"


class DPRun:
    """Per stage count S: the DP value per lane and what is needed to recover the plan."""

    def __init__(self) -> None:
        self.closings: dict[int, tuple] = {}

    def values(self) -> dict[int, np.ndarray]:
        return {stages: closing[0] for stages, closing in self.closings.items()}


# ------------------------------------------------------------------------------------------------
# exact grid DP


@dataclass
class _Kernel:
    """Transitions of one role and in-flight need: per (layers, device units) the best row in each
    lane (min ``cost``), or in exposure mode every row (with its ``stable + delta`` to check)."""

    layers: np.ndarray  # [n]
    units: np.ndarray  # [n]
    cost: np.ndarray  # [K, n] value added (inf: not allowed in that lane)
    check: np.ndarray  # [K, n] stable + delta: exposure mode allows a row if Q_old + check <= mu; bound
    # mode takes each cell's least (a bound on the stage's D_i + Q_i over Q_old)
    rows: np.ndarray  # [K, n] table row


class GridDP:
    """Exact DP over (layers covered, device units covered) for one G."""

    def __init__(self, g: int, total_layers: int, world: int, s_list: list[int], choices: dict[str, Choices],
                 unit: int) -> None:
        self.g, self.total_layers, self.unit = g, total_layers, unit
        self.width = world // unit
        self.s_list = s_list
        self.choices = {role: pool.take(pool.devices % unit == 0) for role, pool in choices.items()}
        self._kernels: dict = {}
        self.dropped_bound = math.inf  # least bound of a state dropped against the incumbent

    def kernel(self, role: str, need: int, taus: np.ndarray, mu: np.ndarray | None) -> _Kernel:
        key = (role, need, taus.tobytes(), None if mu is None else mu.tobytes())
        if key not in self._kernels:
            self._kernels[key] = self._build_kernel(role, need, taus, mu)
        return self._kernels[key]

    def _build_kernel(self, role: str, need: int, taus: np.ndarray, mu: np.ndarray | None) -> _Kernel:
        pool = self.choices[role]
        pool = pool.take((pool.fit >= need) & (pool.stable <= taus.max()))
        units = pool.devices // self.unit
        allowed = pool.stable[None, :] <= taus[:, None]  # [K, n]
        if mu is not None:  # exposure mode: every row is its own transition, but a row another row of
            # its cell beats in both stable and stable + delta is never the better one
            keep = _dominance_free(pool.layers * (self.width + 2) + units, pool.stable, pool.stable + pool.delta)
            pool, units, allowed = pool.take(keep), units[keep], allowed[:, keep]
            cost = np.where(allowed, pool.stable[None, :], np.inf)
            check = np.where(allowed, (pool.stable + pool.delta)[None, :], np.inf)
            return _Kernel(pool.layers, units, cost, check, np.broadcast_to(pool.rows, allowed.shape).copy())
        value = pool.stable + (pool.delta if role in WITH_DELTA else 0.0)
        exposed = pool.stable + pool.delta
        key = pool.layers.astype(np.int64) * (self.width + 2) + units
        cells, inverse = np.unique(key, return_inverse=True)
        cost = np.full((len(taus), len(cells)), np.inf)
        check = np.full((len(taus), len(cells)), np.inf)
        rows = np.full((len(taus), len(cells)), -1, dtype=np.int64)
        order = np.argsort(value, kind="stable")
        for lane in range(len(taus)):
            picked = order[allowed[lane, order]]
            cell = inverse[picked]
            first = np.unique(cell, return_index=True)[1]
            cost[lane, cell[first]] = value[picked[first]]
            rows[lane, cell[first]] = pool.rows[picked[first]]
            np.minimum.at(check[lane], cell, exposed[picked])
        return _Kernel((cells // (self.width + 2)).astype(int), (cells % (self.width + 2)).astype(int), cost, check, rows)

    def run(self, taus: np.ndarray, lower: np.ndarray, incumbent: float, gap: float,
            mu: np.ndarray | None = None, track: bool = False) -> DPRun:
        """One pass over K lanes: tau thresholds, each with an exposure bound ``mu`` in exposure mode
        (a single tau is shared by every mu).

        Values only, unless ``track`` (then the argmins too, for :meth:`plans`)."""
        lanes = len(taus) if mu is None else len(mu)
        taus = taus if mu is None or len(taus) == lanes else np.full(lanes, taus[0])
        state = np.full((lanes, self.total_layers + 1, self.width + 1), np.inf)
        state[:, 0, 0] = 0.0
        exposure = None if mu is not None else np.full(state.shape, -np.inf)  # bound on M of the placed stages
        run, history = DPRun(), []
        run.inputs = (taus, lower, incumbent, gap, mu)
        s_max = max(self.s_list, default=0)
        rest = self._completion(taus) if math.isfinite(incumbent) else None
        for placed in range(s_max):
            stages = placed + 1
            if stages in self.s_list:
                kernel = self.kernel("only" if stages == 1 else "first", 1 if stages == 1 else min(stages, self.g),
                                     taus, mu)
                values, where = self._close(state, exposure, kernel, mu)
                run.closings[stages] = (values, where, list(history), kernel)
            if stages >= s_max:
                break
            kernel = self.kernel(stage_role(placed), min(placed + 1, self.g), taus, mu)
            if kernel.cost.shape[1] == 0:
                break
            state, exposure, arg = self._step(state, exposure, kernel, mu, track)
            history.append((kernel, arg))
            self._prune(state, exposure, lower, rest, incumbent, gap)
            if not np.isfinite(state).any():
                break
        return run

    def plans(self, run: DPRun, picks: list[tuple[int, int]]) -> list[list[int] | None]:
        """Table rows (pipeline order) of the plans behind (stages, lane) picks of an untracked run:
        the pass is repeated on those lanes alone with its argmins kept."""
        if not picks:
            return []
        taus, lower, incumbent, gap, mu = run.inputs
        lanes = sorted({lane for _, lane in picks})
        where = {lane: i for i, lane in enumerate(lanes)}
        index = np.array(lanes)
        again = self.run(taus[index], lower[index], incumbent, gap, None if mu is None else mu[index], track=True)
        return [self.plan_rows(again, stages, where[lane]) if stages in again.closings else None
                for stages, lane in picks]

    def _completion(self, taus: np.ndarray) -> np.ndarray:
        """[K, L+1, D+1]: a lower bound on what the stages still to place (the first and some middle
        ones, in-flight needs relaxed) add to the DP value when (layers, units) are covered: their
        Lagrangian bound ``max_lambda R_lambda(L - l) - lambda (W - d)`` over a few device prices,
        where ``R_lambda(x)`` is the least priced sum of such stages covering x layers."""
        layers, width = self.total_layers, self.width
        pooled = [pool for pool in self.choices.values() if len(pool)]
        if not pooled:
            return np.full((len(taus), layers + 1, width + 1), np.inf)
        price = float(np.median(np.concatenate([p.stable / p.devices for p in pooled]))) * self.unit
        best = np.full((len(taus), layers + 1, width + 1), -np.inf)
        remaining_layers = layers - np.arange(layers + 1)
        remaining_units = (width - np.arange(width + 1)).astype(float)
        for lam in np.concatenate([[0.0], price * 2.0 ** np.arange(-3, 4)]):
            prefix = _prefix_sums(self.choices, taus, lam / self.unit, layers)  # [K, L+1]
            bound = prefix[:, remaining_layers][:, :, None] - lam * remaining_units[None, None, :]
            np.maximum(best, bound, out=best)
        return best

    def _prune(self, state: np.ndarray, exposure: np.ndarray | None, lower: np.ndarray, rest: np.ndarray | None,
               incumbent: float, gap: float) -> None:
        """Drop states whose value plus the least completion cannot beat the incumbent by the gap."""
        if rest is None:
            return
        live = np.isfinite(state)
        head = (self.g - 1) * lower if self.g > 1 else np.zeros(len(lower))
        with np.errstate(invalid="ignore"):
            bound = state + rest
            if exposure is not None:
                np.maximum(bound, exposure, out=bound)
            bound += head[:, None, None]
        dropped = (bound * (1 + gap) >= incumbent) & live
        if dropped.any():
            self.dropped_bound = min(self.dropped_bound, float(bound[dropped].min()))
            state[dropped] = np.inf

    def _step(self, state: np.ndarray, exposure: np.ndarray | None, kernel: _Kernel, mu: np.ndarray | None,
              track: bool) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """new[l + lc, d + dc] = min(state[l, d] + cost) over transitions (and the exposure bound
        min max(M, Q + check)); arg = transition index (if tracked)."""
        _, rows_l, cols_d = state.shape
        new = np.full(state.shape, np.inf)
        new_exposure = None if exposure is None else np.full(state.shape, np.inf)
        arg = np.full(state.shape, -1, dtype=np.int32) if track else None
        live = np.isfinite(state)
        if not live.any():
            return new, new_exposure, arg
        l_idx = np.flatnonzero(live.any(axis=(0, 2)))
        d_idx = np.flatnonzero(live.any(axis=(0, 1)))
        l0, l1, d0, d1 = l_idx[0], l_idx[-1] + 1, d_idx[0], d_idx[-1] + 1
        box = state[:, l0:l1, d0:d1]
        box_exposure = None if exposure is None else exposure[:, l0:l1, d0:d1]
        finite = np.isfinite(kernel.cost)
        first_lane = np.argmax(finite, axis=0)  # lanes are in ascending threshold order: a row allowed
        for n in np.flatnonzero(finite.any(axis=0)):  # in one lane is allowed in every later lane
            lc, dc = int(kernel.layers[n]), int(kernel.units[n])
            if l0 + lc >= rows_l or d0 + dc >= cols_d:
                continue
            k0 = int(first_lane[n]) if finite[first_lane[n]:, n].all() else 0
            top_l, top_d = min(l1 + lc, rows_l), min(d1 + dc, cols_d)
            region = (slice(k0, None), slice(l0 + lc, top_l), slice(d0 + dc, top_d))
            source = box[k0:, :top_l - l0 - lc, :top_d - d0 - dc]
            candidate = source + kernel.cost[k0:, n][:, None, None]
            if mu is not None:
                candidate[source + kernel.check[k0:, n][:, None, None] > mu[k0:, None, None]] = np.inf
            else:
                reach = source + kernel.check[k0:, n][:, None, None]
                np.maximum(reach, box_exposure[k0:, :top_l - l0 - lc, :top_d - d0 - dc], out=reach)
                np.minimum(new_exposure[region], reach, out=new_exposure[region])
            target = new[region]
            if not track:
                np.minimum(target, candidate, out=target)
                continue
            better = candidate < target
            if better.any():
                target[better] = candidate[better]
                arg[region][better] = n
        return new, new_exposure, arg

    def _close(self, state: np.ndarray, exposure: np.ndarray | None, kernel: _Kernel,
               mu: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Per lane the best full plan's DP value (bound mode: the bound on M; exposure mode: Q) and its
        closing (transition, layers, units before it)."""
        lanes = state.shape[0]
        best = np.full(lanes, np.inf)
        where = np.full((lanes, 3), -1, dtype=np.int64)
        for n in range(len(kernel.layers)):
            lc, dc = int(kernel.layers[n]), int(kernel.units[n])
            if lc > self.total_layers or dc > self.width:
                continue
            before = state[:, self.total_layers - lc, self.width - dc]
            value = before + kernel.cost[:, n]
            if mu is not None:
                value = np.where(before + kernel.check[:, n] <= mu, value, np.inf)
            else:
                value = np.maximum(value, exposure[:, self.total_layers - lc, self.width - dc])
            better = value < best
            best[better] = value[better]
            where[better] = (n, self.total_layers - lc, self.width - dc)
        return best, where

    @staticmethod
    def plan_rows(run: DPRun, stages: int, lane: int) -> list[int] | None:
        """Table rows in pipeline order of the plan behind (stages, lane); None if there is none."""
        values, where, history, kernel = run.closings[stages]
        if not np.isfinite(values[lane]):
            return None
        n, l, d = (int(x) for x in where[lane])
        rows = [int(kernel.rows[lane, n])]  # the closing stage is the first; history runs last -> first
        for step_kernel, arg in reversed(history):
            m = int(arg[lane, l, d])
            if m < 0:
                return None
            rows.append(int(step_kernel.rows[lane, m]))
            l -= int(step_kernel.layers[m])
            d -= int(step_kernel.units[m])
        return rows if l == 0 and d == 0 else None


def _dominance_free(group: np.ndarray, first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """Mask of rows no other row of the same group matches or beats in both values (one row per tie)."""
    keep = np.zeros(len(group), dtype=bool)
    if len(group):
        order = np.lexsort((second, first, group))
        keep[order[_pareto_sorted(group[order], second[order])]] = True
    return keep


def _prefix_sums(choices: dict[str, Choices], taus: np.ndarray, lam: float, layers: int) -> np.ndarray:
    """[K, L+1]: least ``sum (value + lam * devices)`` of a first stage followed by any number of
    middle stages (any in-flight capacity) covering x layers with every ``T <= tau``; inf at x = 0."""
    lanes = len(taus)

    def least(role: str) -> np.ndarray:
        table = np.full((lanes, layers + 1), np.inf)
        pool = choices[role]
        if len(pool):
            value = pool.stable + (pool.delta if role in WITH_DELTA else 0.0) + lam * pool.devices
            for lane in range(lanes):
                ok = pool.stable <= taus[lane]
                np.minimum.at(table[lane], pool.layers[ok], value[ok])
        return table

    first, middle = least("first"), least("middle")
    result = first.copy()
    live = np.flatnonzero(np.isfinite(middle).any(axis=0))
    for x in range(1, layers + 1):  # R(x) = min(first(x), min_lc R(x - lc) + middle(lc))
        steps = live[(live >= 1) & (live < x)]
        if len(steps):
            result[:, x] = np.minimum(result[:, x], (result[:, x - steps] + middle[:, steps]).min(axis=1))
    return result


def _completion_rates(choices: dict[str, Choices], taus: np.ndarray) -> tuple[np.ndarray, float]:
    """Per lane the least stable time per layer of a stage still to place, and the least first-stage delta."""
    rates = np.full(len(taus), np.inf)
    for role in ("middle", "first"):
        pool = choices[role]
        if len(pool):
            per_layer = pool.stable / np.maximum(pool.layers, 1)
            order = np.argsort(pool.stable)
            running = np.minimum.accumulate(per_layer[order])
            count = np.searchsorted(pool.stable[order], taus, side="right")
            rates = np.minimum(rates, np.where(count > 0, running[np.maximum(count - 1, 0)], np.inf))
    first = choices["first"]
    return rates, float(first.delta.min()) if len(first) else 0.0


# ------------------------------------------------------------------------------------------------
# Lagrangian DP over layers


class LagrangeDP:
    """DP over layers only, devices priced at ``lambda`` per device (one lane = one (tau, lambda))."""

    def __init__(self, g: int, total_layers: int, world: int, s_list: list[int], choices: dict[str, Choices]) -> None:
        self.g, self.total_layers, self.world, self.s_list = g, total_layers, world, s_list
        self.choices = choices
        self._kernels: dict = {}

    def kernel(self, role: str, need: int, taus: np.ndarray, lams: np.ndarray) -> tuple[np.ndarray, ...]:
        """(cost, row, devices), each [K, L+1]: per lane and layer count the least ``value + lambda * devices``."""
        key = (role, need, taus.tobytes(), lams.tobytes())
        if key in self._kernels:
            return self._kernels[key]
        pool = self.choices[role]
        pool = pool.take((pool.fit >= need) & (pool.stable <= taus.max()))
        lanes, width = len(taus), self.total_layers + 1
        cost = np.full((lanes, width), np.inf)
        rows = np.full((lanes, width), -1, dtype=np.int64)
        devices = np.zeros((lanes, width))
        if len(pool):
            value = pool.stable + (pool.delta if role in WITH_DELTA else 0.0)
            priced = value[None, :] + lams[:, None] * pool.devices[None, :]
            priced = np.where(pool.stable[None, :] <= taus[:, None], priced, np.inf)
            order = np.argsort(pool.layers, kind="stable")
            layers = pool.layers[order]
            priced = priced[:, order]
            starts = np.flatnonzero(np.r_[True, layers[1:] != layers[:-1]])
            least = np.minimum.reduceat(priced, starts, axis=1)
            sizes = np.diff(np.r_[starts, len(layers)])
            hit = priced == np.repeat(least, sizes, axis=1)
            first = np.minimum.reduceat(np.where(hit, np.arange(len(layers))[None, :], len(layers)), starts, axis=1)
            first = np.minimum(first, len(layers) - 1)
            ok = np.isfinite(least)
            cost[:, layers[starts]] = least
            rows[:, layers[starts]] = np.where(ok, pool.rows[order][first], -1)
            devices[:, layers[starts]] = pool.devices[order][first]
        self._kernels[key] = (cost, rows, devices)
        return self._kernels[key]

    def run(self, taus: np.ndarray, lams: np.ndarray, bottoms: np.ndarray | None = None,
            incumbent: float = math.inf) -> DPRun:
        """Per S and lane: ``min sum (value + lambda d) - lambda world``; ``run.devices[S]`` the argmin's
        device total. With ``bottoms`` and ``incumbent`` the chain stops once no lane can still beat it."""
        lanes, layers = len(taus), self.total_layers
        state = np.full((lanes, layers + 1), np.inf)
        state[:, 0] = 0.0
        used = np.zeros((lanes, layers + 1))
        run, history = DPRun(), []
        run.devices = {}
        s_max = max(self.s_list, default=0)
        everyone = np.arange(lanes)
        head = (self.g - 1) * bottoms - lams * self.world if bottoms is not None else None
        rates = self._rates(taus, lams) if head is not None else None
        for placed in range(s_max):
            stages = placed + 1
            if stages in self.s_list:
                cost, rows, devices = self.kernel("only" if stages == 1 else "first",
                                                  1 if stages == 1 else min(stages, self.g), taus, lams)
                lcs = np.arange(1, layers + 1)
                total = state[:, layers - lcs] + cost[:, lcs]
                pick = np.argmin(total, axis=1)
                values = total[everyone, pick] - lams * self.world
                run.closings[stages] = (values, lcs[pick], list(history), rows)
                run.devices[stages] = used[everyone, layers - lcs[pick]] + devices[everyone, lcs[pick]]
            if stages >= s_max:
                break
            cost, rows, devices = self.kernel(stage_role(placed), min(placed + 1, self.g), taus, lams)
            state, used, arg = _min_plus_layers(state, used, cost, devices)
            history.append((rows, arg))
            if head is not None and math.isfinite(incumbent):
                remaining = layers - np.arange(layers + 1)
                with np.errstate(invalid="ignore"):
                    rest = np.where(remaining > 0, remaining[None, :] * rates[:, None], np.inf)
                if ((head[:, None] + state + rest).min(axis=1) >= incumbent).all():
                    break
            if not np.isfinite(state).any():
                break
        return run

    def _rates(self, taus: np.ndarray, lams: np.ndarray) -> np.ndarray:
        """Per lane the least ``(value + lambda d) / layers`` of a stage still to place (>= 0)."""
        rates = np.full(len(taus), np.inf)
        for role in ("middle", "first"):
            pool = self.choices[role]
            if len(pool):
                priced = (pool.stable[None, :] + lams[:, None] * pool.devices[None, :]) / pool.layers[None, :]
                priced = np.where(pool.stable[None, :] <= taus[:, None], priced, np.inf)
                rates = np.minimum(rates, priced.min(axis=1))
        return rates

    def split(self, run: DPRun, stages: int, lane: int) -> list[tuple[str, int, int]] | None:
        """The plan's (role, in-flight need, layers) per stage in pipeline order."""
        values, closing, history, _ = run.closings[stages]
        if not np.isfinite(values[lane]):
            return None
        lc = int(closing[lane])
        result = [("only" if stages == 1 else "first", 1 if stages == 1 else min(stages, self.g), lc)]
        l = self.total_layers - lc
        for placed, (_, arg) in reversed(list(enumerate(history))):
            lc = int(arg[lane, l])
            if lc <= 0:
                return None
            result.append((stage_role(placed), min(placed + 1, self.g), lc))
            l -= lc
        return result if l == 0 else None


def _min_plus_layers(state: np.ndarray, used: np.ndarray, cost: np.ndarray,
                     devices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """new[l] = min over lc of state[l - lc] + cost[lc] per lane (one gather over every layer count),
    with the argmin's layer count and the device total along it."""
    lanes, width = state.shape
    live = np.flatnonzero(np.isfinite(cost).any(axis=0))
    new = np.full(state.shape, np.inf)
    arg = np.zeros(state.shape, dtype=np.int32)
    new_used = np.zeros(state.shape)
    if len(live) == 0:
        return new, new_used, arg
    padded = np.concatenate([state, np.full((lanes, 1), np.inf)], axis=1)
    source = np.arange(width)[:, None] - live[None, :]  # [l, j] -> l - lc_j
    source = np.where(source >= 0, source, width)  # the inf column
    total = padded[:, source] + cost[:, live][:, None, :]  # [K, l, j]
    pick = np.argmin(total, axis=2)
    lanes_index = np.arange(lanes)[:, None]
    layer_index = np.arange(width)[None, :]
    new = total[lanes_index, layer_index, pick]
    chosen = live[pick]
    arg = np.where(np.isfinite(new), chosen, 0).astype(np.int32)
    origin = np.maximum(layer_index - chosen, 0)
    new_used = np.where(np.isfinite(new), used[lanes_index, origin] + devices[lanes_index, chosen], 0.0)
    return new, new_used, arg


def repair_devices(choices: dict[str, Choices], split: list[tuple[str, int, int]], world: int,
                   tau: float) -> list[int] | None:
    """Rows for a fixed layer split: per stage the device count (and point) minimising the summed
    stage times (the first stage's delta included) with every ``T <= tau`` and devices adding up
    to ``world`` exactly; a DP over devices. None if no assignment exists."""
    options = []
    for role, need, layers in split:
        pool = choices[role]
        pool = pool.take((pool.fit >= need) & (pool.layers == layers) & (pool.stable <= tau))
        if len(pool) == 0:
            return None
        value = pool.stable + (pool.delta if role in WITH_DELTA else 0.0)
        order = np.lexsort((value, pool.devices))
        first = np.r_[True, pool.devices[order][1:] != pool.devices[order][:-1]]
        options.append(pool.take(order[first]))  # per device count its best point
    unit = int(np.gcd.reduce(np.concatenate([p.devices for p in options] + [np.array([world])]).astype(np.int64)))
    width = world // unit
    state = np.full(width + 1, np.inf)
    state[0] = 0.0
    picks = []
    for (role, _, _), pool in zip(split, options):
        value = pool.stable + (pool.delta if role in WITH_DELTA else 0.0)
        units = pool.devices // unit
        new = np.full(width + 1, np.inf)
        pick = np.full(width + 1, -1)
        for i in range(len(pool)):
            if units[i] > width:
                continue
            candidate = state[:width + 1 - units[i]] + value[i]
            target = new[units[i]:]
            better = candidate < target
            target[better] = candidate[better]
            pick[units[i]:][better] = i
        state = new
        picks.append(pick)
    if not math.isfinite(state[width]):
        return None
    rows, d = [], width
    for pool, pick in zip(reversed(options), reversed(picks)):
        i = int(pick[d])
        rows.append(int(pool.rows[i]))
        d -= int(pool.devices[i] // unit)
    return rows[::-1]
