"""The groups tensor-parallel ops reduce over: the :class:`Group` protocol (this rank, the degree,
an in-place all-reduce), a ``torch.distributed`` group behind it, and threads of one process
acting as ranks (the lowering-time proof of a sharding)."""
from __future__ import annotations

import threading
from typing import Protocol

import torch
import torch.distributed as dist


class Group(Protocol):
    """What the collectives need: this rank, the degree, an in-place all-reduce."""

    rank: int
    world: int

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None: ...


class ProcessGroup:
    """A ``torch.distributed`` group (``None``: the whole world)."""

    def __init__(self, group, rank: int, world: int) -> None:
        self.group, self.rank, self.world = group, rank, world

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        if self.world > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.group)


class ThreadGroup:
    """``world`` threads of one process acting as ranks (for checking a sharding without a group)."""

    class Shared:
        def __init__(self, world: int) -> None:
            self.world = world
            self.barrier = threading.Barrier(world, timeout=120)
            self.slots: list[torch.Tensor | None] = [None] * world

    def __init__(self, shared: "ThreadGroup.Shared", rank: int) -> None:
        self.shared, self.rank, self.world = shared, rank, shared.world

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        shared = self.shared
        shared.slots[self.rank] = tensor.detach().clone()
        shared.barrier.wait()
        total = shared.slots[0].clone()
        for other in shared.slots[1:]:
            total = torch.maximum(total, other) if op == "max" else total + other
        shared.barrier.wait()  # everyone has read the slots before any is reused
        tensor.copy_(total)
