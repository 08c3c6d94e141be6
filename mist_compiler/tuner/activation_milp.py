"""Per-tensor checkpoint/offload by MILP: which saved tensors of a layer to keep, recompute or offload.

Over a layer's saved-tensor table priced at one point (``cost.activation_policy.rows_at``), a
python-mip model chooses, for every node of the layer's program:

- ``r_v`` (binary): run the node again in the backward; its saved tensors are not kept;
- ``o_v`` (in [0, 1]): the fraction of its saved bytes kept in host memory;
- ``a_u`` (binary): the output of a node a recomputation reads is available: recomputed itself,
  kept by autograd (its offloaded fraction then comes back for the replay), or referenced from the
  forward at the price of its bytes (a layer input every layer reads costs nothing);

subject to ``r_v + o_v <= 1``, ``r_v <= r_u + a_u`` for every input ``u`` of a recomputed ``v`` (the
recompute chains), and the layer's device bytes (what autograd keeps, less the recomputed and the
offloaded, plus the referenced outputs) within a budget; it minimises the recompute seconds plus the
exposed copy seconds (the offloaded bytes' transfer beyond the layer's forward and backward compute,
``e >= bytes / bandwidth - compute``). Each solve has a time limit, reports its gap, and starts from
the best layer-level choice that fits (keep everything, recompute everything recomputable, or offload
one fraction of everything), so its answer is never worse than the layer-level plan. Solutions for a
grid of budgets are the layer's activation frontier (:func:`frontier`).

Solver: CBC (bundled with python-mip); HiGHS when building and solving a tiny model with it works
(``probe_solver``: an import of highspy proves nothing, ``shared/TORCH-NOTES.md`` section 9).
"""
from __future__ import annotations

import contextlib
import io
import math
from dataclasses import dataclass, replace

from ..cost.activation_policy import CopyRates, TensorRow
from ..ir.plan import ActivationPolicy

DEFAULT_TIME_LIMIT_S = 2.0
MOVE_TIE_BREAK = 1e-3  # objective seconds per second of (hidden) copy: offload nothing that buys nothing
_solver: str | None = None


def probe_solver() -> str:
    """"HIGHS" if a tiny model builds and solves to optimality with it here, else "CBC" (cached)."""
    global _solver
    if _solver is None:
        _solver = "CBC"
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                _solver = _probe_highs()
        except Exception:  # any failure of the optional solver means CBC
            _solver = "CBC"
    return _solver


def _probe_highs() -> str:
    import mip

    model = mip.Model(sense=mip.MINIMIZE, solver_name="HIGHS")
    model.verbose = 0
    x = model.add_var(var_type=mip.BINARY)
    model += x >= 1
    model.objective = x
    solved = model.optimize(max_seconds=5) == mip.OptimizationStatus.OPTIMAL and abs(x.x - 1) < 1e-6
    return "HIGHS" if solved else "CBC"


@dataclass(frozen=True)
class ActivationSolution:
    """One point of the frontier: a policy and its price at the rows' point."""

    policy: ActivationPolicy
    kept: float  # device bytes per layer and micro-batch
    offloaded: float
    seconds: float  # recompute + exposed copies, per layer and micro-batch
    budget: float
    status: str  # OPTIMAL, FEASIBLE (time limit, gap below), or LAYER-LEVEL (the warm start stood)
    gap: float
    solver: str


def _held(by_tag: dict[str, TensorRow], recompute) -> set[str]:
    """The values a recomputation of ``recompute`` starts from (read by it, not recomputed themselves)."""
    return {u for v in recompute for u in by_tag[v].inputs} - set(recompute)


def price(rows: list[TensorRow], policy: ActivationPolicy, rates: CopyRates) -> tuple[float, float, float]:
    """(kept bytes, offloaded bytes, seconds) of ``policy`` (the rule of ``cost.activation_policy``)."""
    by_tag = {row.tag: row for row in rows}
    recompute = set(policy.recompute)
    held = _held(by_tag, recompute)
    fractions = policy.offload_fractions
    kept = offloaded = seconds = 0.0
    for row in rows:
        if row.tag in recompute:
            seconds += row.seconds
            continue
        fraction = fractions.get(row.tag, 0.0)
        kept += row.saved * (1 - fraction)
        offloaded += row.saved * fraction
        if row.tag in held and not row.output_saved and not row.shared:
            kept += row.output
    return kept, offloaded, seconds + rates.exposed(offloaded)


