"""Schedule search: the pipeline schedule and its virtual stages, searched with the rest of the plan.

The partition DP (``inter_stage``) finds, per G, the fastest stage layout by 1F1B's closed form.
This module turns layouts into plans of every schedule the space allows (``SearchSpace.schedules``
and ``virtual_stages``) and prices each by simulating its action lists (``cost/schedule.py``),
which is also the price of a 1F1B plan the tuner reports.

A layout is a list of stages (layers, devices, role), from the DP's best plan of a G or from an
even split of the layers over every stage count. Under a schedule, stage ``s``'s layers are cut
into ``v`` chunks (as evenly as possible; checkpointed layers spread the same way), the chunks
placed as the schedule places virtual stages (round-robin, or a V that puts the head on the first
stage), and each stage takes, among the frontier points of every cell with its layers and
devices (re-priced for its role under the schedule and for the activations the schedule keeps
there: its in-flight count over the schedule's order, with the weight halves' inputs for
zero-bubble schedules), the one that fits and costs least (``G * stable + delta``). A plan whose
simulated peak memory does not fit is dropped; a plan whose busiest stage alone
(``G * stable``) cannot beat the best plan found is never simulated, and one whose busiest stage
cannot beat it with the fastest configuration that fits one micro-batch is not even scheduled.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..cost.schedule import PlanPrice, choose_fused_loss, held_activations, price_plan
from ..cost.stage_api import StageCandidates, StageCostModel
from ..ir.plan import Offload, Plan, StagePlan
from ..ir.schedule import ScheduleError, build_schedule, placement, schedule_problem
from .intra_stage import FrontierTable
from .space import SearchSpace, Workload
from .stage_configs import PP_BOTH, PP_NONE, PP_POST, PP_PRE, estimate_totals

MAX_SIMULATED_ACTIONS = 60_000  # per plan: larger schedules (huge G) are left to 1F1B's closed form
# chunk micro-batches from which a schedule costs more to build than its stages' one-micro-batch bound
BOUND_BEFORE_SCHEDULING = 512


@dataclass(frozen=True)
class Layout:
    """A pipeline's stages before a schedule is chosen: per stage its layers and device shape."""

    layers: tuple[int, ...]
    shapes: tuple[int, ...]  # indices into the frontier table's shapes


@dataclass
class Candidate:
    """A plan of some schedule, priced by simulation."""

    plan: Plan
    price: PlanPrice


def schedule_options(space: SearchSpace, stages: int, layers: tuple[int, ...], grad_accum: int,
                     tied_embeddings: bool = False) -> list[tuple[str, int]]:
    """(schedule, virtual stages) pairs the space allows for this layout (a model tying its head to
    its embedding: none that puts the first and last virtual stage on one group of devices, which
    the lowering refuses)."""
    options = []
    for name in space.schedules:
        for v in ((1,) if name in ("1f1b", "gpipe", "zb-h1") else (2,) if name == "zbv" else space.virtual_stages):
            where = placement(name, stages, v)
            if name != "1f1b" and stages < 2:  # one stage has no bubble for a schedule to fill
                continue
            if tied_embeddings and len(where) > 1 and where[0] == where[-1]:
                continue
            if schedule_problem(name, stages, v, grad_accum) is None and min(layers) >= v:
                options.append((name, v))
    return options


def _role(stage: int, stages: int, name: str, v: int) -> int:
    where = placement(name, stages, v)
    pre, post = where[0] == stage, where[-1] == stage
    return PP_BOTH if pre and post else PP_PRE if pre else PP_POST if post else PP_NONE


def _split(count: int, parts: int) -> list[int]:
    base, extra = divmod(count, parts)
    return [base + (i < extra) for i in range(parts)]


def _inflight(name: str, v: int, layout: Layout, grad_accum: int, stash_ratio: float) -> np.ndarray:
    """Per stage, the micro-batches of its activations the schedule keeps at its peak (chunks'
    activations in proportion to their layers, a weight half keeping ``stash_ratio`` of them)."""
    schedule = build_schedule(name, len(layout.layers), v, grad_accum)
    acts = np.zeros((schedule.num_virtual, 1))
    for stage, total in enumerate(layout.layers):
        for chunk, j in enumerate(schedule.chunks(stage)):
            acts[j, 0] = _split(total, v)[chunk] / total
    stash = acts * (stash_ratio if schedule.split_backward else 0.0)
    return held_activations(schedule, acts, stash)[1][:, 0]


