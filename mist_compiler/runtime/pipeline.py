"""The pipeline's point-to-point transfers, whose matching never depends on tags.

What each stage does and when is data (:mod:`mist_compiler.ir.schedule`): per physical stage an
action list over its chunks (virtual stages) and, derived from it, the stage-level *exchanges*:
before action ``k`` a stage posts the sends and receives the schedule puts there (one more
exchange after its last compute action). This module turns each stage-level message into this
rank's transfers and runs them.

Rows. Global micro-batch ``m`` holds ``global_batch / G`` samples; on stage ``s`` data-parallel
rank ``d`` owns rows ``[d * mb_s, (d + 1) * mb_s)`` of it. Stages may differ in dp, micro_batch
and tp, so each rank sends every next-stage rank the rows their shares have in common. The ranks
of a tensor-parallel group hold the same boundary activations: a receiver with tp index ``t``
takes its rows from the sender with tp index ``t % tp_sender`` (forward and backward alike).
Values without a batch dimension are sent whole by the receiver's first sender. Two virtual
stages on one rank hand their values over in place (no transfer).

Matching. NCCL ignores tags: a pair's messages match in the order they are posted on one
communicator, and a communicator runs its transfers one after the other. So every directed pair
of ranks that exchanges activations or gradients gets a communicator of its own (a *channel*,
:func:`channel_pairs`, created with the other groups by ``runtime/process_groups.py``): a send
waiting for its receive holds up only later sends on that channel, never the sender's compute or
its other transfers. Both ends order their transfers by (the message's order: the exchange its
sender posts it in, direction, cut, micro-batch; value, rows), and the schedule posts a
channel's receives in the order its sender sends (``ir/schedule.py``), so no tag is passed.
:func:`check_exchanges` replays every rank's transfers under NCCL's rules
(``ir.schedule.replay``) and reports any mismatch or deadlock. Tests run it for every schedule,
for random pipelines, and for stages differing in dp, tp and micro-batch, and train on gloo with
every tag forced equal.

Waiting. Posting never waits; before an action the rank waits for the receives that action needs
(on a CUDA device ``wait()`` only makes the compute stream wait: no host stall, the process
group's timeout and NCCL's watchdog bound it; on CPU, gloo, the host waits with the engine's
timeout). Sends are kept (their buffers alive) until they complete, at the latest at the end of
the step.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
import torch.distributed as dist

from ..ir.schedule import BACKWARD, FORWARD, ChannelMessage, Posting, Schedule, exchange_plan as stage_exchanges
from ..ir.schedule import replay
from ..ir.topology import Topology


class PipelineTimeout(RuntimeError):
    """A pipeline transfer did not complete within the timeout."""


class ExchangeError(AssertionError):
    """The exchanges of a plan would mix up tensors or deadlock under NCCL's matching rules."""


class Boundary(Protocol):
    """What the transfers need to know of a value crossing a cut (``partition.BoundaryValue``)."""

    batched: bool

    @property
    def needs_grad(self) -> bool: ...


Values = Sequence[Boundary]


# ----------------------------------------------------------------------------- who talks to whom

@dataclass(frozen=True)
class Piece:
    """Rows ``[start, end)`` of this rank's share exchanged with ``peer``."""

    peer: int
    start: int
    end: int
    whole: bool  # also carries the values without a batch dimension


def _overlaps(topology: Topology, stage: int, dp_index: int, other_stage: int) -> list[tuple[int, int, int]]:
    """(other dp index, start, end) of the rows ``stage``'s rank shares with ``other_stage``'s ranks,
    relative to this rank's first row."""
    plan = topology.plan
    mb, other_mb = plan.stages[stage].micro_batch, plan.stages[other_stage].micro_batch
    lo, hi = dp_index * mb, (dp_index + 1) * mb
    result = []
    for other in range(plan.stages[other_stage].dp):
        start, end = max(lo, other * other_mb), min(hi, (other + 1) * other_mb)
        if start < end:
            result.append((other, start - lo, end - lo))
    return result