def layer_level(rows: list[TensorRow], budget: float, rates: CopyRates) -> ActivationPolicy | None:
    """The best layer-level choice within ``budget`` (keep all; recompute all that can be; offload one
    fraction of all that can be), or None: the MILP's warm start."""
    options = [ActivationPolicy()]
    options.append(ActivationPolicy(tuple(r.tag for r in rows if r.recomputable)))
    movable = [r for r in rows if r.offloadable and r.saved > 0]
    total = sum(r.saved for r in rows)
    if movable:
        moved = sum(r.saved for r in movable)
        fraction = min(1.0, max(0.0, (total - budget) / moved)) if moved else 0.0
        fraction = math.ceil(fraction * 1e6) / 1e6
        options.append(ActivationPolicy((), tuple(sorted((r.tag, fraction) for r in movable if fraction > 0))))
    fitting = [(price(rows, p, rates)[2], i, p) for i, p in enumerate(options)
               if price(rows, p, rates)[0] <= budget * (1 + 1e-9)]
    return min(fitting)[2] if fitting else None


def solve(rows: list[TensorRow], budget: float, rates: CopyRates, *, time_limit_s: float = DEFAULT_TIME_LIMIT_S,
          solver: str | None = None, offload: bool = True, offload_held: bool = True) -> ActivationSolution | None:
    """The cheapest policy whose kept bytes fit ``budget`` (None: nothing fits); ``offload_held=False``: the
    values a recomputation starts from stay on the device; ``offload=False``:
    recomputation only."""
    if not offload:
        rows = [replace(row, offloadable=False) for row in rows]
    import mip

    solver = solver or probe_solver()
    by_tag = {row.tag: row for row in rows}
    model = mip.Model(sense=mip.MINIMIZE, solver_name=solver)
    model.verbose = 0
    model.threads = 1
    r = {row.tag: model.add_var(var_type=mip.BINARY) for row in rows if row.recomputable}
    o = {row.tag: model.add_var(lb=0.0, ub=1.0) for row in rows if row.offloadable and row.saved > 0}
    # variables and constraints in the table's order, never a set's: CBC's answer among equal-cost
    # optima follows the model's order, and a set's order changes with PYTHONHASHSEED (the same
    # tuning would write a different plan in every process)
    needed = dict.fromkeys(u for v in r for u in by_tag[v].inputs)
    a = {u: model.add_var(var_type=mip.BINARY) for u in needed}
    for tag in (t for t in r if t in o):
        model += r[tag] + o[tag] <= 1
    for v in r:
        for u in by_tag[v].inputs:
            model += (r[u] if u in r else 0) + a[u] >= r[v]
    # a held value autograd keeps costs nothing more (and may still be offloaded: the replay reads it
    # back); one it does not keep is referenced whole
    held_bytes = [by_tag[u].output * available for u, available in a.items()
                  if not by_tag[u].shared and not by_tag[u].output_saved]
    for u, available in a.items():
        if not offload_held and u in o and by_tag[u].output_saved and not by_tag[u].shared:
            model += available + o[u] <= 1
    total = sum(row.saved for row in rows)
    offloaded = mip.xsum(by_tag[t].saved * var for t, var in o.items())
    kept = total - mip.xsum(by_tag[t].saved * var for t, var in r.items()) - offloaded + mip.xsum(held_bytes)
    model += kept <= budget
    exposed_out, exposed_in = model.add_var(lb=0.0), model.add_var(lb=0.0)
    model += exposed_out >= offloaded * (1.0 / rates.d2h_bytes_per_s) - rates.forward_s
    model += exposed_in >= offloaded * (1.0 / rates.h2d_bytes_per_s) - rates.backward_s
    # a copy that hides behind compute still takes the link and host memory: a thousandth of its transfer
    # time breaks the ties between moving bytes for nothing and keeping them (never more than that)
    moves = offloaded * (MOVE_TIE_BREAK / rates.d2h_bytes_per_s)
    model.objective = mip.xsum(by_tag[t].seconds * var for t, var in r.items()) + exposed_out + exposed_in + moves
    start = layer_level(rows, budget, rates)
    if start is not None:
        model.start = _start_values(start, rows, rates, r, o, a, exposed_out, exposed_in)
    status = model.optimize(max_seconds=time_limit_s)
    if status not in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE) or model.num_solutions == 0:
        return _solution(start, rows, rates, budget, "LAYER-LEVEL", 0.0, solver) if start is not None else None
    recompute = tuple(t for t, var in r.items() if var.x > 0.5)
    # fractions rounded up (as ``layer_level``'s): rounding to nearest could keep a few bytes over the budget
    fractions = tuple(sorted((t, min(1.0, math.ceil(var.x * 1e6 - 1e-6) / 1e6)) for t, var in o.items()
                             if var.x > 1e-6 and t not in recompute))
    found = _pruned(rows, ActivationPolicy(recompute, fractions), rates)
    objective, bound = model.objective_value, model.objective_bound
    gap = 0.0 if objective <= 1e-12 or status == mip.OptimizationStatus.OPTIMAL else max(0.0, (objective - bound) / objective)
    best = _solution(found, rows, rates, budget, "OPTIMAL" if status == mip.OptimizationStatus.OPTIMAL else "FEASIBLE",
                     gap, solver)
    if best.kept > budget * (1 + 1e-6) or (start is not None and price(rows, start, rates)[2] < best.seconds - 1e-12):
        return _solution(start, rows, rates, budget, "LAYER-LEVEL", gap, solver) if start is not None else None
    return best


