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
- ``zb-h1``: zero-bubble within the peak memory of 1F1B's first stage (Qi et al., 2023): stage
  ``s`` holds at most the ``pp - s`` whole micro-batches 1F1B does and ``pp`` in all, the weight
  halves (keeping their inputs) waiting to fill what would be bubbles;
- ``zbv``: zero-bubble over two V-placed chunks (ZB-V): every stage may hold ``2 pp`` chunk
  micro-batches (the peak of 1F1B's first stage, on every stage).

The zero-bubble orders come from one list scheduler run with typical costs (:data:`UNIT_COSTS`):
an idle stage takes a ready input-gradient half first, then a forward while its memory bound
allows, then a pending weight half. Every order is a pure function of ``(schedule, pp, v, G)``:
every rank derives every stage's list and needs no communication to agree.

Transfers (:func:`exchange_plan`). Before action ``k`` a stage posts its *exchange* ``k`` (one
more after its last compute action): the sends action ``k-1`` produced and receives placed
there; posting never waits. Action ``k`` then waits for the receives it needs. Transfers travel
on *channels*, one per (sender, receiver) in one direction (``runtime/process_groups.py``: a
communicator each), where NCCL matches messages in posting order, so a receiver posts a sender's
messages in the order the sender sends them: in the exchange of the action that needs a message,
or earlier where the sender sends it before one needed sooner (interleaved and zero-bubble
schedules consume some out of order). Both ends order an exchange's messages by (peer, exchange
the sender posts it in, direction, cut, micro-batch): no tag is needed. :func:`replay` runs the
transfers under NCCL's rules and finds any mismatch or deadlock.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import NamedTuple

FORWARD, BACKWARD = 0, 1  # directions of a transfer
F, B, I, W, STEP = "F", "B", "I", "W", "STEP"
COMPUTE_KINDS = (F, B, I, W)
# action lengths the orders and exchanges are laid out with: a transformer layer's backward takes
# about twice its forward, its weight half about a third of the backward (``cost/stage_model``)
UNIT_COSTS = {F: 3, B: 6, I: 4, W: 2}


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

    @cached_property
    def _chunks(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(j for j, p in enumerate(self.placement) if p == stage) for stage in range(self.stages))

    def chunks(self, stage: int) -> list[int]:
        """The virtual stages of physical stage ``stage``, in chunk order."""
        return list(self._chunks[stage])

    def virtual_stage(self, stage: int, chunk: int) -> int:
        return self._chunks[stage][chunk]

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
    """The list scheduler of the module docstring, with :data:`UNIT_COSTS` and :func:`_memory_bounds`."""
    n = pp * v
    state = [_StageState([j for j in range(n) if where[j] == s], *_memory_bounds(pp, v, s)) for s in range(pp)]
    # [virtual stage][micro] -> finish time (lists, not a dict by pairs: a long schedule looks them up
    # hundreds of thousands of times)
    forward_done = [[_NEVER] * g for _ in range(n)]
    input_done = [[_NEVER] * g for _ in range(n)]
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
            done = t + UNIT_COSTS[kind]
            if kind == F:
                forward_done[j][m] = done
            elif kind == I:
                input_done[j][m] = done
            stage.busy = done
            stage.order.append(Action(kind, c, m))
            remaining -= 1
        # nothing can start before the next action ends (what a stage waits for is another's action)
        later = [stage.busy for stage in state if stage.busy > t]
        if remaining and not later:
            raise ScheduleError(f"the zero-bubble list scheduler is stuck ({pp} stages, {v} chunks, {g} micro-batches)")
        t = min(later) if later else t + 1
    return [stage.order for stage in state]


_NEVER = 1 << 62  # the finish time of an action not yet scheduled


