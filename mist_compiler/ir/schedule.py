"""Pipeline schedules as data: what every pipeline stage does in one training step, in order.

Vocabulary. A plan's ``stages`` are the pipeline's *virtual* stages in data-flow order. With ``v``
virtual stages per device group (``Plan.virtual_stages``) there are ``pp = len(stages) / v``
*physical* stages (groups of devices); virtual stage ``j`` runs on physical stage
``placement[j]``: round-robin (``j % pp``, Megatron's interleaving) or a V (``j`` for ``j < pp``,
``2 pp - 1 - j`` after, ZB-V: the first and the last virtual stage share devices). *Chunk* ``c``
of a physical stage is its ``c``-th virtual stage in pipeline order.

An action is ``(kind, chunk, micro-batch)``: ``F`` forward, ``B`` the whole backward, ``I`` the
backward's input-gradient half (what the previous stage waits for), ``W`` its weight-gradient
half (nothing waits for it: zero-bubble schedules run it later, in what would be a bubble), and
one final ``STEP`` (the optimizer). Point-to-point transfers are implied: a forward sends its
outputs to the next virtual stage, a backward (``B`` or ``I``) its input gradients to the
previous one, unless both virtual stages share devices (then the value is handed over in place).

Schedules (:data:`SCHEDULES`):

- ``1f1b``: after ``pp - s - 1`` warm-up forwards stage ``s`` alternates forward and backward;
- ``gpipe``: every forward, then every backward;
- ``interleaved``: Megatron's interleaved 1F1B over ``v >= 2`` round-robin chunks (needs the
  micro-batch count to be a multiple of ``pp``): the bubble shrinks ``v`` times, ``v`` times
  more transfers, more activations in flight on the first stages;
- ``zb-h1``: zero-bubble with 1F1B's activations (Qi et al., 2023): a stage holds at most the
  ``pp - s`` whole micro-batches 1F1B does; the weight halves (and their inputs, kept) wait to
  fill the bubbles;
- ``zbv``: zero-bubble over two V-placed chunks (ZB-V): every stage may hold ``2 pp`` chunk
  micro-batches (the peak of 1F1B's first stage, on every stage).

The zero-bubble orders come from one list scheduler run with unit costs (F = I = W = 1): an idle
stage takes a ready input-gradient half first, then a forward while its memory bound allows,
then a pending weight half. Every order is a pure function of ``(schedule, pp, v, G)``: every
rank derives every stage's list and needs no communication to agree.

Exchanges (:func:`exchange_plan`). Before action ``k`` a stage posts one batch of transfers, its
*exchange* ``k`` (one more after its last compute action); the batch completes when every
message in it has met its match. NCCL matches a pair's messages in posting order and a send
waits for its receive, so where each message goes matters: it is sent in the exchange right
after the action producing it, and received in the first exchange its receiver leaves no
earlier than that action ends in a reference timeline (every stage running its list as early as
its inputs allow, unit costs). Then a pair's messages are posted in the same order on both ends,
and no chain of exchanges waiting for one another can close on itself (see
:func:`exchange_plan`). Both ends order an exchange's messages by (exchange the sender posts it
in, direction, cut, micro-batch): no tag is needed.
"""
from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

FORWARD, BACKWARD = 0, 1  # directions of a transfer
F, B, I, W, STEP = "F", "B", "I", "W", "STEP"
COMPUTE_KINDS = (F, B, I, W)


class ScheduleError(ValueError):
    """A schedule that cannot run with these stage, chunk and micro-batch counts; says why."""


class Action(NamedTuple):
    kind: str  # F | B | I | W | STEP
    chunk: int  # which of the stage's virtual stages (0 for STEP)
    micro: int  # micro-batch (0 for STEP)

    def __str__(self) -> str:
        return "STEP" if self.kind == STEP else f"{self.kind}{self.micro}" + (f".{self.chunk}" if self.chunk else "")