class StagePool:
    """A frontier table's points grouped by (layers, device shape), whatever their cell's role and
    in-flight count: the configurations a stage of a schedule's plan is chosen from."""

    def __init__(self, table: FrontierTable) -> None:
        self.table = table
        configs = table.configs
        shape_of = {(d.nodes, d.gpus): s for s, d in enumerate(table.shapes)}
        rows = np.unique(np.concatenate(list(table.cells.values()))) if table.cells else np.zeros(0, dtype=int)
        self.rows: dict[tuple[int, int], np.ndarray] = {}
        for row in rows:
            key = (int(configs.num_layers[row]), shape_of[(int(configs.nodes[row]), int(configs.gpus_per_node[row]))])
            self.rows.setdefault(key, []).append(int(row))
        self.rows = {key: np.array(value) for key, value in self.rows.items()}
        self.fastest = {key: float(table.stable[rows].min()) for key, rows in self.rows.items()}
        self._picked: dict[tuple[int, int, int, int], tuple[tuple[StageCandidates, float] | None, float]] = {}

    def bound(self, layout: Layout) -> float:
        """No plan of this layout runs faster than ``G`` times its busiest stage's fastest point."""
        return self.table.grad_accum * max(self.fastest.get(key, math.inf) for key in zip(layout.layers, layout.shapes))

    def pick(self, cost_model: StageCostModel, layers: int, shape: int, role: int,
             inflight: int) -> tuple[StageCandidates, float] | None:
        """The configuration of a stage with this role and in-flight count that fits and costs least,
        and its stable time."""
        return self._choice(cost_model, layers, shape, role, inflight)[0]

    def fastest_fitting(self, cost_model: StageCostModel, layers: int, shape: int, role: int) -> float:
        """The least stable time of a configuration of a stage with this role that fits holding one
        micro-batch: a stage holding more (whatever the schedule) fits no more configurations, so no
        pick of it is faster (inf: none fits)."""
        return self._choice(cost_model, layers, shape, role, 1)[1]

    def _choice(self, cost_model: StageCostModel, layers: int, shape: int, role: int,
                inflight: int) -> tuple[tuple[StageCandidates, float] | None, float]:
        key = (layers, shape, role, inflight)
        if key not in self._picked:
            self._picked[key] = self._pick(cost_model, layers, shape, role, inflight)
        return self._picked[key]

    def _pick(self, cost_model: StageCostModel, layers: int, shape: int, role: int,
              inflight: int) -> tuple[tuple[StageCandidates, float] | None, float]:
        rows = self.rows.get((layers, shape))
        if rows is None:
            return None, math.inf
        options = self.table.configs.select(rows)
        options.has_pre = np.full(len(rows), bool(role & PP_PRE))
        options.has_post = np.full(len(rows), bool(role & PP_POST))
        options.inflight = np.full(len(rows), inflight)
        estimates = estimate_totals(cost_model, options)  # times and peaks, no breakdown (a fifth of the search's time)
        fits = estimates.peak_memory_bytes <= cost_model.device_memory_bytes * (1 + 1e-9)
        if not fits.any():
            return None, math.inf
        score = np.where(fits, self.table.grad_accum * estimates.stable_s + estimates.delta_s, np.inf)
        best = int(np.argmin(score))
        fastest = float(np.min(np.where(fits, estimates.stable_s, np.inf)))
        return (options.select(np.array([best])), float(estimates.stable_s[best])), fastest


def build_plan(work: Workload, layout: Layout, picks: list[StageCandidates], name: str, v: int, grad_accum: int,
               grad_dtype: str, policies: list = ()) -> Plan:
    """The plan of ``layout`` under schedule ``name`` with ``v`` chunks per stage, each stage the
    configuration picked for it."""
    stages = len(layout.layers)
    where = placement(name, stages, v)
    entries = []
    start = 0
    for j, stage in enumerate(where):
        chunk = sum(1 for i in range(j) if where[i] == stage)
        c = picks[stage]
        layers = _split(layout.layers[stage], v)[chunk]
        ckpt = min(layers, _split(int(c.ckpt_layers[0]), v)[chunk])
        entries.append(StagePlan(
            layers=(start, start + layers), nodes=int(c.nodes[0]), gpus_per_node=int(c.gpus_per_node[0]),
            micro_batch=int(c.micro_batch[0]), dp=int(c.dp[0]), tp=int(c.tp[0]), zero=int(c.zero[0]), ckpt_layers=ckpt,
            offload=Offload(float(c.offload_weights[0]), float(c.offload_grads[0]), float(c.offload_opt[0]),
                            float(c.offload_acts[0])),
            sp=bool(np.asarray(c.sp).reshape(-1)[0]),
            activations=policies[int(np.asarray(c.act_policy).reshape(-1)[0])]
            if int(np.asarray(c.act_policy).reshape(-1)[0]) >= 0 else None))
        start += layers
    return Plan(model=work.model_name, seq_len=work.seq_len, global_batch=work.global_batch, dtype=work.dtype,
                grad_accum=grad_accum, stages=tuple(entries), grad_dtype=grad_dtype, schedule=name, virtual_stages=v)