def _receive_pieces(topology: Topology, rank: int, source_stage: int) -> list[Piece]:
    coord = topology.coord(rank)
    source_tp = coord.tp_index % topology.plan.stages[source_stage].tp
    pieces = []
    for index, (other, start, end) in enumerate(_overlaps(topology, coord.stage, coord.dp_index, source_stage)):
        pieces.append(Piece(topology.rank_of(source_stage, other, source_tp), start, end, whole=index == 0))
    return pieces


def _send_pieces(topology: Topology, rank: int, target_stage: int) -> list[Piece]:
    coord = topology.coord(rank)
    target = topology.plan.stages[target_stage]
    pieces = []
    for other, start, end in _overlaps(topology, coord.stage, coord.dp_index, target_stage):
        for t in range(target.tp):
            peer = topology.rank_of(target_stage, other, t)
            if t % topology.plan.stages[coord.stage].tp != coord.tp_index:
                continue
            first_sender = _receive_pieces(topology, peer, coord.stage)[0].peer == rank
            pieces.append(Piece(peer, start, end, whole=first_sender))
    return pieces


# ----------------------------------------------------------------------------- exchanges

@dataclass(frozen=True)
class Transfer:
    """One tensor sent to or received from ``peer``: value ``value`` crossing cut ``boundary`` for
    micro-batch ``micro`` in ``direction``, the rows of ``piece`` (or the whole value when it has
    no batch dimension). ``rows`` are the same rows in global-batch coordinates and ``sent_in``
    the exchange its sender posts it in: both ends of a pair compute the same."""

    send: bool
    peer: int
    direction: int
    boundary: int
    micro: int
    value: int
    piece: Piece
    rows: tuple[int, int] | None  # None: an unbatched value, sent whole
    sent_in: int
    needed_by: int = -1  # a receive: the action that waits for it

    def key(self) -> tuple:
        return self.direction, self.boundary, self.micro, self.value, self.rows

    def order(self) -> tuple:
        return (self.peer, self.sent_in, self.direction, self.boundary, self.micro, self.value,
                self.rows if self.rows is not None else (-1, -1), self.send)


def boundary_values(schedule: Schedule, stage: int, interfaces: Sequence[tuple[Values, Values]]) -> dict[int, Values]:
    """The values crossing each cut this stage touches (from the chunk on this side of it);
    ``interfaces``: (inputs, outputs) per chunk."""
    values: dict[int, Values] = {}
    for chunk, (inputs, outputs) in enumerate(interfaces):
        j = schedule.virtual_stage(stage, chunk)
        if j > 0:
            values[j - 1] = inputs
        if j + 1 < schedule.num_virtual:
            values[j] = outputs
    return values


def _posting_transfers(topology: Topology, rank: int, posting: Posting, values: Values) -> list[Transfer]:
    coord = topology.coord(rank)
    message = posting.message
    pieces = (_send_pieces(topology, rank, posting.peer) if posting.send
              else _receive_pieces(topology, rank, posting.peer))
    first_row = topology.sample_range(coord.stage, coord.dp_index, message.micro)[0]
    result = []
    for index, value in enumerate(values):
        if message.direction == BACKWARD and not value.needs_grad:
            continue
        for piece in pieces:
            if not value.batched and not piece.whole:
                continue
            rows = (first_row + piece.start, first_row + piece.end) if value.batched else None
            result.append(Transfer(posting.send, piece.peer, message.direction, message.boundary, message.micro,
                                   index, piece, rows, message.sent_in, posting.needed_by))
    return result


def exchange_plan(topology: Topology, rank: int, schedule: Schedule,
                  interfaces: Sequence[tuple[Values, Values]]) -> list[list[Transfer]]:
    """This rank's exchanges: its stage's (``ir.schedule.exchange_plan``) made into transfers."""
    stage = topology.coord(rank).stage
    values = boundary_values(schedule, stage, interfaces)
    return [sorted((t for posting in exchange for t in _posting_transfers(topology, rank, posting,
                                                                          values[posting.message.boundary])),
                   key=Transfer.order)
            for exchange in stage_exchanges(schedule)[stage]]