@dataclass(frozen=True)
class ScheduleKind:
    """What a schedule name means: chunk placement, backward split, allowed chunk counts."""

    name: str
    placement: str  # "loop" | "v"
    split_backward: bool
    virtual: tuple[int, ...] | None  # allowed chunks per stage (None: any >= 2)
    summary: str


SCHEDULES: dict[str, ScheduleKind] = {kind.name: kind for kind in (
    ScheduleKind("1f1b", "loop", False, (1,), "one forward, one backward"),
    ScheduleKind("gpipe", "loop", False, (1,), "all forwards, then all backwards"),
    ScheduleKind("interleaved", "loop", False, None, "Megatron's interleaved 1F1B over v round-robin chunks"),
    ScheduleKind("zb-h1", "loop", True, (1,), "zero-bubble, 1F1B's memory: weight-gradient halves fill the bubble"),
    ScheduleKind("zbv", "v", True, (2,), "zero-bubble over two V-placed chunks (ZB-V)"),
)}
DEFAULT_SCHEDULE = "1f1b"


def schedule_kind(name: str) -> ScheduleKind:
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown pipeline schedule {name!r}; known: {sorted(SCHEDULES)}")
    return SCHEDULES[name]


def schedule_problem(name: str, pp: int, v: int, micro_batches: int) -> tuple[str, str] | None:
    """Why schedule ``name`` cannot run ``micro_batches`` micro-batches over ``pp`` stages of ``v``
    chunks, as (the plan field at fault, the reason); None: it can."""
    if name not in SCHEDULES:
        return "schedule", f"unknown pipeline schedule {name!r}; known: {sorted(SCHEDULES)}"
    kind = SCHEDULES[name]
    if kind.virtual is None and v < 2:
        return "virtual_stages", f"schedule {name!r} needs at least 2 virtual stages per stage, got {v}"
    if kind.virtual is not None and v not in kind.virtual:
        allowed = " or ".join(map(str, kind.virtual))
        return "virtual_stages", f"schedule {name!r} runs {allowed} virtual stage(s) per stage, got {v}"
    if pp < 1 or micro_batches < 1:
        return "stages", f"need at least one stage and one micro-batch, got {pp} and {micro_batches}"
    if name == "interleaved" and micro_batches % pp:
        return "grad_accum", (f"interleaved 1F1B needs a micro-batch count that is a multiple of the {pp} stages, "
                              f"got {micro_batches}")
    return None


def placement(name: str, pp: int, v: int) -> tuple[int, ...]:
    """Physical stage of each of the ``pp * v`` virtual stages."""
    if schedule_kind(name).placement == "v":
        return tuple(j if j < pp else 2 * pp - 1 - j for j in range(pp * v))
    return tuple(j % pp for j in range(pp * v))


@dataclass(frozen=True)
class Schedule:
    """One step of a schedule: per physical stage, its actions (compute actions, then ``STEP``)."""

    name: str
    stages: int  # physical stages (pp)
    virtual: int  # chunks per stage (v)
    micro_batches: int  # G
    placement: tuple[int, ...]  # virtual stage -> physical stage
    actions: tuple[tuple[Action, ...], ...]

    @property
    def num_virtual(self) -> int:
        return self.stages * self.virtual

    @property
    def split_backward(self) -> bool:
        return SCHEDULES[self.name].split_backward

    def chunks(self, stage: int) -> list[int]:
        """The virtual stages of physical stage ``stage``, in chunk order."""
        return [j for j, p in enumerate(self.placement) if p == stage]

    def virtual_stage(self, stage: int, chunk: int) -> int:
        return self.chunks(stage)[chunk]

    def compute(self, stage: int) -> tuple[Action, ...]:
        """``stage``'s actions without the final ``STEP``."""
        return self.actions[stage][:-1]


