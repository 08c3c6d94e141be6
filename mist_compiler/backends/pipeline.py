"""The pipeline: the 1F1B schedule and point-to-point transfers between stages.

Global micro-batch ``m`` holds ``global_batch / G`` samples; on stage ``s`` data-parallel rank
``d`` owns rows ``[d * mb_s, (d + 1) * mb_s)`` of it. Stages may differ in dp, micro_batch and
tp, so each rank sends every next-stage rank the rows their shares have in common. The ranks of
a tensor-parallel group hold the same boundary activations: a receiver with tp index ``t``
takes its rows from the sender with tp index ``t % tp_sender`` (forward and backward alike).
Values without a batch dimension are sent whole by the receiver's first sender.
Sends are asynchronous and waited for at the end of the step; receives block with a timeout.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mist_compiler.passes.partition import BoundaryValue

from .topology import Topology

FORWARD, BACKWARD = 0, 1



def _piece_of(value: BoundaryValue, tensor: torch.Tensor, piece: "Piece") -> torch.Tensor | None:
    """The part of ``tensor`` that travels with ``piece``: its sample rows, the whole of an
    unbatched value for the one peer that carries it, or nothing."""
    if value.batched:
        return tensor[piece.start:piece.end]
    return tensor if piece.whole else None

class PipelineTimeout(RuntimeError):
    """A pipeline transfer did not complete within the timeout."""


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, end)`` of this rank's share exchanged with ``peer``."""

    peer: int
    start: int
    end: int
    whole: bool  # also carries the values without a batch dimension


@dataclass
class Links:
    recv_forward: list[Piece] = field(default_factory=list)
    send_forward: list[Piece] = field(default_factory=list)
    recv_backward: list[Piece] = field(default_factory=list)
    send_backward: list[Piece] = field(default_factory=list)


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


def build_links(topology: Topology, rank: int) -> Links:
    stage = topology.coord(rank).stage
    links = Links()
    if stage > 0:
        links.recv_forward = _receive_pieces(topology, rank, stage - 1)
        links.send_backward = _send_pieces(topology, rank, stage - 1)
    if stage < topology.plan.pp - 1:
        links.send_forward = _send_pieces(topology, rank, stage + 1)
        links.recv_backward = _receive_pieces(topology, rank, stage + 1)
    return links


def one_f_one_b(num_stages: int, stage: int, num_micro: int) -> list[tuple[int, int]]:
    """The 1F1B order of (FORWARD | BACKWARD, micro-batch) for one stage."""
    warmup = min(num_stages - stage - 1, num_micro)
    order = [(FORWARD, m) for m in range(warmup)]
    forward, backward = warmup, 0
    while forward < num_micro:
        order += [(FORWARD, forward), (BACKWARD, backward)]
        forward, backward = forward + 1, backward + 1
    order += [(BACKWARD, m) for m in range(backward, num_micro)]
    return order