def channel_pairs(topology: Topology, schedule: Schedule) -> list[tuple[int, int]]:
    """Every (sending rank, receiving rank) that carries pipeline transfers under ``schedule``'s
    placement, in one order on every rank (each gets its own communicator)."""
    pairs: set[tuple[int, int]] = set()
    for boundary in range(schedule.num_virtual - 1):
        low, high = schedule.placement[boundary], schedule.placement[boundary + 1]
        if low == high:
            continue
        for rank in range(topology.world_size):
            stage = topology.coord(rank).stage
            if stage == low:
                pairs.update((rank, piece.peer) for piece in _send_pieces(topology, rank, high))
            if stage == high:
                pairs.update((rank, piece.peer) for piece in _send_pieces(topology, rank, low))
    return sorted(pairs)


def check_exchanges(plans: dict[int, list[list[Transfer]]]) -> None:
    """Fail (``ExchangeError``) unless every channel's messages are posted in the same order on
    both ends and every rank's actions complete under NCCL's rules (``ir.schedule.replay``)."""
    sends, receives = [], []
    for rank, exchanges in plans.items():
        for index, exchange in enumerate(exchanges):
            for transfer in exchange:
                if transfer.send:
                    sends.append(ChannelMessage(rank, transfer.peer, transfer.key(), index, -1, -1))
                else:
                    receives.append(ChannelMessage(transfer.peer, rank, transfer.key(), transfer.sent_in, index,
                                                   transfer.needed_by))
    problem = replay({rank: len(exchanges) - 1 for rank, exchanges in plans.items()}, sends, receives)
    if problem is not None:
        raise ExchangeError(problem)


# ----------------------------------------------------------------------------- the runtime side

def _piece_of(value: Boundary, tensor: torch.Tensor, transfer: Transfer) -> torch.Tensor:
    """The part of ``tensor`` that ``transfer`` carries: its rows, or all of an unbatched value."""
    return tensor[transfer.piece.start:transfer.piece.end] if value.batched else tensor


