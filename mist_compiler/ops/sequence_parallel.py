"""Sequence parallelism's collectives (Megatron's all-gather / reduce-scatter pair) as modules.

With sequence parallelism the values between tensor-parallel regions (layer norms, residual adds,
dropout) are split along the sequence over the tensor-parallel ranks: rank ``r`` holds positions
``[r * s/t, (r + 1) * s/t)``. The ``sequence_parallel`` lowering pass rewrites a layer's
region edges to call

- ``tp.sp_gather`` (Megatron's *g-bar*) where the tensor-parallel region begins: all-gather the
  sequence forward, reduce-scatter the (partial) gradient backward, in place of ``tp.copy``;
- ``tp.sp_scatter`` where it ends: reduce-scatter the partial sums forward (same bytes as the
  all-reduce it replaces, 1/t of the result kept), all-gather the gradient backward, in place of
  ``tp.reduce``;
- ``tp.sp_split`` where a replicated value enters a sequence-parallel stretch (after the
  embedding, or from a neighbouring stage without sequence parallelism): keep this rank's chunk
  forward, all-gather the gradient backward;
- ``tp.sp_collect`` where it leaves (before the head, or towards such a stage): all-gather forward,
  keep this rank's chunk of the (replicated) gradient backward.

``dim`` is the sequence dimension of the value. Every op keeps its output contiguous, so a
saved shard never holds a whole sequence's storage alive.
"""
from __future__ import annotations

from typing import Callable

import torch

from .groups import Group


def gather_sequence(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """The whole sequence from every rank's chunk of ``x`` along ``dim``."""
    world = group.world
    if world == 1:
        return x
    local = x.contiguous()
    flat = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device)
    group.all_gather(flat, local.view(-1))
    parts = flat.view(world, *local.shape)  # [t, ..., s/t, ...]
    moved = parts.movedim(0, dim)  # [..., t, s/t, ...]
    shape = list(local.shape)
    shape[dim] *= world
    return moved.reshape(shape).contiguous()


def scatter_sequence(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """This rank's chunk along ``dim`` of the sum of ``x`` over the ranks."""
    world = group.world
    if world == 1:
        return x
    size = x.shape[dim]
    if size % world:
        raise ValueError(f"sequence length {size} is not divisible by the tensor-parallel degree {world}")
    shape = list(x.shape)
    shape[dim: dim + 1] = [world, size // world]
    stacked = x.reshape(shape).movedim(dim, 0).contiguous()  # [t, ..., s/t, ...]
    out = torch.empty(stacked.shape[1:], dtype=x.dtype, device=x.device)
    group.reduce_scatter(out.view(-1), stacked.view(-1))
    return out


def split_sequence(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """This rank's chunk of ``x`` along ``dim`` (a copy: the whole value may be freed)."""
    world = group.world
    if world == 1:
        return x
    size = x.shape[dim]
    if size % world:
        raise ValueError(f"sequence length {size} is not divisible by the tensor-parallel degree {world}")
    chunk = size // world
    return x.narrow(dim, group.rank * chunk, chunk).clone(memory_format=torch.contiguous_format)


def _sequence_function(name: str, forward: Callable, backward: Callable) -> type[torch.autograd.Function]:
    """An autograd function running ``forward(x, group, dim)`` and ``backward`` on the gradient."""

    def run_forward(ctx, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return forward(x, group, dim)

    def run_backward(ctx, grad: torch.Tensor):
        return backward(grad, ctx.group, ctx.dim), None, None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(run_forward),
                                                   "backward": staticmethod(run_backward)})


_Gather = _sequence_function("_Gather", gather_sequence, scatter_sequence)
_Scatter = _sequence_function("_Scatter", scatter_sequence, gather_sequence)
_Split = _sequence_function("_Split", split_sequence, gather_sequence)
_Collect = _sequence_function("_Collect", gather_sequence, split_sequence)


class _SequenceOp(torch.nn.Module):
    function: type[torch.autograd.Function]

    def __init__(self, group: Group) -> None:
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return self.function.apply(x, self.group, dim)


class SequenceGather(_SequenceOp):
    """All-gather the sequence forward, reduce-scatter the gradient backward (enters a TP region)."""

    function = _Gather


class SequenceScatter(_SequenceOp):
    """Reduce-scatter partial sums forward, all-gather the gradient backward (leaves a TP region)."""

    function = _Scatter


class SequenceSplit(_SequenceOp):
    """Keep this rank's chunk forward, all-gather the gradient backward (a replicated value enters)."""

    function = _Split


class SequenceCollect(_SequenceOp):
    """All-gather forward, keep this rank's chunk of the replicated gradient backward (leaves)."""

    function = _Collect


SP_CHILDREN = {"sp_gather": SequenceGather, "sp_scatter": SequenceScatter, "sp_split": SequenceSplit,
               "sp_collect": SequenceCollect}