def _memory_bounds(pp: int, v: int, stage: int) -> tuple[int, int]:
    """(chunk micro-batches a stage may hold whole, between their forward and input half; and in
    all, until their weight half). One chunk (ZB-H1): 1F1B's ``pp - s`` whole and ``pp`` in all,
    the peak of 1F1B's first stage (a weight half keeps less than its micro-batch's activations);
    V-placed chunks (ZB-V): ``2 pp`` chunk micro-batches either way, the same peak on every stage."""
    return (pp - stage, pp) if v == 1 else (pp * v, pp * v)


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
        self.forward_order = sorted(range(len(chunks)), key=lambda c: -chunks[c])  # later virtual stage first

    def pick(self, t: int, g: int, n: int, forward_done: list, input_done: list) -> tuple[str, int, int] | None:
        """A ready input half (oldest micro-batch, later virtual stage first), else a forward while
        the memory bound allows (later virtual stage first), else the oldest pending weight half."""
        best = None
        for c, j in enumerate(self.chunks):
            m = self.next_input[c]
            if m < g and forward_done[j][m] <= t and (j == n - 1 or input_done[j + 1][m] <= t):
                if best is None or (m, -j) < (self.next_input[best], -self.chunks[best]):
                    best = c
        if best is not None:
            m = self.next_input[best]
            self.next_input[best] += 1
            heapq.heappush(self.waiting_w, (m, -self.chunks[best], best))
            self.full -= 1
            return I, best, m
        if self.held < self.limit and self.full < self.full_limit:
            for c in self.forward_order:
                j, m = self.chunks[c], self.next_forward[c]
                if m < g and (j == 0 or forward_done[j - 1][m] <= t):
                    self.next_forward[c] += 1
                    self.held += 1
                    self.full += 1
                    return F, c, m
        if self.waiting_w:
            m, _, c = heapq.heappop(self.waiting_w)
            self.held -= 1
            return W, c, m
        return None


# ----------------------------------------------------------------------------- transfers

class Message(NamedTuple):
    """One value set crossing cut ``boundary`` (between virtual stages ``boundary`` and
    ``boundary + 1``) for micro-batch ``micro``; posted by its sender in exchange ``sent_in``.
    (Named tuples, as ``Posting`` and ``ChannelMessage``: a long schedule makes tens of thousands.)"""

    direction: int
    boundary: int
    micro: int
    sent_in: int

    def order(self) -> tuple[int, int, int, int]:
        return self.sent_in, self.direction, self.boundary, self.micro


class Posting(NamedTuple):
    """A stage's end of a message: it sends (``send``) to, or receives from, stage ``peer``; a
    receive says which of the stage's actions needs it (``needed_by``)."""

    send: bool
    peer: int
    message: Message
    needed_by: int = -1


def produces(schedule: Schedule, stage: int, action: Action) -> list[tuple[int, int, int]]:
    """(direction, boundary, receiving stage) of the messages ``action`` sends to another stage."""
    j = schedule.virtual_stage(stage, action.chunk) if action.kind in COMPUTE_KINDS else -1
    out = []
    if action.kind == F and j + 1 < schedule.num_virtual and schedule.placement[j + 1] != stage:
        out.append((FORWARD, j, schedule.placement[j + 1]))
    if action.kind in (B, I) and j > 0 and schedule.placement[j - 1] != stage:
        out.append((BACKWARD, j - 1, schedule.placement[j - 1]))
    return out


Exchanges = tuple[tuple[tuple[Posting, ...], ...], ...]


@lru_cache(maxsize=256)
def exchange_plan(schedule: Schedule) -> Exchanges:
    """Per physical stage, its ``len(compute) + 1`` exchanges (see the module docstring), each
    sorted by (peer, message order, send). A message is sent in the exchange right after the
    action producing it; it is received in the exchange of the action needing it, or earlier where
    the sender sends it before a message needed sooner (each channel delivers in order)."""
    sends: dict[Message, tuple[int, int]] = {}  # message -> (receiving stage, action needing it)
    needed_by: dict[tuple[int, int, int], int] = {}
    for stage in range(schedule.stages):
        for k, action in enumerate(schedule.compute(stage)):
            j = schedule.virtual_stage(stage, action.chunk)
            if action.kind == F and j > 0:
                needed_by[(FORWARD, j - 1, action.micro)] = k
            if action.kind in (B, I) and j + 1 < schedule.num_virtual:
                needed_by[(BACKWARD, j, action.micro)] = k
    plan: list[list[list[Posting]]] = [[[] for _ in range(len(schedule.compute(s)) + 1)]
                                       for s in range(schedule.stages)]
    channels: dict[tuple[int, int], list[Message]] = {}
    for stage in range(schedule.stages):
        for k, action in enumerate(schedule.compute(stage)):
            for direction, boundary, peer in produces(schedule, stage, action):
                message = Message(direction, boundary, action.micro, k + 1)
                sends[message] = (peer, needed_by[(direction, boundary, action.micro)])
                channels.setdefault((stage, peer), []).append(message)
                plan[stage][k + 1].append(Posting(True, peer, message))
    for (sender, receiver), messages in channels.items():
        position = len(schedule.compute(receiver))
        for message in sorted(messages, key=Message.order, reverse=True):
            needed = sends[message][1]
            position = min(position, needed)
            plan[receiver][position].append(Posting(False, sender, message, needed))
    return tuple(tuple(tuple(sorted(exchange, key=_posting_order) if len(exchange) > 1 else exchange)
                       for exchange in stage_plan) for stage_plan in plan)