def _pruned(rows: list[TensorRow], policy: ActivationPolicy, rates: CopyRates) -> ActivationPolicy:
    """``policy`` without the recomputations that buy nothing: the MILP is indifferent to a node that
    saves nothing and costs nothing to run again (a no-op cast), but the runtime would replay it. A
    node no other recomputed node reads is dropped while the layer keeps no more bytes and spends no
    more seconds without it."""
    by_tag = {row.tag: row for row in rows}
    kept, _, seconds = price(rows, policy, rates)
    recompute = list(policy.recompute)
    changed = True
    while changed:
        changed = False
        read = {u for v in recompute for u in by_tag[v].inputs}
        for tag in [t for t in reversed(recompute) if t not in read]:
            trial = ActivationPolicy(tuple(t for t in recompute if t != tag), policy.offload)
            trial_kept, _, trial_seconds = price(rows, trial, rates)
            if trial_kept <= kept and trial_seconds <= seconds:
                recompute.remove(tag)
                kept, seconds, changed = trial_kept, trial_seconds, True
                break
    return ActivationPolicy(tuple(recompute), policy.offload)


def _start_values(policy: ActivationPolicy, rows, rates, r, o, a, exposed_out, exposed_in) -> list:
    recompute, fractions = set(policy.recompute), policy.offload_fractions
    by_tag = {row.tag: row for row in rows}
    values = [(var, 1.0 if t in recompute else 0.0) for t, var in r.items()]
    values += [(var, fractions.get(t, 0.0)) for t, var in o.items()]
    held = _held(by_tag, recompute)
    values += [(var, 1.0 if u in held else 0.0) for u, var in a.items()]
    _, offloaded, _ = price(rows, policy, rates)
    values += [(exposed_out, max(0.0, offloaded / rates.d2h_bytes_per_s - rates.forward_s)),
               (exposed_in, max(0.0, offloaded / rates.h2d_bytes_per_s - rates.backward_s))]
    return values


def _solution(policy: ActivationPolicy, rows, rates, budget, status, gap, solver) -> ActivationSolution:
    kept, offloaded, seconds = price(rows, policy, rates)
    return ActivationSolution(policy, kept, offloaded, seconds, budget, status, gap, solver)