class P2P:
    """One rank's pipeline transfers, one exchange per schedule position (see the module docstring).

    Per action the engine calls ``exchange(position)`` first (its receives arrive), then
    ``recv_forward`` / ``recv_backward`` for the chunk's received tensors, computes, and hands its
    results to ``send_forward`` / ``send_backward``, which stage them for the next exchange (or,
    when the next virtual stage is on this rank, hand them over at once).
    """

    def __init__(self, topology: Topology, rank: int, schedule: Schedule, interfaces: Sequence[tuple[list, list]],
                 micro_batch: int, device: torch.device, timeout_s: float, channels: dict | None = None) -> None:
        self.rank = rank
        self.channels = channels or {}  # (src rank, dst rank) -> its process group (None: the world's)
        self.schedule = schedule
        self.stage = topology.coord(rank).stage
        self.chunk_stage = schedule.chunks(self.stage)  # chunk -> virtual stage
        self.values = boundary_values(schedule, self.stage, interfaces)
        self.micro_batch = micro_batch
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.exchanges = exchange_plan(topology, rank, schedule, interfaces)
        self.inbox: dict[tuple[int, int, int], list[torch.Tensor | None]] = {}  # (direction, cut, micro)
        self.outbox: dict[tuple[int, int, int], list[torch.Tensor | None]] = {}
        self.sending: list[tuple[dist.Work | None, object, int]] = []  # (work, buffers it reads, peer)
        self.receiving: dict[int, list[tuple[dist.Work, Transfer]]] = {}  # action -> the receives it waits for

    def _local(self, boundary: int) -> bool:
        """Both sides of cut ``boundary`` run on this rank."""
        placement = self.schedule.placement
        return placement[boundary] == placement[boundary + 1] == self.stage

    # ---- waiting ----------------------------------------------------------------------------
    def _wait(self, work: dist.Work, peer: int, what: str) -> None:
        try:
            # CUDA: the compute stream waits for the transfer, the host goes on (the process group's
            # timeout and the NCCL watchdog bound it); CPU: the host waits, bounded by our timeout
            ok = work.wait() if self.device.type == "cuda" else work.wait(self.timeout)
        except RuntimeError as error:
            raise PipelineTimeout(f"{what} with rank {peer} failed: {error}") from error
        if ok is False:
            raise PipelineTimeout(f"{what} with rank {peer} timed out after {self.timeout.total_seconds():.0f} s")

    def wait_sends(self) -> None:
        """Wait for every posted send (the end of a step)."""
        for work, _buffers, peer in self.sending:
            if work is not None:
                self._wait(work, peer, "sending to the next/previous stage")
        self.sending.clear()

    # ---- one exchange -----------------------------------------------------------------------
    def exchange(self, position: int) -> None:
        """Post exchange ``position`` (sends and receives, each on its channel, without waiting), then
        wait for the receives action ``position`` needs (some posted in earlier exchanges)."""
        self.sending = [entry for entry in self.sending if entry[0] is None or not entry[0].is_completed()]
        for transfer in self.exchanges[position]:
            if transfer.send:
                tensor = self._outgoing(transfer)
                group = self.channels.get((self.rank, transfer.peer))
                self.sending.append((dist.isend(tensor, transfer.peer, group=group), tensor, transfer.peer))
            else:
                group = self.channels.get((transfer.peer, self.rank))
                work = dist.irecv(self._incoming(transfer), transfer.peer, group=group)
                self.receiving.setdefault(transfer.needed_by, []).append((work, transfer))
        for key in {(t.direction, t.boundary, t.micro) for t in self.exchanges[position] if t.send}:
            del self.outbox[key]
        for work, transfer in self.receiving.pop(position, []):
            what = "receiving activations" if transfer.direction == FORWARD else "receiving gradients"
            self._wait(work, transfer.peer, f"{what} of micro-batch {transfer.micro}")

    def _outgoing(self, transfer: Transfer) -> torch.Tensor:
        tensor = self.outbox[(transfer.direction, transfer.boundary, transfer.micro)][transfer.value]
        return _piece_of(self.values[transfer.boundary][transfer.value], tensor, transfer).detach().contiguous()

    def _incoming(self, transfer: Transfer) -> torch.Tensor:
        values = self.values[transfer.boundary]
        key = (transfer.direction, transfer.boundary, transfer.micro)
        if key not in self.inbox:
            self.inbox[key] = [None] * len(values)
        buffers = self.inbox[key]
        value = values[transfer.value]
        if buffers[transfer.value] is None:
            buffers[transfer.value] = torch.empty(value.shape(self.micro_batch), dtype=value.dtype, device=self.device)
        return _piece_of(value, buffers[transfer.value], transfer)

    # ---- what the engine calls ----------------------------------------------------------------
    def recv_forward(self, chunk: int, micro: int) -> list[torch.Tensor]:
        boundary = self.chunk_stage[chunk] - 1
        values = self.values[boundary]
        tensors = self.inbox.pop((FORWARD, boundary, micro), [None] * len(values))
        for value, tensor in zip(values, tensors):
            if tensor is not None and value.needs_grad:
                tensor.requires_grad_(True)
        return tensors

    def send_forward(self, chunk: int, outputs: list[torch.Tensor], micro: int) -> None:
        boundary = self.chunk_stage[chunk]
        if self._local(boundary):
            self.inbox[(FORWARD, boundary, micro)] = [t.detach() for t in outputs]
        else:
            self.outbox[(FORWARD, boundary, micro)] = list(outputs)

    def recv_backward(self, chunk: int, micro: int) -> list[torch.Tensor | None]:
        boundary = self.chunk_stage[chunk]
        return self.inbox.pop((BACKWARD, boundary, micro), [None] * len(self.values[boundary]))

    def send_backward(self, chunk: int, grads: list[torch.Tensor | None], micro: int) -> None:
        boundary = self.chunk_stage[chunk] - 1
        kept = [g if value.needs_grad else None for value, g in zip(self.values[boundary], grads)]
        (self.inbox if self._local(boundary) else self.outbox)[(BACKWARD, boundary, micro)] = kept

    def reset(self) -> None:
        """Forget the buffers of an iteration that was abandoned (after a failure)."""
        self.inbox.clear()
        self.outbox.clear()
        self.sending.clear()
        self.receiving.clear()
