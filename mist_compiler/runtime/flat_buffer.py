"""Flat parameter buckets: one contiguous buffer per unit, its layout, shards and freeable storage.

A unit's parameters (shared ones counted once, at their first owner) are laid out back to back in
one flat buffer padded to a multiple of the data-parallel degree, so rank ``r`` owns the shard
``[r * shard, (r + 1) * shard)``. Parameters (and their gradients) are *views* into such buffers,
created once; freeing and re-materialising a buffer resizes its storage (``untyped_storage().resize_``)
so the views stay valid and no per-parameter Python work happens on the hot path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in its unit's flat buffer."""

    name: str
    offset: int
    numel: int
    shape: torch.Size


@dataclass(frozen=True)
class FlatLayout:
    """Placement of a unit's parameters in a flat buffer padded to ``world`` equal shards."""

    slots: tuple[ParamSlot, ...]
    numel: int
    world: int

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world

    @property
    def shard_numel(self) -> int:
        return -(-self.numel // self.world) if self.numel else 0

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    @classmethod
    def build(cls, named_params: list[tuple[str, nn.Parameter]], world: int) -> "FlatLayout":
        if world < 1:
            raise ValueError(f"FlatLayout: world must be >= 1, got {world}")
        slots, offset = [], 0
        for name, param in named_params:
            slots.append(ParamSlot(name, offset, param.numel(), param.shape))
            offset += param.numel()
        return cls(tuple(slots), offset, world)


class FreeableBuffer:
    """A flat tensor whose storage can be dropped and re-allocated while views into it stay valid."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, allocated: bool = True) -> None:
        self.tensor = torch.zeros(numel, dtype=dtype, device=device)
        self._nbytes = self.tensor.untyped_storage().nbytes()
        if not allocated:
            self.free()

    @property
    def allocated(self) -> bool:
        return self.tensor.untyped_storage().nbytes() == self._nbytes

    def allocate(self, zero: bool = False) -> torch.Tensor:
        if not self.allocated:
            self.tensor.untyped_storage().resize_(self._nbytes)
            if zero:
                self.tensor.zero_()
        elif zero:
            self.tensor.zero_()
        return self.tensor

    def free(self) -> None:
        # callers wait for every copy/collective that uses the buffer before freeing it
        if self.allocated and self._nbytes:
            self.tensor.untyped_storage().resize_(0)

    def views(self, layout: FlatLayout) -> list[torch.Tensor]:
        """Views of the parameters' ranges (made while allocated; they survive free/allocate)."""
        was_allocated = self.allocated
        self.allocate()
        views = [self.tensor[s.offset:s.offset + s.numel].view(s.shape) for s in layout.slots]
        if not was_allocated:
            self.free()
        return views


def bind_params(params: list[nn.Parameter], buffer: FreeableBuffer, layout: FlatLayout) -> None:
    """Make every parameter's data a view into ``buffer`` (the caller fills the buffer)."""
    for param, view in zip(params, buffer.views(layout)):
        param.data = view


def bind_grads(params: list[nn.Parameter], buffer: FreeableBuffer, layout: FlatLayout) -> list[torch.Tensor]:
    """Make every parameter's ``.grad`` a view into ``buffer``; autograd then accumulates in place."""
    views = buffer.views(layout)
    for param, view in zip(params, views):
        param.grad = view
    return views
