"""``mist_compiler.tune``: model + cluster + global batch -> the fastest Plan the cost model predicts.

The search: gradient-accumulation counts G in order of a cheap bound; first evenly split plans for
every G (an incumbent that prunes everything after), then per G each stage cell's Pareto frontier
(intra_stage) and the stage partition (inter_stage: a DP over layer counts by 1F1B's closed form,
exact up to a certified gap). A G whose bound cannot beat the best plan is skipped. Then the
schedules (``schedules``): every G's best layout and the even layouts become plans of each schedule
the space allows, all priced by simulating their action lists (``cost/schedule.py``), the 1F1B
plans included; the fastest that fits wins. The result carries the plan, its simulated time,
per-stage estimates, the breakdown and search statistics with the lower bound and gap of the
1F1B partition (and the frontiers it chose from, for ``mistc explain``).
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from ..cost.schedule import PlanPrice, choose_fused_loss, price_plan
from ..cost.stage_api import LOSS_CHOOSE, StageCandidates, StageCostModel
from ..ir.plan import Offload, Plan, StagePlan
from ..ir.vocabulary import COMPILED_DEFAULT
from .activation_milp import ActivationFrontiers
from .inter_stage import StageSolution, solve_partition, uniform_solution
from .intra_stage import FrontierTable, build_frontiers
from .schedules import StagePool, even_layouts, layout_of, schedule_candidates, stash_ratio_of
from .space import Cluster, SearchSpace, TuneError, Workload
from .stage_configs import PP_BOTH, PP_NONE, PP_POST, PP_PRE

Progress = Callable[[str], None]


@dataclass
class StageReport:
    """Exact estimates of one chosen stage (at its real in-flight count)."""

    index: int
    stable_s: float
    delta_s: float
    peak_memory_bytes: float
    inflight: int
    breakdown: dict[str, float] = field(default_factory=dict)


@dataclass
class TuneResult:
    plan: Plan
    predicted_time_s: float
    stages: list[StageReport]
    breakdown: dict[str, float]
    stats: dict
    device_memory_bytes: float
    frontiers: dict = field(default_factory=dict)  # chosen G: per stage, the frontier it chose from
    model_config: object = None  # the model's TransformerConfig when known (for MFU)
    peak_flops: float | None = None  # dense peak FLOP/s of one device in the training dtype
    model_flops: float | None = None  # model FLOPs of one iteration, counted on the program (``cost.flops``)

    @property
    def mfu(self) -> float | None:
        from ..cost.flops import mfu

        return mfu(self, self.model_config, self.peak_flops)

    @property
    def tokens_per_s(self) -> float:
        return self.plan.global_batch * self.plan.seq_len / self.predicted_time_s


def _stderr_progress(message: str) -> None:
    print(f"[tune] {message}", file=sys.stderr, flush=True)


def check_request(work: Workload, cluster: Cluster, space: SearchSpace, hardware_gpus_per_node: int | None) -> None:
    """Reject requests that cannot have a plan, naming the limit and the smallest change that fits."""
    if work.global_batch < 1:
        raise TuneError(f"global_batch must be >= 1, got {work.global_batch}")
    if work.seq_len < 1:
        raise TuneError(f"seq_len must be >= 1, got {work.seq_len}")
    if hardware_gpus_per_node is not None and cluster.gpus_per_node > hardware_gpus_per_node:
        raise TuneError(
            f"gpus_per_node = {cluster.gpus_per_node} exceeds the hardware profile's {hardware_gpus_per_node} "
            f"GPUs per node; use --gpus-per-node {hardware_gpus_per_node} or fewer"
        )
    stage_options = space.stage_count_options(work.num_layers, cluster.world)
    if space.stage_counts is not None and not stage_options:
        raise TuneError(
            f"stage_counts {list(space.stage_counts)} all exceed the model's {work.num_layers} layers or the "
            f"{cluster.world} devices; the most stages possible is {min(work.num_layers, cluster.world)}"
        )
    tp_max = max((max(space.tp_options(s, work.heads), default=0) for s in space.device_shapes(cluster.nodes, cluster.gpus_per_node)), default=0)
    if tp_max == 0:
        raise TuneError(f"no tensor-parallel degree in {space.tp_degrees} divides the model's {work.heads} heads")
    usable = min(work.num_layers, cluster.world) * work.global_batch * tp_max
    if cluster.world > usable:
        raise TuneError(
            f"{cluster.world} devices are more than this model and batch can use ({usable} = stages "
            f"{min(work.num_layers, cluster.world)} x global batch {work.global_batch} x TP {tp_max}); "
            f"use at most {usable} devices or a larger global batch"
        )
    if not _batch_divisible(work, cluster, space):
        smallest = _smallest_data_parallel(work, cluster, space)
        fix = -(-work.global_batch // smallest) * smallest
        raise TuneError(
            f"global batch {work.global_batch} cannot be split: every stage layout of {cluster.world} devices needs "
            f"a data-parallel degree that divides it (the smallest is {smallest}); use a global batch that is a "
            f"multiple of {smallest}, e.g. {fix}"
        )


def _stage_dp_degrees(work: Workload, cluster: Cluster, space: SearchSpace) -> set[int]:
    degrees = set()
    for shape in space.device_shapes(cluster.nodes, cluster.gpus_per_node):
        for tp in space.tp_options(shape, work.heads):
            degrees.add(shape.count // tp)
    return degrees


def _batch_divisible(work: Workload, cluster: Cluster, space: SearchSpace) -> bool:
    return any(work.global_batch % dp == 0 for dp in _stage_dp_degrees(work, cluster, space))


def _smallest_data_parallel(work: Workload, cluster: Cluster, space: SearchSpace) -> int:
    return min(_stage_dp_degrees(work, cluster, space) or {1})


def _memory_diagnosis(cost_model: StageCostModel, work: Workload, cluster: Cluster, space: SearchSpace) -> str:
    """The smallest device memory at which some evenly split plan of the searched space fits."""
    best = math.inf
    data_parallel: set[int] = set()  # dp degrees of the layouts tried, and whether the batch split over any
    batch_splits = False
    combos = space.offload_combos()
    most = combos.max(axis=0)
    zero = max(space.zero_levels)
    for stages in space.stage_count_options(work.num_layers, cluster.world):
        if cluster.world % stages:
            continue
        per_stage = cluster.world // stages
        shapes = [s for s in space.device_shapes(cluster.nodes, cluster.gpus_per_node) if s.count == per_stage]
        layers = -(-work.num_layers // stages)
        for shape in shapes:
            for tp in space.tp_options(shape, work.heads):
                dp = shape.count // tp
                data_parallel.add(dp)
                for g in space.grad_accum_options(work.global_batch):
                    if work.global_batch % (dp * g):
                        continue
                    batch_splits = True
                    micro = work.global_batch // (dp * g)
                    if not space.micro_batch_allowed(np.array([micro]))[0]:
                        continue
                    roles = [(PP_BOTH, 1)] if stages == 1 else [(PP_PRE, min(stages, g)), (PP_POST, 1)]
                    if stages > 2:
                        roles.append((PP_NONE, min(stages - 1, g)))
                    ckpt = 0 if space.ckpt == "none" else layers
                    peaks = []
                    for pp, inflight in roles:
                        candidates = StageCandidates(
                            num_layers=layers, has_pre=bool(pp & 1), has_post=pp >= PP_POST, nodes=shape.nodes,
                            gpus_per_node=shape.gpus, micro_batch=micro, dp=dp, tp=tp, zero=zero, ckpt_layers=ckpt,
                            offload_weights=most[0], offload_grads=most[1], offload_opt=most[2], offload_acts=most[3],
                            inflight=inflight, grad_accum=g, fused_loss=LOSS_CHOOSE,
                        )
                        peaks.append(float(cost_model.evaluate(candidates).peak_memory_bytes[0]))
                    best = min(best, max(peaks))
    have = cost_model.device_memory_bytes / 1e9
    if not math.isfinite(best) and data_parallel and not batch_splits:
        return (f"no plan: global batch {work.global_batch} cannot be split over the data-parallel degrees the searched "
                f"space allows on {cluster.world} devices ({sorted(data_parallel)}); use a global batch divisible by "
                f"{min(data_parallel)}, or a space with pipeline stages")
    if not math.isfinite(best):
        return (f"no plan: no stage layout of the searched space is valid for {cluster.world} devices and global batch "
                f"{work.global_batch} (micro-batch sizes, layer splits or stage counts rule every one out)")
    return (f"no plan fits in {have:.2f} GB per device: the smallest memory that would fit (evenly split, every "
            f"saving knob of the searched space at its maximum) is {best / 1e9:.2f} GB per device; use devices with at "
            f"least that much memory, more devices, or a smaller global batch/sequence")


def tune(cost_model: StageCostModel, work: Workload, cluster: Cluster, *, space: SearchSpace | None = None,
         progress: Progress | None = None, model_config: object = None) -> TuneResult:
    """Search the fastest plan for ``work`` (layers, TP granularity, batch, sequence, dtype: read
    from the captured program by ``driver.workload``) on ``cluster``, priced by ``cost_model``
    (its hardware profile, gradient dtype and compiled or eager units are the plans'). ``model_config``:
    the model's sizes (``driver.ir_shape``), for the closed-form MFU when the cost model counts no FLOPs."""
    space = space or SearchSpace()
    say = progress or (lambda message: None)
    started = time.perf_counter()
    profile = getattr(cost_model, "hardware", None)
    check_request(work, cluster, space, profile.gpus_per_node if profile is not None else None)
    search = _Search(cost_model, work, cluster, space, say, started)
    search.stats["analysis_s"] = 0.0
    best, best_table = search.run()
    if best is None:
        raise TuneError(_memory_diagnosis(cost_model, work, cluster, space))
    plan, price = search.choose_schedule()
    plan = replace(plan, compiled=getattr(cost_model, "compiled", COMPILED_DEFAULT))  # what it was priced as
    result = _result(cost_model, plan, price, search.stats, _frontier_summary(best_table, best))
    result.model_config = model_config
    result.peak_flops = profile.peak_flops.get(work.dtype) if profile is not None else None
    per_sequence = getattr(cost_model, "model_flops_per_sequence", None)
    result.model_flops = per_sequence() * work.global_batch if per_sequence is not None else None
    _flag_optimistic_mfu(result, profile)
    return result


def _flag_optimistic_mfu(result: TuneResult, profile) -> None:
    """Warn when the predicted MFU is above what the best published runs on this hardware reach."""
    ceiling = getattr(profile, "mfu_ceiling", None)
    utilisation = result.mfu
    if ceiling is None or utilisation is None or utilisation <= ceiling:
        return
    note = (f"predicted MFU {utilisation:.1%} is above {ceiling:.0%}, the best published training runs on "
            f"{profile.name}: the prices for this model's ops are likely optimistic (measure the target with "
            f"`mistc profile`)")
    result.stats["mfu_flag"] = note
    result.stats["warning"] = f"{result.stats['warning']}; {note}" if result.stats.get("warning") else note


class _Search:
    """The search loop: G values in order of a cheap bound; per G the frontiers, then the stage
    partition (DP). A quick pass over evenly split plans first sets an incumbent that prunes
    configurations in every later frontier. Keeps a lower bound on every plan to report the gap."""

    def __init__(self, cost_model: StageCostModel, work: Workload, cluster: Cluster, space: SearchSpace,
                 say: Progress, started: float) -> None:
        self.cost_model, self.work, self.cluster, self.space = cost_model, work, cluster, space
        self.say, self.started = say, started
        self.stage_options = space.stage_count_options(work.num_layers, cluster.world)
        self.max_stages = max(self.stage_options)
        self.incumbent = math.inf
        self.trade: list[int] | None = None
        self.best = None
        self.best_table: FrontierTable | None = None
        self.activations = ActivationFrontiers(cost_model, work, space)  # per-tensor policies per (tp, sp), made once
        self.stats: dict = {"space": space.describe(), "grad_accum_tried": 0, "partitions": 0,
                            "grad_accum_skipped": 0, "evaluated": 0, "frontier_points": 0, "dp_passes": 0}
        self.per_g: dict[int, list[tuple[FrontierTable, StageSolution]]] = {}  # each G's 1F1B plans found

    def consider(self, solution: StageSolution | None, table: FrontierTable) -> None:
        if solution is not None:
            self.per_g.setdefault(table.grad_accum, []).append((table, solution))
        if solution is not None and solution.objective < self.incumbent:
            self.incumbent, self.best, self.best_table = solution.objective, solution, table
            self.say(f"S={len(solution.rows)} G={table.grad_accum}: {solution.objective * 1e3:.1f} ms per iteration "
                     f"({solution.status}, {time.perf_counter() - self.started:.1f}s)")

    def frontiers(self, g: int, space: SearchSpace) -> FrontierTable:
        table = build_frontiers(self.cost_model, self.work, self.cluster, space, g, self.max_stages, self.incumbent,
                                self.trade, self.activations if space.per_tensor and self.activations.available else None)
        if self.trade is None and "trade_families" in table.stats:
            self.trade = table.stats["trade_families"]  # a property of the cost model: probed once
        self.stats["evaluated"] += table.stats.get("evaluated", 0)
        return table

    def run(self):
        work, cluster, space = self.work, self.cluster, self.space
        # phase 1: evenly split plans (equal devices, layers within one of L/S) for every G; their
        # times order phase 2, so the G likely to hold the best plan comes first and prunes the rest
        even = space.restrict(uniform_devices=True, layer_slack=0)
        quick: dict[int, float] = {}
        for g in space.grad_accum_options(work.global_batch):
            table = self.frontiers(g, even)
            quick[g] = math.inf
            for stages in self.stage_options:
                solution = uniform_solution(table, stages, work, cluster, space)
                if solution is not None:
                    quick[g] = min(quick[g], solution.objective)
                self.consider(solution, table)
        self.stats["incumbent_s"] = time.perf_counter() - self.started
        # phase 2: per G the full frontiers and the exact partition; a G whose work bound cannot beat
        # the best plan is cut short inside build_frontiers (every base dropped)
        lower = math.inf
        for g in sorted(quick, key=lambda g: (quick[g], g)):
            table = self.frontiers(g, space)
            self.stats["grad_accum_tried"] += 1
            self.stats["frontier_points"] += table.stats.get("frontier_points", 0)
            self.say(f"G={g}: {table.stats.get('bases', 0)} base configs, {table.stats.get('frontier_points', 0)} "
                     f"Pareto points ({time.perf_counter() - self.started:.1f}s)")
            if not table.cells:
                self.stats["grad_accum_skipped"] += 1
                lower = min(lower, self.incumbent)  # nothing of this G fits or beats the incumbent
                continue
            for stages in self.stage_options:
                self.consider(uniform_solution(table, stages, work, cluster, space), table)
            outcome = solve_partition(table, work, cluster, space, self.incumbent)
            self.stats["partitions"] += 1
            self.stats["dp_passes"] += outcome.stats.get("passes", 0)
            lower = min(lower, outcome.bound)
            self.consider(outcome.solution, table)
        self.stats["search_s"] = time.perf_counter() - self.started
        self.stats["activation_milp"] = self.activations.summary()
        if self.best is not None:
            self.stats["bound_s"] = min(lower, self.incumbent)
            self.stats["gap"] = max(0.0, 1.0 - self.stats["bound_s"] / self.incumbent)
        return self.best, self.best_table


    def choose_schedule(self) -> tuple[Plan, PlanPrice]:
        """The fastest plan by simulation: every G's best 1F1B layout as 1F1B, then (when the space has
        other schedules) those layouts and the even ones under each schedule (``tuner/schedules.py``)."""
        work, space = self.work, self.space
        grad_dtype = getattr(self.cost_model, "grad_dtype", "float32")
        priced, seen = [], set()
        for g, found in self.per_g.items():
            found.sort(key=lambda item: item[1].objective)
            # a plan found twice (a DP layout that is also an even one) or that cannot beat its G's best is not
            # simulated: neither changes which plan or which G comes first
            best_of_g = math.inf
            for table, solution in found[:ONE_F_ONE_B_PLANS]:  # the closed form's best few, simulated
                plan = choose_fused_loss(self.cost_model, plan_of(self.cost_model, table, solution, work, grad_dtype))
                if plan in seen:
                    continue
                seen.add(plan)
                price = price_plan(self.cost_model, plan, beat_s=best_of_g)
                if price is not None:
                    priced.append((price, plan, g))
                    best_of_g = min(best_of_g, price.time_s)
        priced.sort(key=lambda item: item[0].time_s)
        best_price, best_plan = priced[0][0], priced[0][1]
        self.stats["one_f_one_b_s"] = best_price.time_s  # the best 1F1B plan, simulated
        self.stats["closed_form_s"] = self.incumbent  # the partition DP's optimum by 1F1B's closed form
        if len(space.schedules) > 1:
            started = time.perf_counter()
            stash = stash_ratio_of(self.cost_model)
            for g in list(dict.fromkeys(g for _, _, g in priced))[:SCHEDULE_G_VALUES]:
                table, solution = self.per_g[g][0]
                pool = StagePool(table)
                layouts = [layout_of(table, solution.rows)] + even_layouts(table, work, self.cluster.world,
                                                                            self.stage_options)
                for layout in dict.fromkeys(layouts):
                    for candidate in schedule_candidates(self.cost_model, pool, work, layout, space, best_price.time_s,
                                                         stash, self.stats):
                        if candidate.price.time_s < best_price.time_s:
                            best_price, best_plan = candidate.price, candidate.plan
            self.stats["schedule_search_s"] = time.perf_counter() - started
            self.say(f"schedule {best_plan.schedule}" + (f" (v={best_plan.virtual_stages})" if best_plan.virtual_stages > 1
                                                         else "") + f": {best_price.time_s * 1e3:.1f} ms per iteration")
        return best_plan, best_price


SCHEDULE_G_VALUES = 4  # G values whose layouts are tried under the other schedules (the fastest by 1F1B)
ONE_F_ONE_B_PLANS = 3  # per G, the 1F1B plans of the search (DP and even splits) priced by simulation


def policy_of(cost_model: StageCostModel, index) -> object:
    """The per-tensor activation policy a candidate's ``act_policy`` names (None: -1, layer-level)."""
    index = int(index)
    return cost_model.policies[index] if index >= 0 else None


def plan_of(cost_model: StageCostModel, table: FrontierTable, solution: StageSolution, work: Workload,
            grad_dtype: str) -> Plan:
    """A 1F1B plan from a partition solution (frontier-table rows in pipeline order)."""
    configs = table.configs
    start = 0
    stages = []
    for row in solution.rows:
        layers = int(configs.num_layers[row])
        stages.append(StagePlan(
            layers=(start, start + layers), nodes=int(configs.nodes[row]), gpus_per_node=int(configs.gpus_per_node[row]),
            micro_batch=int(configs.micro_batch[row]), dp=int(configs.dp[row]), tp=int(configs.tp[row]),
            zero=int(configs.zero[row]), ckpt_layers=int(configs.ckpt_layers[row]),
            offload=Offload(float(configs.offload_weights[row]), float(configs.offload_grads[row]),
                            float(configs.offload_opt[row]), float(configs.offload_acts[row])),
            sp=bool(configs.sp[row]),
            activations=policy_of(cost_model, configs.act_policy[row]),
        ))
        start += layers
    return Plan(model=work.model_name, seq_len=work.seq_len, global_batch=work.global_batch, dtype=work.dtype,
                grad_accum=table.grad_accum, stages=tuple(stages), grad_dtype=grad_dtype)


def _result(cost_model: StageCostModel, plan: Plan, price: PlanPrice, stats: dict, frontiers: dict) -> TuneResult:
    predicted = price.time_s
    chunks = price.chunks
    reports = []
    for i in range(len(plan.stages)):
        group = plan.placement[i]
        breakdown = {k: float(np.asarray(v)[i]) for k, v in chunks.breakdown.items()}
        reports.append(StageReport(i, float(chunks.stable_s[i]), float(price.delta_s[group]),
                                   float(price.peak_memory_bytes[group]),
                                   int(math.ceil(float(price.simulation.inflight[group, 0]) - 1e-9)), breakdown))
    simulation = price.simulation
    busiest = int(np.argmax(simulation.busy_s[:, 0]))
    breakdown = {
        "compute_s": float(simulation.busy_s[busiest, 0]),  # the busiest group of devices' actions
        "bubble_s": float(simulation.bubble_s(price.delta_s[:, None])[busiest, 0]),
        "delta_s": float(price.delta_s[busiest]),
    }
    limit = float(cost_model.device_memory_bytes)
    over = [i for i, report in enumerate(reports) if report.peak_memory_bytes > limit * (1 + 1e-9)]
    if over:  # only if the cost model broke a property the intra-stage shortcuts rely on
        stats["warning"] = f"stage(s) {over} exceed device memory when re-evaluated exactly"
    gap = stats.get("gap", 0.0)
    stats["final_status"] = "OPTIMAL" if gap <= 1e-9 else f"within {gap:.2%} of optimal"
    return TuneResult(plan, predicted, reports, breakdown, stats, float(cost_model.device_memory_bytes),
                      frontiers=frontiers)


def _frontier_summary(table: FrontierTable, solution) -> dict:
    """Per chosen stage, the Pareto frontier of its cell (for plots in ``mistc explain``)."""
    configs = table.configs
    stages = []
    for i, row in enumerate(solution.rows):
        pp = int(configs.has_pre[row]) + 2 * int(configs.has_post[row])
        shape = next(s for s, d in enumerate(table.shapes)
                     if d.nodes == configs.nodes[row] and d.gpus == configs.gpus_per_node[row])
        members = table.cell(int(configs.num_layers[row]), pp, shape, solution.inflight[i])
        stages.append({
            "stage": i, "layers": int(configs.num_layers[row]), "devices": int(configs.nodes[row] * configs.gpus_per_node[row]),
            "inflight": int(solution.inflight[i]),
            "points": [{"stable_s": float(table.stable[m]), "delta_s": float(table.delta[m]),
                        "tp": int(configs.tp[m]), "sp": bool(configs.sp[m]), "zero": int(configs.zero[m]),
                        "act_policy": int(configs.act_policy[m]),
                        "ckpt_layers": int(configs.ckpt_layers[m]),
                        "offload": [float(configs.offload_weights[m]), float(configs.offload_grads[m]),
                                    float(configs.offload_opt[m]), float(configs.offload_acts[m])]}
                       for m in members],
            "chosen": {"stable_s": float(table.stable[row]), "delta_s": float(table.delta[row])},
        })
    return {"grad_accum": table.grad_accum, "stages": stages}
