"""The groups tensor-parallel ops reduce over: the :class:`Group` protocol (this rank, the degree,
an in-place all-reduce, and for sequence parallelism a flat all-gather and reduce-scatter), a
``torch.distributed`` group behind it, and threads of one process acting as ranks (the
lowering-time proof of a sharding)."""
from __future__ import annotations

import threading
from typing import Protocol

import torch
import torch.distributed as dist


class Group(Protocol):
    """What the collectives need: this rank, the degree, an in-place all-reduce; sequence
    parallelism also gathers (``out[r*n:(r+1)*n] = shard of rank r``) and reduce-scatters
    (``out = sum over ranks of full[rank*n:(rank+1)*n]``) flat tensors."""

    rank: int
    world: int

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None: ...

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> None: ...

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> None: ...


_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ProcessGroup:
    """A ``torch.distributed`` group (``None``: the whole world)."""

    def __init__(self, group, rank: int, world: int) -> None:
        self.group, self.rank, self.world = group, rank, world

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        if self.world > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.group)

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        if self.world == 1:
            out.copy_(shard)
            return
        _ALL_GATHER(out, shard, group=self.group)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> None:
        if self.world == 1:
            out.copy_(full)
            return
        try:
            _REDUCE_SCATTER(out, full, group=self.group)
        except (RuntimeError, NotImplementedError) as error:  # a gloo build without reduce-scatter
            if "support" not in str(error).lower():
                raise
            summed = full.clone()
            dist.all_reduce(summed, group=self.group)
            out.copy_(summed[self.rank * out.numel():(self.rank + 1) * out.numel()])


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

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        shared = self.shared
        shared.slots[self.rank] = shard.detach().clone()
        shared.barrier.wait()
        gathered = torch.cat([slot.view(-1) for slot in shared.slots])
        shared.barrier.wait()
        out.copy_(gathered)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> None:
        shared = self.shared
        shared.slots[self.rank] = full.detach().clone()
        shared.barrier.wait()
        n = out.numel()
        total = sum(slot.view(-1)[self.rank * n:(self.rank + 1) * n] for slot in shared.slots)
        shared.barrier.wait()
        out.copy_(total)
