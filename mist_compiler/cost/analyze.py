"""``analyze``: predicted iteration time and per-stage memory of a plan (``mistc analyze``).

A plan is priced by simulating its schedule's action lists (:func:`.schedule.price_plan`): every
stage (each virtual stage when stages share devices) is evaluated with the vectorised stage
cost model, the schedule's actions and transfers are replayed, and each group of devices holds
the activations the simulated order keeps in flight (1F1B: stage i of S keeps ``min(S - i, G)``
micro-batches). Each stage reports its compute, exposed communication, exposed copies, its bubble
(idle time of its devices in the iteration) and the peak memory of its devices; a stage whose
peak exceeds the device memory is reported with the amount missing.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from ..ir.plan import Plan, PlanError, load_plan
from ..ir.program import MistProgram
from .hardware import HardwareProfile, load_profile
from .schedule import price_plan
from .stage_api import LOSS_FUSED, LOSS_PLAIN, StageCandidates
from .stage_model import StageCostModel, build_stage_cost_model

MB = 1e6


@dataclass
class StageEstimate:
    index: int
    layers: tuple[int, int]
    stable_s: float  # one micro-batch forward + backward in steady state
    delta_s: float  # once-per-iteration extra work
    compute_s: float  # per iteration (grad_accum micro-batches, recompute included)
    exposed_comm_s: float
    exposed_copy_s: float
    bubble_s: float  # idle time of this stage in one iteration
    peak_memory_mb: float
    memory_limit_mb: float
    missing_mb: float  # > 0: the stage does not fit by this much
    memory_mb: dict[str, float] = field(default_factory=dict)  # params, grads, opt, buffers, acts

    @property
    def fits(self) -> bool:
        return self.missing_mb <= 0


@dataclass
class PlanEstimate:
    model: str
    hardware: str
    attention: str
    grad_accum: int
    iteration_time_s: float
    tokens_per_s: float
    stages: list[StageEstimate]
    compiled: bool = False  # the units were priced as compiled code (else eager ops)
    schedule: str = "1f1b"
    virtual_stages: int = 1

    @property
    def fits(self) -> bool:
        return all(stage.fits for stage in self.stages)

    @property
    def missing_mb(self) -> list[float]:
        return [max(0.0, stage.missing_mb) for stage in self.stages]

    def to_dict(self) -> dict:
        data = asdict(self)
        data["fits"] = self.fits
        data["missing_mb"] = self.missing_mb
        return data


def plan_candidates(plan: Plan) -> StageCandidates:
    """The plan's stages as stage-model candidates, in order."""
    count = len(plan.stages)

    def column(get) -> np.ndarray:
        return np.array([get(stage) for stage in plan.stages])

    return StageCandidates(
        num_layers=column(lambda st: st.num_layers),
        has_pre=np.arange(count) == 0,
        has_post=np.arange(count) == count - 1,
        nodes=column(lambda st: st.nodes),
        gpus_per_node=column(lambda st: st.gpus_per_node),
        micro_batch=column(lambda st: st.micro_batch),
        dp=column(lambda st: st.dp),
        tp=column(lambda st: st.tp),
        zero=column(lambda st: st.zero),
        ckpt_layers=column(lambda st: st.ckpt_layers),
        offload_weights=column(lambda st: st.offload.weights),
        offload_grads=column(lambda st: st.offload.grads),
        offload_opt=column(lambda st: st.offload.opt),
        offload_acts=column(lambda st: st.offload.acts),
        inflight=np.minimum(count - np.arange(count), plan.grad_accum),
        grad_accum=plan.grad_accum,
        low_precision_grads=plan.low_precision_grads,
        fused_loss=LOSS_FUSED if plan.fused_loss else LOSS_PLAIN,  # the plan's head + loss, as it will run
        sp=column(lambda st: st.sp),
    )


def check_plan_hardware(plan: Plan, profile: HardwareProfile) -> None:
    """Refuse a plan whose stages do not fit the hardware's nodes."""
    for index, stage in enumerate(plan.stages):
        if stage.gpus_per_node > profile.gpus_per_node:
            raise PlanError(f"plan field stages[{index}].gpus_per_node: {stage.gpus_per_node} exceeds the "
                            f"{profile.gpus_per_node} devices per node of hardware {profile.name!r}")


