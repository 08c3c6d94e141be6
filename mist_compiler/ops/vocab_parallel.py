"""The fused LM-head loss over a vocabulary shard of the head (tensor parallelism).

``vocab_parallel_linear_cross_entropy(hidden, weight_shard, labels, group, ...)``: this rank holds
rows ``[rank * V_local, (rank + 1) * V_local)`` of the head's weight (Megatron's contiguous vocab
split; ``rank`` is this process's rank in ``group``); ``hidden [N, H]`` and ``labels [N]`` are the
same on every rank of the group. Chunked like :mod:`.linear_cross_entropy` (the same chunk rule on
the local vocabulary, the same per-chunk kernels), so no ``N x V_local`` logits exist either.

Forward: each rank computes, per row, the log-sum-exp of its shard and the label's logit where
the label is in its range; two all-reduces over ``group`` for the whole micro-batch (not per
chunk): the MAX of the local log-sum-exps, then the SUM of ``exp(lse_local - max)`` and of the
target logits; ``lse = max + log(sum)``. Backward: per chunk, the local logits again,
``(softmax - onehot_local) * scale`` in place, the local weight gradient, and this shard's part of
the hidden gradient; one SUM all-reduce of ``grad_hidden`` at the end. The function therefore
also does the job of Megatron's *f* (copy-to-tensor-parallel region) for its input: do not wrap
``hidden`` in one.

``group`` is a :class:`~mist_compiler.ops.tensor_parallel.Group` (``rank``, ``world``,
``all_reduce``: the lowered graph's ``tp`` child, or the lowering proof's thread group), a
``torch.distributed`` process group, or None (one device).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .groups import Group, ProcessGroup
from .linear_cross_entropy import REDUCTIONS, backward_slices, forward_slices


def _as_group(group) -> Group:
    """A :class:`Group` for ``group`` (see the module docstring)."""
    if hasattr(group, "all_reduce") and hasattr(group, "world"):
        return group
    if group is None or not dist.is_available() or not dist.is_initialized():
        return ProcessGroup(None, 0, 1)
    return ProcessGroup(group, dist.get_rank(group), dist.get_world_size(group))


class VocabParallelLinearCrossEntropy(torch.autograd.Function):
    """Autograd function behind :func:`vocab_parallel_linear_cross_entropy`."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, group, ignore_index: int,
                reduction: str) -> torch.Tensor:
        group = _as_group(group)
        rank, world = group.rank, group.world
        vocab_start = rank * weight.shape[0]
        rows = hidden.shape[0]
        local_lse = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        target = torch.empty_like(local_lse)
        forward_slices(hidden, weight, labels, local_lse, target, vocab_start, ignore_index)
        if world > 1:
            global_max = local_lse.clone()
            group.all_reduce(global_max, "max")
            stacked = torch.stack([(local_lse - global_max).exp(), target])
            group.all_reduce(stacked)
            lse = global_max + stacked[0].log()
            target = stacked[1]
        else:
            lse = local_lse
        valid = labels != ignore_index
        total = torch.where(valid, lse - target, torch.zeros((), device=lse.device)).sum()
        count = valid.sum()
        ctx.save_for_backward(hidden, weight, labels, lse, count)
        ctx.group, ctx.vocab_start, ctx.world = group, vocab_start, world
        ctx.ignore_index, ctx.reduction = ignore_index, reduction
        return total / count if reduction == "mean" else total

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        hidden, weight, labels, lse, count = ctx.saved_tensors
        scale = grad_loss.float().reshape(1)
        if ctx.reduction == "mean":
            scale = scale / count
        grad_hidden, grad_weight = backward_slices(scale, hidden, weight, labels, lse, ctx.vocab_start, ctx.ignore_index)
        if ctx.world > 1:
            ctx.group.all_reduce(grad_hidden)
        return grad_hidden, grad_weight, None, None, None, None


def vocab_parallel_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, group=None,
                                        ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of ``hidden @ W.T`` where this rank holds ``weight``, its contiguous vocabulary
    shard; ``group=None`` (or one rank) is the single-device loss. fp32 scalar."""
    if hidden.dim() != 2 or weight.dim() != 2 or labels.dim() != 1 or hidden.shape[1] != weight.shape[1] \
            or hidden.shape[0] != labels.shape[0]:
        raise ValueError(f"vocab_parallel_linear_cross_entropy: expected hidden [N, H], weight [V/t, H], labels [N]; "
                         f"got {tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(labels.shape)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"vocab_parallel_linear_cross_entropy: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return VocabParallelLinearCrossEntropy.apply(hidden, weight, labels, group, ignore_index, reduction)