def frontier(rows: list[TensorRow], rates: CopyRates, *, points: int = 6,
             time_limit_s: float = DEFAULT_TIME_LIMIT_S, offload: bool = True,
             offload_held: bool = True) -> list[ActivationSolution]:
    """Solutions for ``points`` budgets from the least memory a policy reaches while the residual stream
    stays (recompute all that can be but the row-parallel outputs and what reads them, offload the rest)
    up to below keeping everything, and for the least memory of all (recomputing those too: a layer that
    keeps only its input, with one TP rank); distinct and Pareto-optimal (kept, seconds), least memory
    first. ``offload=False``: recomputation only; ``offload_held=False``: the values a recomputation
    starts from stay on the device (as :func:`solve`). (A second grid from that least memory found better
    plans for some ladder cases and worse for others: the tuner samples each frontier.)"""
    total = sum(row.saved for row in rows)
    by_tag = {row.tag: row for row in rows}

    def least(replay_residual: bool) -> float:
        recompute = {r.tag for r in rows if r.recomputable and (replay_residual or not r.tp_reduced)}
        held = _held(by_tag, recompute)
        return price(rows, ActivationPolicy(tuple(r.tag for r in rows if r.tag in recompute),
                                            tuple(sorted((r.tag, 1.0) for r in rows if r.offloadable and r.saved > 0
                                                         and r.tag not in recompute and offload
                                                         and (offload_held or r.tag not in held)))), rates)[0]

    floor, lowest = least(False), least(True)
    if total <= 0 or min(floor, lowest) >= total:
        return []
    budgets = [floor + (total - floor) * k / points for k in range(points)] if floor < total else []
    solutions: list[ActivationSolution] = []
    for budget in budgets + ([lowest] if lowest < floor else []):
        found = solve(rows, budget * (1 + 1e-9), rates, time_limit_s=time_limit_s, offload=offload,
                      offload_held=offload_held)
        if found is not None and found.policy not in [s.policy for s in solutions]:
            solutions.append(found)
    solutions.sort(key=lambda s: (s.kept, s.seconds))
    pareto, best = [], math.inf
    for solution in solutions:
        if solution.seconds < best - 1e-15:
            pareto.append(solution)
            best = solution.seconds
    return pareto


class ActivationFrontiers:
    """The layer's activation frontier per ``(tp, sp)``, solved once per tuning (at micro-batch 1 and
    the workload's sequence: a policy's choices scale with the batch) and registered in the cost model;
    calling it gives the policies' indices for ``StageCandidates.act_policy``."""

    def __init__(self, cost_model, work, space) -> None:
        self.cost_model, self.points = cost_model, getattr(space, "activation_points", 5)
        # what the space allows: recomputation unless checkpointing is off, offload (beside it) only where
        # activation offload is on (``--no-offload acts`` offloads no activations, per tensor or per layer).
        # With offload, two frontiers: one offloading the values a recomputation starts from too, one
        # keeping them on the device (each is priced at micro-batch 1, where copies look free that the
        # stage model, at the real micro-batch and beside the other channels, may not find so). A third,
        # recomputation alone, changed no plan of plan_quality's 20 cases or the tuning ladder's rungs
        # and cost a third of the per-tensor variants' tuning time: only where offload is off.
        recompute = getattr(space, "ckpt", "tune") != "none"
        offload = getattr(space, "offload_acts", True)
        if not recompute:
            self.modes: tuple[tuple[bool, bool], ...] = ()  # (offload, offload_held) per frontier
        else:
            self.modes = ((True, False), (True, True)) if offload else ((False, False),)
        table = getattr(cost_model, "layer_table", None)
        self.available = table is not None and table(False) is not None
        self.solutions: dict[tuple[int, bool], list[ActivationSolution]] = {}
        self.indices: dict[tuple[int, bool], list[int]] = {}
        self.seconds = 0.0
        self.dominated = 0  # (tp, sp) keys whose eager layer is slower than the compiled one checkpointed

    def __call__(self, tp: int, sp: bool) -> list[int]:
        key = (int(tp), bool(sp))
        if key not in self.indices:
            import time

            started = time.perf_counter()
            worth = self.available and self.cost_model.policies_can_pay(*key)
            self.dominated += self.available and not worth
            priced = self.cost_model.layer_rows(*key) if worth else None
            solutions = [s for offload, held in self.modes
                         for s in frontier(*priced, points=self.points, offload=offload, offload_held=held)] \
                if priced is not None else []  # recomputation alone, and with offload (copies compete with collectives)
            self.solutions[key] = solutions
            self.indices[key] = list(dict.fromkeys(self.cost_model.add_policy(s.policy) for s in solutions
                                                   if s.policy.nodes))
            self.seconds += time.perf_counter() - started
        return self.indices[key]

    def summary(self) -> dict:
        solved = [s for group in self.solutions.values() for s in group]
        return {"solver": probe_solver() if solved else None, "frontiers": len(self.solutions),
                "policies": sum(len(v) for v in self.indices.values()), "seconds": round(self.seconds, 3),
                "dominated": self.dominated,
                "worst_gap": max((s.gap for s in solved), default=0.0),
                "statuses": sorted({s.status for s in solved})}


__all__ = ["ActivationFrontiers", "ActivationSolution", "CopyRates", "frontier", "layer_level", "price", "probe_solver", "solve"]
