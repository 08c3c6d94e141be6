"""The pipeline's point-to-point transfers, whose matching never depends on tags.

What each stage does and when is data (:mod:`mist_compiler.ir.schedule`): per physical stage an
action list over its chunks (virtual stages) and, derived from it, the stage-level *exchanges*:
before action ``k`` a stage posts one ``batch_isend_irecv`` with the sends and receives the
schedule puts there (one more after its last compute action). This module turns each stage-level
message into this rank's transfers and runs them.

Rows. Global micro-batch ``m`` holds ``global_batch / G`` samples; on stage ``s`` data-parallel
rank ``d`` owns rows ``[d * mb_s, (d + 1) * mb_s)`` of it. Stages may differ in dp, micro_batch
and tp, so each rank sends every next-stage rank the rows their shares have in common. The ranks
of a tensor-parallel group hold the same boundary activations: a receiver with tp index ``t``
takes its rows from the sender with tp index ``t % tp_sender`` (forward and backward alike).
Values without a batch dimension are sent whole by the receiver's first sender. Two virtual
stages on one rank hand their values over in place (no transfer).

Matching. NCCL ignores tags: a pair's messages match in the order they are posted, and PyTorch
runs every batched transfer of a rank on one NCCL stream, one batch after the other (TORCH-NOTES
section 9). Both ends of a pair order an exchange's transfers by (peer, the message's order:
the exchange its sender posts it in, direction, cut, micro-batch; value, rows), and the schedule
puts a pair's messages in the same order on both ends (``ir/schedule.py``), so no tag is passed.
:func:`check_exchanges` replays every rank's exchanges under NCCL's rules (each rank in order; an
exchange finishes when each of its messages meets its match in the peer's current exchange) and
reports any mismatch or deadlock. Tests run it for every schedule, for random pipelines, and for
stages differing in dp, tp and micro-batch, and train on gloo with every tag forced equal.

Waiting. On a CUDA device ``wait()`` only makes the compute stream wait for the transfer (no host
stall; the process group's timeout and NCCL's watchdog bound it); on CPU (gloo) the host waits with
the engine's timeout. The sends of one exchange are waited for before the next exchange is posted,
so at most one exchange's send buffers are alive; that is weaker than what NCCL itself imposes
(the whole exchange finishes before the action runs), so it cannot deadlock where NCCL would not.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch
import torch.distributed as dist

from ..ir.schedule import BACKWARD, FORWARD, Posting, Schedule, exchange_plan as stage_exchanges
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
                                   index, piece, rows, message.sent_in))
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


def check_exchanges(plans: dict[int, list[list[Transfer]]]) -> None:
    """Fail (``ExchangeError``) unless every pair posts its messages in the same order on both ends
    and the exchanges complete under NCCL's rules (see the module docstring)."""
    streams: dict[tuple[int, int, bool], list[tuple[int, int, Transfer]]] = {}
    for rank, exchanges in plans.items():
        for index, exchange in enumerate(exchanges):
            for position, transfer in enumerate(exchange):
                src, dst = (rank, transfer.peer) if transfer.send else (transfer.peer, rank)
                streams.setdefault((src, dst, transfer.send), []).append((index, position, transfer))
    match: dict[tuple[int, int, int], tuple[int, int, int]] = {}
    for (src, dst, is_send), sent in streams.items():
        if not is_send:
            continue
        received = streams.get((src, dst, False), [])
        if len(sent) != len(received):
            raise ExchangeError(f"rank {src} sends {len(sent)} tensors to rank {dst}, which receives {len(received)}")
        for (i, p, out), (j, q, into) in zip(sent, received):
            if out.key() != into.key():
                raise ExchangeError(f"rank {src} -> {dst}: exchange {i} sends {out.key()} where exchange {j} of the "
                                    f"receiver expects {into.key()} (direction, cut, micro, value, rows)")
            match[(src, i, p)], match[(dst, j, q)] = (dst, j, q), (src, i, p)
    for (src, dst, is_send), received in streams.items():
        if not is_send and (src, dst, True) not in streams:
            raise ExchangeError(f"rank {dst} receives {len(received)} tensors from rank {src}, which sends none")
    _replay(plans, match)


def _replay(plans: dict[int, list[list[Transfer]]], match: dict) -> None:
    current = {rank: 0 for rank in plans}
    done: set[tuple[int, int, int]] = set()
    progress = True
    while progress:
        progress = False
        for rank, exchanges in plans.items():
            while current[rank] < len(exchanges):
                index = current[rank]
                for position in range(len(exchanges[index])):
                    peer, j, q = match[(rank, index, position)]
                    if (rank, index, position) not in done and current[peer] == j:
                        done.update({(rank, index, position), (peer, j, q)})
                if not all((rank, index, p) in done for p in range(len(exchanges[index]))):
                    break
                current[rank] += 1
                progress = True
    stuck = {rank: current[rank] for rank, exchanges in plans.items() if current[rank] < len(exchanges)}
    if stuck:
        raise ExchangeError(f"deadlock under NCCL's in-order matching: ranks stuck at exchanges {stuck}")


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
                 micro_batch: int, device: torch.device, timeout_s: float) -> None:
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
        for work, _buffers, peer in self.sending:
            if work is not None:
                self._wait(work, peer, "sending to the next/previous stage")
        self.sending.clear()

    # ---- one exchange -----------------------------------------------------------------------
    def exchange(self, position: int) -> None:
        """Post exchange ``position`` and wait for its receives."""
        transfers = self.exchanges[position]
        self.wait_sends()
        if not transfers:
            return
        ops, sends, recvs = [], [], []
        for transfer in transfers:
            if transfer.send:
                tensor = self._outgoing(transfer)
                ops.append(dist.P2POp(dist.isend, tensor, transfer.peer))
                sends.append((len(ops) - 1, tensor, transfer.peer))
            else:
                ops.append(dist.P2POp(dist.irecv, self._incoming(transfer), transfer.peer))
                recvs.append((len(ops) - 1, transfer))
        for key in {(t.direction, t.boundary, t.micro) for t in transfers if t.send}:
            del self.outbox[key]
        works = dist.batch_isend_irecv(ops)
        if len(works) != len(ops):  # coalesced (NCCL): one work stands for the whole exchange
            peers = sorted({t.peer for t in transfers})
            for work in works:
                self._wait(work, peers[0], f"exchange {position} of the pipeline schedule (peers {peers})")
            self.sending.append((None, [tensor for _, tensor, _ in sends], -1))  # buffers kept to the next exchange
            return
        for index, transfer in recvs:
            what = "receiving activations" if transfer.direction == FORWARD else "receiving gradients"
            self._wait(works[index], transfer.peer, f"{what} of micro-batch {transfer.micro}")
        self.sending.extend((works[index], tensor, peer) for index, tensor, peer in sends)

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
