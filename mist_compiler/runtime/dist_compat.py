"""Flat-tensor collectives across torch 2.11-2.13 and backends, with timeouts that name what hung.

- ``all_gather_flat`` / ``reduce_scatter_flat``: ``dist.all_gather_single`` /
  ``dist.reduce_scatter_single`` when present (torch 2.13 deprecates the ``*_tensor`` names), else
  ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (torch 2.11/2.12).
- Reduce-scatter on a backend that lacks it (older gloo builds raise "does not support
  reduce_scatter"): all-reduce of the whole input, then this rank's slice is copied to the output.
  Same result, twice the traffic; it is detected once per process and remembered.
- Every collective returns a ``Pending`` whose ``wait()`` applies the runtime's timeout and raises
  ``CollectiveError`` naming the unit and the collective.
Reductions are SUM; the runtime pre-scales gradients by 1/dp while packing them (gloo has no AVG).
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist


class CollectiveError(RuntimeError):
    """A collective failed or did not finish within the timeout; the message names unit and op."""


ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_reduce_scatter_native: dict[str, bool] = {}


@dataclass
class Pending:
    """An in-flight collective (or a finished local one when ``work`` is None)."""

    what: str
    work: object | None = None
    on_cuda: bool = False
    then: list[Callable[[], None]] = field(default_factory=list)
    done: bool = False
    keep_alive: object = None  # buffers the collective reads, held until it is waited on

    def wait(self, timeout_s: float) -> None:
        if self.done:
            return
        if self.work is not None:
            try:
                # NCCL: a plain wait() only makes the current stream wait (no CPU stall); the process
                # group's own timeout and watchdog bound it. Gloo/CPU: block with our timeout.
                finished = self.work.wait() if self.on_cuda else self.work.wait(datetime.timedelta(seconds=timeout_s))
            except Exception as error:
                raise CollectiveError(f"{self.what} failed or timed out after {timeout_s:.0f} s: {error}") from error
            if finished is False:
                raise CollectiveError(f"{self.what} did not finish within {timeout_s:.0f} s")
        self.done = True
        self.keep_alive = None
        for action in self.then:
            action()
        self.then.clear()

    def is_completed(self) -> bool:
        return self.done or self.work is None or bool(self.work.is_completed())


def group_size(group: dist.ProcessGroup | None) -> int:
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    if group is None or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def all_gather_flat(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None,
                    what: str) -> Pending:
    """``output[r*n:(r+1)*n] = shard of rank r`` for every rank r, asynchronously."""
    if group_size(group) == 1:
        output.copy_(shard)
        return Pending(what)
    return Pending(what, ALL_GATHER(output, shard, group=group, async_op=True), output.is_cuda)


def all_reduce_flat(tensor: torch.Tensor, group: dist.ProcessGroup | None, what: str) -> Pending:
    if group_size(group) == 1:
        return Pending(what)
    return Pending(what, dist.all_reduce(tensor, group=group, async_op=True), tensor.is_cuda)


def _backend_key(group: dist.ProcessGroup | None) -> str:
    return str(dist.get_backend(group))


def reduce_scatter_flat(output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup | None,
                        what: str) -> Pending:
    """``output = sum over ranks of full[r*n:(r+1)*n]`` for this rank r, asynchronously.

    ``full`` may be overwritten (the all-reduce fallback reduces in place).
    """
    world = group_size(group)
    if world == 1:
        output.copy_(full)
        return Pending(what)
    key = _backend_key(group)
    if _reduce_scatter_native.get(key, True):
        try:
            return Pending(what, REDUCE_SCATTER(output, full, group=group, async_op=True), full.is_cuda)
        except (RuntimeError, NotImplementedError) as error:
            if "support" not in str(error).lower():
                raise CollectiveError(f"{what} failed: {error}") from error
            _reduce_scatter_native[key] = False
    rank = group_rank(group)
    shard = output.numel()
    pending = Pending(what + " (all_reduce fallback)", dist.all_reduce(full, group=group, async_op=True), full.is_cuda)
    pending.then.append(lambda: output.copy_(full[rank * shard:(rank + 1) * shard]))
    return pending