@lru_cache(maxsize=512)
def build_schedule(name: str, pp: int, v: int = 1, micro_batches: int = 1) -> Schedule:
    """The action lists of schedule ``name`` (raises :class:`ScheduleError` when it cannot run)."""
    problem = schedule_problem(name, pp, v, micro_batches)
    if problem is not None:
        raise ScheduleError(problem[1])
    where = placement(name, pp, v)
    generate = {"1f1b": _one_f_one_b, "gpipe": _gpipe, "interleaved": _interleaved,
                "zb-h1": _zero_bubble, "zbv": _zero_bubble}[name]
    per_stage = generate(pp, v, micro_batches, where)
    actions = tuple(tuple(stage) + (Action(STEP, 0, 0),) for stage in per_stage)
    return Schedule(name, pp, v, micro_batches, where, actions)


# ----------------------------------------------------------------------------- generators

def _one_f_one_b(pp: int, v: int, g: int, where: tuple[int, ...]) -> list[list[Action]]:
    result = []
    for stage in range(pp):
        warmup = min(pp - stage - 1, g)
        order = [Action(F, 0, m) for m in range(warmup)]
        for m in range(warmup, g):
            order += [Action(F, 0, m), Action(B, 0, m - warmup)]
        order += [Action(B, 0, m) for m in range(g - warmup, g)]
        result.append(order)
    return result


def _gpipe(pp: int, v: int, g: int, where: tuple[int, ...]) -> list[list[Action]]:
    return [[Action(F, 0, m) for m in range(g)] + [Action(B, 0, m) for m in range(g)] for _ in range(pp)]