class P2P:
    """Point-to-point transfers of one rank's boundary values (and their gradients)."""

    def __init__(self, links: Links, inputs: list[BoundaryValue], outputs: list[BoundaryValue],
                 micro_batch: int, device: torch.device, timeout_s: float) -> None:
        self.links = links
        self.inputs, self.outputs = inputs, outputs
        self.micro_batch = micro_batch
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.pending: list[tuple[dist.Work, torch.Tensor, int]] = []
        # receives posted ahead of use, so the transfer overlaps this rank's compute
        self.posted: dict[tuple[int, int], tuple[list[torch.Tensor | None], list[tuple[dist.Work, int]]]] = {}

    @staticmethod
    def _tag(micro: int, direction: int, index: int, count: int) -> int:
        return (micro * 2 + direction) * max(count, 1) + index

    def _wait(self, work: dist.Work, peer: int, what: str) -> None:
        try:
            ok = work.wait(self.timeout)
        except RuntimeError as error:
            raise PipelineTimeout(f"{what} with rank {peer} failed: {error}") from error
        if ok is False:
            raise PipelineTimeout(f"{what} with rank {peer} timed out after {self.timeout.total_seconds():.0f} s")

    def _post(self, values: list[BoundaryValue], pieces: list[Piece], micro: int, direction: int,
              batched_only: bool) -> None:
        """Post the receives of one micro-batch's values (or gradients) without waiting."""
        if (micro, direction) in self.posted or not pieces:
            return
        tensors: list[torch.Tensor | None] = []
        works = []
        for index, value in enumerate(values):
            if batched_only and not value.needs_grad:
                tensors.append(None)
                continue
            buffer = torch.empty(value.shape(self.micro_batch), dtype=value.dtype, device=self.device)
            tensors.append(buffer)
            for piece in pieces:
                target = _piece_of(value, buffer, piece)
                if target is None:
                    continue
                tag = self._tag(micro, direction, index, len(values))
                works.append((dist.irecv(target, src=piece.peer, tag=tag), piece.peer))
        self.posted[(micro, direction)] = (tensors, works)

    def _receive(self, values: list[BoundaryValue], pieces: list[Piece], micro: int, direction: int,
                 batched_only: bool) -> list[torch.Tensor | None]:
        self._post(values, pieces, micro, direction, batched_only)
        tensors, works = self.posted.pop((micro, direction))
        what = "receiving activations" if direction == FORWARD else "receiving gradients"
        for work, peer in works:
            self._wait(work, peer, f"{what} of micro-batch {micro}")
        return tensors

    def prefetch_forward(self, micro: int) -> None:
        if self.links.recv_forward:
            self._post(self.inputs, self.links.recv_forward, micro, FORWARD, batched_only=False)

    def prefetch_backward(self, micro: int) -> None:
        if self.links.recv_backward:
            self._post(self.outputs, self.links.recv_backward, micro, BACKWARD, batched_only=True)

    def _send(self, values: list[BoundaryValue], tensors: list[torch.Tensor | None], pieces: list[Piece],
              micro: int, direction: int) -> None:
        self._finish_sends(direction)
        for index, (value, tensor) in enumerate(zip(values, tensors)):
            if tensor is None:
                continue
            for piece in pieces:
                part = _piece_of(value, tensor, piece)
                if part is None:
                    continue
                part = part.detach().contiguous()
                tag = self._tag(micro, direction, index, len(values))
                self.pending.append((dist.isend(part, dst=piece.peer, tag=tag), part, piece.peer, direction))

    def recv_forward(self, micro: int) -> list[torch.Tensor]:
        tensors = self._receive(self.inputs, self.links.recv_forward, micro, FORWARD, batched_only=False)
        for value, tensor in zip(self.inputs, tensors):
            if value.needs_grad:
                tensor.requires_grad_(True)
        return tensors

    def send_forward(self, outputs: list[torch.Tensor], micro: int) -> None:
        self._send(self.outputs, outputs, self.links.send_forward, micro, FORWARD)

    def recv_backward(self, micro: int) -> list[torch.Tensor | None]:
        return self._receive(self.outputs, self.links.recv_backward, micro, BACKWARD, batched_only=True)

    def send_backward(self, grads: list[torch.Tensor | None], micro: int) -> None:
        grads = [g if value.needs_grad else None for value, g in zip(self.inputs, grads)]
        self._send(self.inputs, grads, self.links.send_backward, micro, BACKWARD)

    def clear_posted(self) -> None:
        """Forget receives posted for an iteration that was abandoned (after a failure)."""
        self.posted.clear()

    def _finish_sends(self, direction: int) -> None:
        """Wait for the earlier sends in ``direction`` before posting new ones, so at most one micro-batch's
        sends per direction hold their buffers (gloo's point-to-point works never report completion
        before ``wait()``, so polling would keep every send to the end of the iteration). The peer
        posts each receive in schedule order and never needs this rank's later messages first, so the
        wait is short and cannot deadlock."""
        still_running = []
        for work, part, peer, sent_direction in self.pending:
            if sent_direction == direction or work.is_completed():
                self._wait(work, peer, "sending to the next/previous stage")
            else:
                still_running.append((work, part, peer, sent_direction))
        self.pending = still_running

    def wait_sends(self) -> None:
        for work, _part, peer, _direction in self.pending:
            self._wait(work, peer, "sending to the next/previous stage")
        self.pending.clear()
