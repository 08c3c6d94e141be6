"""Pipeline time and memory by simulating a schedule's action lists (DESIGN.md 2.2), not a closed form.

The simulation replays what the runtime does (``ir/schedule.py``, ``runtime/pipeline.py``): every
stage runs its action list in order, posting its transfers without waiting; an action starts when
the previous one has ended and the receives it needs have arrived. A transfer runs on its channel
(one per sending and receiving stage) once both ends have posted it and the channel's earlier
transfers are done, and takes its transfer time. A stage's iteration ends with its last action
plus its ``delta`` (gradient synchronisation, optimizer step); the iteration time is the latest
stage's. Each quantity is an array over candidates: one structure (cached per schedule), many
candidate timings at once.

In-flight count: per stage, the bytes of activations held over its action order: a forward adds
its chunk's ``acts`` (F..I), an input half turns them into the weight half's ``stash`` (I..W), a
weight half (or a whole backward) frees them; the peak of that walk, in micro-batches of the
stage's activations, is the stage's in-flight count (1F1B: ``min(S - s, G)``, as the stage model
assumes), fractional when chunks differ (reported, and what the tuner picks stage configurations by).

:func:`price_plan` prices a :class:`~mist_compiler.ir.plan.Plan` with the stage cost model: every
virtual stage is evaluated as its own stage (forward, backward, weight half, transfer and
activation bytes of one micro-batch), every group of devices as the stage holding all its chunks
(``delta``, the optimizer step's memory); then the schedule is simulated, and each group's peak
memory walked over its action list with each chunk priced as itself (``cost/schedule_memory.py``).
"""
from __future__ import annotations

import gc
import math
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import lru_cache

import numpy as np

from ..ir.plan import Plan, StagePlan
from ..ir.schedule import B, F, I, Schedule, W, build_schedule, exchange_plan, stage_messages
from .schedule_memory import chunk_memory, group_peaks, has_memory_parts
from .stage_api import LOSS_CHOOSE, LOSS_FUSED, LOSS_PLAIN, StageCandidates, StageCostModel, StageEstimates


@dataclass
class ChunkCosts:
    """Per virtual stage (rows) and candidate (columns): seconds of one micro-batch, bytes held."""

    forward: np.ndarray  # [V, n] forward
    backward: np.ndarray  # [V, n] whole backward (input half + weight half)
    weight: np.ndarray  # [V, n] the weight half (0 where the backward is not split)
    transfer: np.ndarray  # [V, n] sending the outputs to the next virtual stage (or the gradient back)
    acts: np.ndarray  # [V, n] bytes a forward keeps until its input half
    stash: np.ndarray  # [V, n] bytes the weight half keeps from the input half


@dataclass
class Simulation:
    """A schedule run with some candidates' costs."""

    schedule: Schedule
    time_s: np.ndarray  # [n] iteration
    finish_s: np.ndarray  # [pp, n] when each stage's last action ends
    busy_s: np.ndarray  # [pp, n] compute time of each stage
    inflight: np.ndarray  # [pp, n] peak activations held, in micro-batches of the stage's chunks
    held_bytes: np.ndarray  # [pp, n] that peak in bytes
    spans: list[list[tuple[str, np.ndarray, np.ndarray]]] = field(default_factory=list)  # per stage: (action, start, end)

    def bubble_s(self, delta: np.ndarray) -> np.ndarray:
        """[pp, n] idle time of each stage in the iteration."""
        return np.maximum(self.time_s[None, :] - self.busy_s - delta, 0.0)


@dataclass(frozen=True)
class _Structure:
    """What a simulation needs from a schedule, precomputed once: the actions and transfers in an
    order where everything an event waits for comes first."""

    events: tuple[tuple, ...]  # ("action", stage, k, kind, virtual stage, waits) | ("message", id, ...)
    actions: tuple[tuple[tuple[str, int], ...], ...]  # per stage: (kind, virtual stage) of each compute action


@lru_cache(maxsize=256)
def _action_lists(schedule: Schedule) -> tuple[tuple[tuple[str, int], ...], ...]:
    """Per stage: (kind, virtual stage) of each compute action."""
    return tuple(tuple((a.kind, schedule.virtual_stage(s, a.chunk)) for a in schedule.compute(s))
                 for s in range(schedule.stages))