def _posting_order(posting: Posting) -> tuple:
    message = posting.message
    return posting.peer, message.sent_in, message.direction, message.boundary, message.micro, posting.send


class ChannelMessage(NamedTuple):
    """One transfer as the replay sees it: on channel ``src -> dst``, posted by the sender in its
    exchange ``sent_in`` and by the receiver in ``posted_in``, waited for before its action
    ``needed_by``; ``key`` names what it carries (both ends must agree)."""

    src: int
    dst: int
    key: tuple
    sent_in: int
    posted_in: int
    needed_by: int


def replay(actions: dict[int, int], sends: list[ChannelMessage], receives: list[ChannelMessage]) -> str | None:
    """Run transfers under NCCL's rules, each rank (``actions``: rank -> its action count) in
    order: on every channel ``src -> dst`` the messages match in posting order and complete in
    that order, once both ends have posted them; a rank runs its action ``k`` once the receives it
    waits for are complete. ``sends`` and ``receives`` are in each end's posting order. Returns
    what goes wrong (a mismatch, a deadlock) or None."""
    by_channel: dict[tuple[int, int], list[ChannelMessage]] = {}
    for message in sends:
        by_channel.setdefault((message.src, message.dst), []).append(message)
    posted: dict[tuple[int, int], list[ChannelMessage]] = {}
    for message in receives:
        posted.setdefault((message.src, message.dst), []).append(message)
    for channel in set(by_channel) | set(posted):
        sent, got = by_channel.get(channel, []), posted.get(channel, [])
        if len(sent) != len(got):
            return f"rank {channel[0]} sends {len(sent)} tensors to rank {channel[1]}, which receives {len(got)}"
        for index, (out, into) in enumerate(zip(sent, got)):
            if out.key != into.key:
                return (f"rank {channel[0]} -> {channel[1]}: message {index} sends {out.key} where the receiver "
                        f"expects {into.key}")
    waits: dict[tuple[int, int], list[tuple[tuple[int, int], int]]] = {}  # (rank, action) -> (channel, index)
    for channel, got in posted.items():
        for index, message in enumerate(got):
            waits.setdefault((message.dst, message.needed_by), []).append((channel, index))
    position = {rank: 0 for rank in actions}  # the action each rank runs next
    done = {channel: 0 for channel in posted}  # messages completed per channel
    progress = True
    while progress:
        progress = False
        for channel, got in posted.items():  # complete, in order, what both ends have posted
            sent = by_channel[channel]
            while done[channel] < len(got):
                index = done[channel]
                if position[channel[0]] < sent[index].sent_in or position[channel[1]] < got[index].posted_in:
                    break
                done[channel] += 1
                progress = True
        for rank, count in actions.items():
            while position[rank] < count and all(done[c] > i for c, i in waits.get((rank, position[rank]), [])):
                position[rank] += 1
                progress = True
    stuck = {rank: position[rank] for rank, count in actions.items() if position[rank] < count}
    return f"deadlock under NCCL's in-order matching: ranks stuck at actions {stuck}" if stuck else None


def stage_messages(plan: Exchanges) -> tuple[list[ChannelMessage], list[ChannelMessage]]:
    """Stage-level exchanges as the replay's (sends, receives), each in posting order."""
    sends, receives = [], []
    for stage, exchanges in enumerate(plan):
        for k, exchange in enumerate(exchanges):
            for posting in exchange:
                m = posting.message
                key = (m.direction, m.boundary, m.micro)
                if posting.send:
                    sends.append(ChannelMessage(stage, posting.peer, key, k, -1, -1))
                else:
                    receives.append(ChannelMessage(posting.peer, stage, key, m.sent_in, k, posting.needed_by))
    return sends, receives


def check_schedule(schedule: Schedule) -> str | None:
    """Replay a schedule's stage-level exchanges (:func:`replay`); None when they complete."""
    sends, receives = stage_messages(exchange_plan(schedule))
    return replay({s: len(schedule.compute(s)) for s in range(schedule.stages)}, sends, receives)


def action_table(schedule: Schedule) -> list[str]:
    """The schedule as text, one line per stage (for ``mistc explain`` and error messages)."""
    width = max(len(str(a)) for actions in schedule.actions for a in actions)
    return [f"stage {s}: " + " ".join(f"{str(a):<{width}}" for a in schedule.actions[s]) for s in range(schedule.stages)]