def _check_plan(plan: Plan, cost_model: StageCostModel, profile: HardwareProfile) -> None:
    plan.check_against_model(cost_model.num_layers)
    check_plan_hardware(plan, profile)
    for index, stage in enumerate(plan.stages):
        if stage.tp > 1 and not cost_model.tp_supported:
            raise PlanError(f"plan field stages[{index}].tp: tensor parallelism ({stage.tp}) is not available for "
                            f"this model: {cost_model.tp_message}; use tp = 1")
        if stage.sp and not getattr(cost_model, "sp_supported", False):
            raise PlanError(f"plan field stages[{index}].sp: sequence parallelism is not available for this model")
        granularity = cost_model.tp_granularity
        if stage.tp > 1 and granularity and granularity % stage.tp:
            raise PlanError(f"plan field stages[{index}].tp: {stage.tp} does not divide the model's attention heads "
                            f"and sharded weight dimensions (their gcd is {granularity})")


def analyze(program: MistProgram | None, plan, hardware, *, attention: str = "flash",
            cost_model: StageCostModel | None = None) -> PlanEstimate:
    """Predict a plan's iteration time and per-stage memory.

    ``program``: the captured model (``driver.capture``; None when ``cost_model`` is given); ``plan``: a :class:`Plan` or a path to a
    plan file; ``hardware``: a profile name, path or :class:`HardwareProfile`. ``cost_model`` reuses
    an already built stage model (it must price the units as the plan runs them: compiled or eager,
    ``plan.compiled``).
    """
    plan = plan if isinstance(plan, Plan) else load_plan(plan)
    profile = hardware if isinstance(hardware, HardwareProfile) else load_profile(hardware)
    if cost_model is None:
        if program is None:
            raise PlanError("analyze needs the captured program (driver.capture) or a cost model")
        cost_model = build_stage_cost_model(program, profile, seq_len=plan.seq_len, dtype=plan.dtype,
                                            attention=attention, compiled=plan.compiled)
    if cost_model.compiled != plan.compiled:
        raise PlanError(f"plan field compiled: {plan.compiled}, but the cost model given prices "
                        f"{'compiled' if cost_model.compiled else 'eager'} units")
    if cost_model.grad_dtype not in ("float32", plan.grad_dtype):
        raise PlanError(f"plan field grad_dtype: {plan.grad_dtype!r}, but the cost model given prices "
                        f"{cost_model.grad_dtype!r} gradients")
    _check_plan(plan, cost_model, profile)
    price = price_plan(cost_model, plan)
    grad_accum = plan.grad_accum
    iteration = price.time_s
    chunks, groups = price.chunks, price.groups
    # idle: neither computing nor moving activations (the simulation's busy time leaves the transfers out)
    p2p = np.asarray(chunks.breakdown.get("p2p", np.zeros(len(plan.stages))), dtype=float)
    sending = np.array([sum(p2p[j] for j in plan.chunks(g)) for g in range(plan.pp)]) * grad_accum
    bubble = np.maximum(price.simulation.bubble_s(price.delta_s[:, None])[:, 0] - sending, 0.0)
    stages = []
    for index, stage in enumerate(plan.stages):
        group = plan.placement[index]
        parts = {name: float(values[group]) for name, values in groups.breakdown.items()}
        peak = float(price.peak_memory_bytes[group])
        limit = cost_model.device_memory_bytes
        acts = parts["acts"] + (peak - float(groups.peak_memory_bytes[group]))  # at the simulated in-flight count
        stages.append(StageEstimate(
            index=index, layers=stage.layers, stable_s=float(chunks.stable_s[index]), delta_s=float(price.delta_s[group]),
            compute_s=grad_accum * float(chunks.breakdown["compute"][index]),
            exposed_comm_s=grad_accum * float(chunks.breakdown["exposed_comm"][index]) + parts["grad_sync"],
            exposed_copy_s=grad_accum * float(chunks.breakdown["exposed_copy"][index]),
            bubble_s=float(bubble[group]),
            peak_memory_mb=peak / MB, memory_limit_mb=limit / MB, missing_mb=(peak - limit) / MB,
            memory_mb={name: (acts if name == "acts" else parts[name]) / MB
                       for name in ("params", "grads", "opt", "buffers", "acts")},
        ))
    tokens = plan.global_batch * plan.seq_len
    return PlanEstimate(plan.model, profile.name, attention, grad_accum, iteration,
                        tokens / iteration if iteration > 0 else float("inf"), stages, compiled=cost_model.compiled,
                        schedule=plan.schedule, virtual_stages=plan.virtual_stages)