def schedule_candidates(cost_model: StageCostModel, pool: StagePool, work: Workload, layout: Layout,
                        space: SearchSpace, incumbent: float, stash_ratio: float, stats: dict) -> list[Candidate]:
    """Every schedule's plan of one layout that fits and may beat ``incumbent``, priced."""
    g, stages = pool.table.grad_accum, len(layout.layers)
    found = []
    if pool.bound(layout) >= incumbent:
        return found
    for name, v in schedule_options(space, stages, layout.layers, g, work.tied_embeddings):
        if stages * v * g * 3 > MAX_SIMULATED_ACTIONS:
            continue
        # before a long schedule is built: each stage's fastest configuration that fits one micro-batch
        if stages * v * g >= BOUND_BEFORE_SCHEDULING and g * max(
                pool.fastest_fitting(cost_model, layout.layers[stage], layout.shapes[stage], _role(stage, stages, name, v))
                for stage in range(stages)) >= incumbent:
            continue
        try:
            inflight = _inflight(name, v, layout, g, stash_ratio)
        except ScheduleError:
            continue
        picks = []
        for stage in range(stages):
            pick = pool.pick(cost_model, layout.layers[stage], layout.shapes[stage], _role(stage, stages, name, v),
                             max(1, math.ceil(inflight[stage] - 1e-9)))
            if pick is None:
                break
            picks.append(pick)
        if len(picks) < stages or g * max(stable for _, stable in picks) >= incumbent:
            continue
        plan = choose_fused_loss(cost_model, build_plan(work, layout, [config for config, _ in picks], name, v, g,
                                                        getattr(cost_model, "grad_dtype", "float32"),
                                                        getattr(cost_model, "policies", [])))
        price = price_plan(cost_model, plan, beat_s=incumbent)
        if price is None:
            continue
        stats["schedule_plans_priced"] = stats.get("schedule_plans_priced", 0) + 1
        if np.all(price.peak_memory_bytes <= cost_model.device_memory_bytes * (1 + 1e-9)):
            found.append(Candidate(plan, price))
    return found


def layout_of(table: FrontierTable, rows: list[int]) -> Layout:
    """The layout of a 1F1B solution's stages (frontier-table rows)."""
    configs = table.configs
    shapes = []
    for row in rows:
        shapes.append(next(s for s, d in enumerate(table.shapes)
                           if d.nodes == configs.nodes[row] and d.gpus == configs.gpus_per_node[row]))
    return Layout(tuple(int(configs.num_layers[row]) for row in rows), tuple(shapes))


def even_layouts(table: FrontierTable, work: Workload, world: int, stage_counts: list[int]) -> list[Layout]:
    """Equal devices per stage and layers split as evenly as possible, for every stage count."""
    layouts = []
    for stages in stage_counts:
        if world % stages or work.num_layers < stages:
            continue
        for shape in (i for i, s in enumerate(table.shapes) if s.count == world // stages):
            layouts.append(Layout(tuple(_split(work.num_layers, stages)[::-1]), (shape,) * stages))
    return layouts


def stash_ratio_of(cost_model: StageCostModel) -> float:
    """Bytes a layer's weight half keeps per byte of the activations its forward keeps (the cost
    model's, at a one-layer probe)."""
    probe = StageCandidates(num_layers=1, has_pre=False, has_post=False, nodes=1, gpus_per_node=1, micro_batch=1,
                            dp=1, tp=1, zero=0, ckpt_layers=0, offload_weights=0.0, offload_grads=0.0, offload_opt=0.0,
                            offload_acts=0.0, inflight=1)
    parts = cost_model.evaluate(probe).breakdown
    acts = float(parts.get("acts_per_microbatch", np.zeros(1))[0])
    return float(parts.get("weight_stash", np.zeros(1))[0]) / acts if acts > 0 else 1.0