@contextmanager
def _collector_paused():
    """The cyclic garbage collector off while a long schedule's tables are built: they are tens of
    thousands of small tuples with no cycles, and in a tuning process full of live objects the
    collections their allocations trigger cost three times the building itself."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@lru_cache(maxsize=256)
def _structure(schedule: Schedule) -> _Structure:
    with _collector_paused():
        return _build_structure(schedule)


def _build_structure(schedule: Schedule) -> _Structure:
    sends, receives = stage_messages(exchange_plan(schedule))
    lists = _action_lists(schedule)
    sent = {(m.src, m.dst, m.key): m for m in sends}
    previous: dict[tuple[int, int], int] = {}
    messages = []  # (id, sender, sent_in, receiver, posted_in, boundary, previous id on the channel)
    waits: dict[tuple[int, int], list[int]] = {}
    needed_by = [message.needed_by for message in receives]
    for index, message in enumerate(receives):
        channel = (message.src, message.dst)
        messages.append((index, message.src, sent[(message.src, message.dst, message.key)].sent_in, message.dst,
                         message.posted_in, message.key[1], previous.get(channel, -1)))
        previous[channel] = index
        waits.setdefault((message.dst, message.needed_by), []).append(index)
    # Kahn's order over actions (after the previous action and their receives) and messages (after the
    # sender's producing action, the receiver's action before the posting exchange, the channel's previous
    # one), driven by counts of unmet conditions so that each event is looked at once
    unmet = [0] * len(messages)
    on_action: dict[tuple[int, int], list[int]] = {}  # (stage, actions done) -> messages that condition frees
    on_message: dict[int, list[int]] = {}  # message -> the next message of its channel
    for index, sender, sent_in, receiver, posted_in, _, before in messages:
        for stage, count in ((sender, sent_in), (receiver, posted_in)):
            if count > 0:
                unmet[index] += 1
                on_action.setdefault((stage, count), []).append(index)
        if before >= 0:
            unmet[index] += 1
            on_message.setdefault(before, []).append(index)
    needs_left = {key: len(ids) for key, ids in waits.items()}
    done_actions = [0] * schedule.stages
    events: list[tuple] = []
    ready = deque(index for index, count in enumerate(unmet) if count == 0)

    def free(indices) -> None:
        for index in indices:
            unmet[index] -= 1
            if unmet[index] == 0:
                ready.append(index)

    def advance(stage: int) -> None:
        actions = lists[stage]
        while done_actions[stage] < len(actions) and needs_left.get((stage, done_actions[stage]), 0) == 0:
            k = done_actions[stage]
            events.append(("action", stage, k, actions[k][0], actions[k][1], tuple(waits.get((stage, k), ()))))
            done_actions[stage] = k + 1
            free(on_action.get((stage, k + 1), ()))

    for stage in range(schedule.stages):
        advance(stage)
    emitted = 0
    while ready:
        index = ready.popleft()
        events.append(("message",) + messages[index])
        emitted += 1
        free(on_message.get(index, ()))
        key = (messages[index][3], needed_by[index])
        needs_left[key] -= 1
        if needs_left[key] == 0:
            advance(key[0])
    if emitted < len(messages) or any(done_actions[s] < len(lists[s]) for s in range(schedule.stages)):
        raise RuntimeError(f"schedule {schedule.name!r} does not complete (ir.schedule.check_schedule)")
    return _Structure(tuple(events), lists)


def simulate(schedule: Schedule, costs: ChunkCosts, delta: np.ndarray, spans: bool = False) -> Simulation:
    """Run ``schedule`` with ``costs`` (``delta``: [pp, n] per-iteration work of each stage after its
    last action); ``spans``: also keep every action's start and end (for timelines). Each candidate
    column runs on Python floats (an action list holds thousands of events, and a numpy call per
    event costs more than the event's arithmetic)."""
    structure = _structure(schedule)
    n = costs.forward.shape[1]
    pp = schedule.stages
    finish, busy = np.zeros((pp, n)), np.zeros((pp, n))
    starts = [[[] for _ in range(n)] for _ in range(pp)] if spans else None  # [stage][column][action]
    for column in range(n):
        finish[:, column], busy[:, column] = _run_column(
            structure, costs, column, pp, [stage[column] for stage in starts] if spans else None)
    time = np.max(finish + delta, axis=0)
    held, inflight = held_activations(schedule, costs.acts, costs.stash)
    kept: list[list[tuple[str, np.ndarray, np.ndarray]]] = []
    if spans:
        duration = _durations(costs)
        for stage in range(pp):
            begun = np.array(starts[stage], dtype=float).reshape(n, -1)  # [column, action]
            kept.append([(kind, begun[:, k], begun[:, k] + duration[kind][virtual])
                         for k, (kind, virtual) in enumerate(structure.actions[stage])])
    return Simulation(schedule, time, finish, busy, inflight, held, kept)


def _durations(costs: ChunkCosts) -> dict[str, np.ndarray]:
    """[V, n] seconds of each action kind per virtual stage."""
    return {F: costs.forward, B: costs.backward, I: costs.backward - costs.weight, W: costs.weight}


def _run_column(structure: _Structure, costs: ChunkCosts, column: int, pp: int,
                starts: list[list[float]] | None) -> tuple[list[float], list[float]]:
    """One candidate's run: per stage its last action's end and its compute time; ``starts`` (per
    stage, for timelines) gets each action's start."""
    duration = {kind: values[:, column].tolist() for kind, values in _durations(costs).items()}
    transfer = costs.transfer[:, column].tolist()
    ends: list[list[float]] = [[] for _ in range(pp)]  # per stage, the end of each action so far
    arrived: dict[int, float] = {}
    busy = [0.0] * pp
    for event in structure.events:
        if event[0] == "message":
            _, index, sender, sent_in, receiver, posted_in, boundary, before = event
            start = ends[sender][sent_in - 1]
            if posted_in > 0:
                start = max(start, ends[receiver][posted_in - 1])
            if before >= 0:
                start = max(start, arrived[before])
            arrived[index] = start + transfer[boundary]
            continue
        _, stage, k, kind, virtual, needs = event
        start = ends[stage][k - 1] if k > 0 else 0.0
        for index in needs:
            start = max(start, arrived[index])
        length = duration[kind][virtual]
        ends[stage].append(start + length)
        if starts is not None:
            starts[stage].append(start)
        busy[stage] += length
    return [stage_ends[-1] if stage_ends else 0.0 for stage_ends in ends], busy


def held_activations(schedule: Schedule, acts: np.ndarray, stash: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per stage (rows) and candidate (columns): the peak bytes of activations held over its
    action order (``acts``, ``stash``: [virtual stages, n], see the module docstring), and that
    peak in micro-batches of all its chunks' activations (its in-flight count)."""
    lists = _action_lists(schedule)
    pp, n = schedule.stages, acts.shape[1]
    inflight, held_peak = np.zeros((pp, n)), np.zeros((pp, n))
    for column in range(n):  # Python floats: one numpy call per action would cost more than its arithmetic
        kept, stashed = acts[:, column].tolist(), stash[:, column].tolist()
        for stage in range(pp):
            held = peak = 0.0
            for kind, virtual in lists[stage]:
                if kind == F:
                    held += kept[virtual]
                    peak = max(peak, held)
                elif kind == B:
                    held -= kept[virtual]
                elif kind == I:
                    held = held - kept[virtual] + stashed[virtual]
                    peak = max(peak, held)
                else:
                    held -= stashed[virtual]
            unit = sum(kept[j] for j in schedule.chunks(stage))
            held_peak[stage, column] = peak
            inflight[stage, column] = peak / unit if unit > 0 else 1.0
    return held_peak, inflight


# ----------------------------------------------------------------------------- pricing a plan

def _rows(estimates: StageEstimates, rows: np.ndarray) -> StageEstimates:
    return StageEstimates(estimates.stable_s[rows], estimates.delta_s[rows], estimates.peak_memory_bytes[rows],
                          {name: np.asarray(values)[rows] for name, values in estimates.breakdown.items()})


def _candidates(plan: Plan, stages: list[StagePlan], pre: list[bool], post: list[bool],
                cost_model: StageCostModel | None = None) -> StageCandidates:
    def column(get) -> np.ndarray:
        return np.array([get(stage) for stage in stages])

    def policy(stage: StagePlan) -> int:  # the stage model's index of its per-tensor activation policy
        if stage.activations is None or not hasattr(cost_model, "add_policy"):
            return -1
        return cost_model.add_policy(stage.activations)

    return StageCandidates(
        num_layers=column(lambda st: st.num_layers), has_pre=np.array(pre), has_post=np.array(post),
        nodes=column(lambda st: st.nodes), gpus_per_node=column(lambda st: st.gpus_per_node),
        micro_batch=column(lambda st: st.micro_batch), dp=column(lambda st: st.dp), tp=column(lambda st: st.tp),
        zero=column(lambda st: st.zero), ckpt_layers=column(lambda st: st.ckpt_layers),
        offload_weights=column(lambda st: st.offload.weights), offload_grads=column(lambda st: st.offload.grads),
        offload_opt=column(lambda st: st.offload.opt), offload_acts=column(lambda st: st.offload.acts),
        inflight=1, grad_accum=plan.grad_accum, low_precision_grads=plan.low_precision_grads,
        fused_loss=LOSS_FUSED if plan.fused_loss else LOSS_PLAIN,  # the plan's head + loss, as it will run
        sp=column(lambda st: st.sp), act_policy=column(policy),
    )


def choose_fused_loss(cost_model: StageCostModel, plan: Plan) -> Plan:
    """``plan`` with the last stage's head + loss the stage model picks (``cost.loss_kernel``: the
    plain one where it fits and is faster, else the fused, chunked one), priced at one micro-batch
    in flight as 1F1B's last stage holds."""
    last = len(plan.stages) - 1
    candidates = _candidates(plan, [plan.stages[last]], [last == 0], [True], cost_model)
    candidates.fused_loss = np.full(len(candidates), LOSS_CHOOSE)
    choice = cost_model.evaluate(candidates).breakdown.get("fused_loss")
    fused = True if choice is None else bool(np.asarray(choice).reshape(-1)[0] > 0.5)
    return plan if fused == plan.fused_loss else replace(plan, fused_loss=fused)


def group_stages(plan: Plan) -> tuple[list[StagePlan], list[bool], list[bool]]:
    """Each group of devices as one stage holding all its chunks (layers and checkpointed layers
    summed; the first chunk's offload), and whether it holds the embedding / the head."""
    groups, pre, post = [], [], []
    last = len(plan.stages) - 1
    for stage in range(plan.pp):
        chunks = plan.chunks(stage)
        first = plan.stages[chunks[0]]
        layers = sum(plan.stages[j].num_layers for j in chunks)
        groups.append(StagePlan((0, layers), first.nodes, first.gpus_per_node, first.micro_batch, first.dp, first.tp,
                                first.zero, sum(plan.stages[j].ckpt_layers for j in chunks), first.offload,
                                sp=first.sp, activations=first.activations))
        pre.append(0 in chunks)
        post.append(last in chunks)
    return groups, pre, post


def chunk_costs(estimates: StageEstimates, schedule: Schedule) -> ChunkCosts:
    """The simulation's inputs from the stage model's estimates of each virtual stage (one column)."""
    stable = np.asarray(estimates.stable_s, dtype=float)
    nothing = np.zeros_like(stable)
    parts = {name: np.asarray(values, dtype=float) for name, values in estimates.breakdown.items()}
    p2p = parts.get("p2p", nothing)
    # a cost model without the split (a test double): a third forward, no weight half, no transfer time
    forward = parts["forward"] + parts.get("tp_forward", nothing) if "forward" in parts else (stable - p2p) / 3
    backward = stable - p2p - forward
    weight = parts.get("backward_weight", nothing) if schedule.split_backward else nothing
    if "p2p_message" in parts:  # one message over the cut after each virtual stage (activation or gradient)
        transfer = parts["p2p_message"]
    else:  # the stage's transfers shared by its cuts
        neighbours = np.full(len(forward), 2.0)
        neighbours[0] -= 1.0
        neighbours[-1] -= 1.0
        transfer = p2p / np.maximum(neighbours, 1.0)
    stash = parts.get("weight_stash", nothing) if schedule.split_backward else nothing
    acts = parts.get("acts_per_microbatch", parts.get("acts", nothing))
    column = lambda values: np.asarray(values, dtype=float)[:, None]  # noqa: E731
    return ChunkCosts(column(forward), column(backward), column(np.minimum(weight, backward)), column(transfer),
                      column(acts), column(stash))


@dataclass
class PlanPrice:
    """A plan priced by simulation: iteration time, per group of devices its peak memory."""

    time_s: float
    simulation: Simulation
    chunks: StageEstimates  # per virtual stage (the plan's entries)
    groups: StageEstimates  # per group of devices, at one micro-batch in flight
    peak_memory_bytes: np.ndarray  # [pp] at the simulated in-flight count
    delta_s: np.ndarray  # [pp]


def price_plan(cost_model: StageCostModel, plan: Plan, spans: bool = False,
               beat_s: float = math.inf) -> PlanPrice | None:
    """Simulate ``plan``'s schedule with the stage model's costs (see the module docstring).
    ``beat_s``: None, without simulating, when a group of devices' own actions and step alone take
    that long (a simulated iteration never takes less)."""
    schedule = build_schedule(plan.schedule, plan.pp, plan.virtual_stages, plan.grad_accum)
    last = len(plan.stages) - 1
    groups, pre, post = group_stages(plan)
    entries = list(plan.stages) + groups + groups  # the virtual stages, then every group at 1 and 2 in flight
    candidates = _candidates(plan, entries, [j == 0 for j in range(last + 1)] + pre + pre,
                             [j == last for j in range(last + 1)] + post + post, cost_model)
    count, pp = last + 1, plan.pp
    candidates.inflight = np.array([1] * (count + pp) + [2] * pp)
    every = cost_model.evaluate(candidates)  # one call: the model's per-call work is paid once
    chunks, at_one, at_two = (_rows(every, np.arange(a, b)) for a, b in
                              ((0, count), (count, count + pp), (count + pp, count + 2 * pp)))
    costs = chunk_costs(chunks, schedule)
    if beat_s < math.inf and least_iteration_s(schedule, costs, at_one.delta_s) * (1 - 1e-9) >= beat_s:  # rounding
        return None
    simulation = simulate(schedule, costs, at_one.delta_s[:, None], spans=spans)
    if has_memory_parts(chunks) and "peak_step" in at_one.breakdown:  # each chunk as itself, over the action list
        step = np.asarray(at_one.breakdown["peak_step"], dtype=float)[:, None]
        peak = group_peaks(schedule, chunk_memory(chunks, schedule.split_backward), step)[:, 0]
    else:  # a stage model without those parts: the group at its simulated in-flight count
        slope = at_two.peak_memory_bytes - at_one.peak_memory_bytes
        peak = at_one.peak_memory_bytes + (simulation.inflight[:, 0] - 1.0) * slope
    return PlanPrice(float(simulation.time_s[0]), simulation, chunks, at_one, peak, at_one.delta_s)


def least_iteration_s(schedule: Schedule, costs: ChunkCosts, delta_s: np.ndarray) -> float:
    """A lower bound of ``simulate``'s time (first column): the longest a group of devices computes in
    an iteration (every chunk's forward and backward of every micro-batch, one after another) plus its
    step. Under 1F1B, stage ``s`` also starts no earlier than the first micro-batch's forwards on the
    stages before it, and the first stage ends no earlier than the last micro-batch's backwards from
    ``s`` back to it (then its own step)."""
    forward, backward = costs.forward[:, 0].tolist(), costs.backward[:, 0].tolist()
    delta = np.asarray(delta_s, dtype=float).reshape(schedule.stages, -1)[:, 0].tolist()
    busy = [schedule.micro_batches * sum(forward[j] + backward[j] for j in schedule.chunks(stage))
            for stage in range(schedule.stages)]
    least = max(busy[stage] + delta[stage] for stage in range(schedule.stages))
    if schedule.name == "1f1b" and schedule.virtual == 1:
        least = max(least, max(sum(forward[:stage]) + busy[stage] + sum(backward[:stage])
                               for stage in range(schedule.stages)) + delta[0])
    return least


def simulate_estimates(plan: Plan, stable_s: list[float], breakdowns: list[dict], delta_s: list[float],
                       spans: bool = True) -> Simulation:
    """Simulate ``plan``'s schedule from stored per-stage estimates (one per entry of
    ``plan.stages``: stable time and the stage model's breakdown; ``delta_s`` per group of devices),
    e.g. the tuner's side file."""
    schedule = build_schedule(plan.schedule, plan.pp, plan.virtual_stages, plan.grad_accum)
    names = set.intersection(*(set(b) for b in breakdowns))
    estimates = StageEstimates(np.asarray(stable_s, dtype=float), np.zeros(len(stable_s)), np.zeros(len(stable_s)),
                               {name: np.array([float(b[name]) for b in breakdowns]) for name in names})
    for name in ("tp_forward", "backward_weight", "weight_stash", "p2p", "acts_per_microbatch"):
        estimates.breakdown.setdefault(name, np.zeros(len(stable_s)))
    if "forward" not in names:  # no split stored: a third forward, two thirds backward
        estimates.breakdown["forward"] = estimates.stable_s / 3
    return simulate(schedule, chunk_costs(estimates, schedule), np.asarray(delta_s, dtype=float)[:, None], spans=spans)