def _interleaved(pp: int, v: int, g: int, where: tuple[int, ...]) -> list[list[Action]]:
    """Megatron-LM's interleaved 1F1B: micro-batches in groups of ``pp`` per chunk, forwards in
    chunk order, backwards in reverse chunk order."""
    total = g * v

    def micro(k: int) -> int:
        return (k // (pp * v)) * pp + k % pp

    def forward(k: int) -> Action:
        return Action(F, (k // pp) % v, micro(k))

    def backward(k: int) -> Action:
        return Action(B, v - 1 - (k // pp) % v, micro(k))

    result = []
    for stage in range(pp):
        warmup = total if g == pp else min((pp - stage - 1) * 2 + (v - 1) * pp, total)
        order = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [forward(warmup + k), backward(k)]
        order += [backward(k) for k in range(total - warmup, total)]
        result.append(order)
    return result


def _zero_bubble(pp: int, v: int, g: int, where: tuple[int, ...]) -> list[list[Action]]:
    """The list scheduler of the module docstring, with unit costs and :func:`_memory_bounds`."""
    n = pp * v
    state = [_StageState([j for j in range(n) if where[j] == s], *_memory_bounds(pp, v, s)) for s in range(pp)]
    forward_done: dict[tuple[int, int], int] = {}  # (virtual stage, micro) -> finish time
    input_done: dict[tuple[int, int], int] = {}
    remaining = 3 * g * n
    t = 0
    while remaining:
        for stage in state:
            if stage.busy > t:
                continue
            picked = stage.pick(t, g, n, forward_done, input_done)
            if picked is None:
                continue
            kind, c, m = picked
            j = stage.chunks[c]
            if kind == F:
                forward_done[(j, m)] = t + 1
            elif kind == I:
                input_done[(j, m)] = t + 1
            stage.busy = t + 1
            stage.order.append(Action(kind, c, m))
            remaining -= 1
        t += 1
    return [stage.order for stage in state]


def _memory_bounds(pp: int, v: int, stage: int) -> tuple[int, int]:
    """(chunk micro-batches a stage may hold whole, between their forward and input half; and in
    all, until their weight half). One chunk: 1F1B's ``pp - s`` whole, ``2 pp`` in all (the
    weight halves wait to fill the bubbles: ZB-H1's ``(pp - 1)(F + I - W)`` bubble with unit
    costs); V-placed chunks: ``2 pp`` either way (1F1B's first-stage peak, on every stage)."""
    return (pp - stage, 2 * pp) if v == 1 else (pp * v, pp * v)


class _StageState:
    """One stage of the list scheduler: what it has done and may do next."""

    def __init__(self, chunks: list[int], full_limit: int, limit: int) -> None:
        self.chunks, self.full_limit, self.limit = chunks, full_limit, limit
        self.full = 0  # chunk micro-batches between their forward and their input half
        self.next_forward = [0] * len(chunks)
        self.next_input = [0] * len(chunks)
        self.waiting_w: list[tuple[int, int, int]] = []  # heap of (micro, -virtual stage, chunk)
        self.held = 0  # chunk micro-batches between their forward and their weight half
        self.busy = 0
        self.order: list[Action] = []

    def pick(self, t: int, g: int, n: int, forward_done: dict, input_done: dict) -> tuple[str, int, int] | None:
        """A ready input half (oldest micro-batch, later virtual stage first), else a forward while
        the memory bound allows (later virtual stage first), else the oldest pending weight half."""
        best = None
        for c, j in enumerate(self.chunks):
            m = self.next_input[c]
            if m < g and forward_done.get((j, m), t + 1) <= t and (j == n - 1 or input_done.get((j + 1, m), t + 1) <= t):
                if best is None or (m, -j) < (self.next_input[best], -self.chunks[best]):
                    best = c
        if best is not None:
            m = self.next_input[best]
            self.next_input[best] += 1
            heapq.heappush(self.waiting_w, (m, -self.chunks[best], best))
            self.full -= 1
            return I, best, m
        if self.held < self.limit and self.full < self.full_limit:
            for c in sorted(range(len(self.chunks)), key=lambda c: -self.chunks[c]):
                j, m = self.chunks[c], self.next_forward[c]
                if m < g and (j == 0 or forward_done.get((j - 1, m), t + 1) <= t):
                    self.next_forward[c] += 1
                    self.held += 1
                    self.full += 1
                    return F, c, m
        if self.waiting_w:
            m, _, c = heapq.heappop(self.waiting_w)
            self.held -= 1
            return W, c, m
        return None


# ----------------------------------------------------------------------------- exchanges

@dataclass(frozen=True)
class Message:
    """One value set crossing cut ``boundary`` (between virtual stages ``boundary`` and
    ``boundary + 1``) for micro-batch ``micro``; posted by its sender in exchange ``sent_in``."""

    direction: int
    boundary: int
    micro: int
    sent_in: int

    def order(self) -> tuple[int, int, int, int]:
        return self.sent_in, self.direction, self.boundary, self.micro


@dataclass(frozen=True)
class Posting:
    """A stage's end of a message: it sends (``send``) to, or receives from, stage ``peer``."""

    send: bool
    peer: int
    message: Message


def produces(schedule: Schedule, stage: int, action: Action) -> list[tuple[int, int, int]]:
    """(direction, boundary, receiving stage) of the messages ``action`` sends to another stage."""
    j = schedule.virtual_stage(stage, action.chunk) if action.kind in COMPUTE_KINDS else -1
    out = []
    if action.kind == F and j + 1 < schedule.num_virtual and schedule.placement[j + 1] != stage:
        out.append((FORWARD, j, schedule.placement[j + 1]))
    if action.kind in (B, I) and j > 0 and schedule.placement[j - 1] != stage:
        out.append((BACKWARD, j - 1, schedule.placement[j - 1]))
    return out


UNIT_COSTS = {F: 1, B: 2, I: 1, W: 1}  # the reference timeline's action lengths


def reference_timeline(schedule: Schedule) -> list[list[tuple[int, int]]]:
    """(start, end) of every compute action when each stage runs its list as early as its inputs
    allow, with :data:`UNIT_COSTS` and instant transfers (raises if the lists cannot complete)."""
    ready: dict[tuple[int, int, int], int] = {}  # value (see _needs) -> when it exists
    times: list[list[tuple[int, int]]] = [[] for _ in range(schedule.stages)]
    clock = [0] * schedule.stages
    lists = [schedule.compute(s) for s in range(schedule.stages)]
    progress = True
    while progress:
        progress = False
        for stage, actions in enumerate(lists):
            while len(times[stage]) < len(actions):
                action = actions[len(times[stage])]
                needs = _needs(schedule, stage, action)
                if any(key not in ready for key in needs):
                    break
                start = max([clock[stage]] + [ready[key] for key in needs])
                end = start + UNIT_COSTS[action.kind]
                times[stage].append((start, end))
                clock[stage] = end
                for key in _gives(schedule, stage, action):
                    ready[key] = end
                progress = True
    stuck = {s: len(times[s]) for s in range(schedule.stages) if len(times[s]) < len(lists[s])}
    if stuck:
        raise ScheduleError(f"schedule {schedule.name!r} cannot complete: stages stuck at actions {stuck}")
    return times


OWN_FORWARD, OWN_INPUT_HALF = -1, -2  # a virtual stage's own forward / input half of a micro-batch, done


def _needs(schedule: Schedule, stage: int, action: Action) -> list[tuple[int, int, int]]:
    """What an action waits for: (direction, boundary, micro) values, or (OWN_*, virtual stage, micro)."""
    j = schedule.virtual_stage(stage, action.chunk)
    if action.kind == F:
        return [(FORWARD, j - 1, action.micro)] if j > 0 else []
    if action.kind == W:
        return [(OWN_INPUT_HALF, j, action.micro)]
    needs = [(OWN_FORWARD, j, action.micro)]
    return needs + ([(BACKWARD, j, action.micro)] if j + 1 < schedule.num_virtual else [])


def _gives(schedule: Schedule, stage: int, action: Action) -> list[tuple[int, int, int]]:
    j = schedule.virtual_stage(stage, action.chunk)
    if action.kind == F:
        return [(OWN_FORWARD, j, action.micro)] + ([(FORWARD, j, action.micro)] if j + 1 < schedule.num_virtual else [])
    if action.kind in (B, I):
        return [(OWN_INPUT_HALF, j, action.micro)] + ([(BACKWARD, j - 1, action.micro)] if j > 0 else [])
    return []


@lru_cache(maxsize=256)
def exchange_plan(schedule: Schedule) -> tuple[tuple[tuple[Posting, ...], ...], ...]:
    """Per physical stage, its ``len(compute) + 1`` exchanges, each sorted by (peer, message order).

    A message is sent in the exchange right after the action that produces it, and received in
    the first exchange its receiver leaves no earlier than that action ends in the
    :func:`reference_timeline` (no later than the exchange of the action that needs it). Then a
    pair's messages are posted in the same order on both ends, and the exchanges complete under
    NCCL's rules: every exchange waits only for exchanges whose preceding action started earlier in
    the reference timeline (the start time strictly decreases along any chain of waits)."""
    times = reference_timeline(schedule)
    plan: list[list[list[Posting]]] = [[[] for _ in range(len(schedule.compute(s)) + 1)]
                                       for s in range(schedule.stages)]
    starts = [[start for start, _ in stage_times] for stage_times in times]
    for stage in range(schedule.stages):
        for k, action in enumerate(schedule.compute(stage)):
            produced = times[stage][k][1]
            for direction, boundary, peer in produces(schedule, stage, action):
                message = Message(direction, boundary, action.micro, k + 1)
                plan[stage][k + 1].append(Posting(True, peer, message))
                plan[peer][_first_at_or_after(starts[peer], produced)].append(Posting(False, stage, message))
    return tuple(tuple(tuple(sorted(exchange, key=lambda p: (p.peer, p.message.order(), p.send)))
                       for exchange in stage_plan) for stage_plan in plan)


def _first_at_or_after(starts: list[int], time: int) -> int:
    """Index of the first action starting at or after ``time`` (its exchange is posted before it)."""
    return bisect.bisect_left(starts, time)


def action_table(schedule: Schedule) -> list[str]:
    """The schedule as text, one line per stage (for ``mistc explain`` and error messages)."""
    width = max(len(str(a)) for actions in schedule.actions for a in actions)
    return [f"stage {s}: " + " ".join(f"{str(a):<{width}}" for a in schedule.actions[s]) for s in range(schedule.stages)]
