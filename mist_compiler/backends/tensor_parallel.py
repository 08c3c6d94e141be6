"""Tensor-parallel layers and the autograd functions behind their collectives (Megatron style).

- ``copy_to_tp`` (Megatron's *f*): identity forward, all-reduce of the gradient backward;
- ``reduce_from_tp`` (*g*): all-reduce forward, identity backward;
- :class:`ColumnParallelLinear`: keeps a slice of the output features; the input goes through f;
- :class:`RowParallelLinear`: keeps a slice of the input features; the partial output through g;
- :class:`VocabParallelEmbedding`: keeps a slice of the vocabulary, masks the other ids, then g;
- ``vocab_parallel_cross_entropy``: cross-entropy over logits whose vocabulary is split across
  the group, with the max, the softmax denominator and the target logit reduced over it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class TensorParallelError(ValueError):
    """A layer that cannot be split over the tensor-parallel group; the message names it."""


def _all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    dist.all_reduce(tensor, op=op, group=group)
    return tensor


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce(grad.contiguous().clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        return _all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group)


def _slice(size: int, rank: int, world: int, what: str) -> slice:
    if size % world:
        raise TensorParallelError(f"{what}: size {size} is not divisible by the tensor-parallel degree {world}")
    part = size // world
    return slice(rank * part, (rank + 1) * part)


class ColumnParallelLinear(nn.Module):
    """``y_local = x @ W[rows]^T + b[rows]``: this rank's slice of the output features."""

    def __init__(self, linear: nn.Linear, group, rank: int, world: int, name: str = "linear") -> None:
        super().__init__()
        rows = _slice(linear.out_features, rank, world, f"{name}.out_features")
        self.weight = nn.Parameter(linear.weight.detach()[rows].clone())
        self.bias = nn.Parameter(linear.bias.detach()[rows].clone()) if linear.bias is not None else None
        self.group = group
        self.in_features, self.out_features = linear.in_features, rows.stop - rows.start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = allreduce(x_local @ W[:, cols]^T) + b``: this rank's slice of the input features."""

    def __init__(self, linear: nn.Linear, group, rank: int, world: int, name: str = "linear") -> None:
        super().__init__()
        cols = _slice(linear.in_features, rank, world, f"{name}.in_features")
        self.weight = nn.Parameter(linear.weight.detach()[:, cols].clone())
        self.bias = nn.Parameter(linear.bias.detach().clone()) if linear.bias is not None else None
        self.group = group
        self.in_features, self.out_features = cols.stop - cols.start, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding rows ``[start, end)`` of the vocabulary; other ids contribute zeros, then g."""

    def __init__(self, embedding: nn.Embedding, group, rank: int, world: int, name: str = "embedding") -> None:
        super().__init__()
        if embedding.padding_idx is not None or embedding.max_norm is not None:
            raise TensorParallelError(f"{name}: padding_idx/max_norm embeddings cannot be split over the vocabulary")
        rows = _slice(embedding.num_embeddings, rank, world, f"{name}.num_embeddings")
        self.weight = nn.Parameter(embedding.weight.detach()[rows].clone())
        self.start, self.end = rows.start, rows.stop
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group, start: int, ignore_index: int) -> torch.Tensor:
        logits = logits.float()
        local_max = logits.max(dim=-1).values
        _all_reduce(local_max, group, dist.ReduceOp.MAX)
        shifted = logits - local_max.unsqueeze(-1)
        vocab_local = logits.shape[-1]
        ignored = target == ignore_index
        local_target = target - start
        outside = (local_target < 0) | (local_target >= vocab_local) | ignored
        index = local_target.masked_fill(outside, 0).unsqueeze(-1)
        target_logit = shifted.gather(-1, index).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        stacked = torch.stack([target_logit, sum_exp])
        _all_reduce(stacked, group)
        target_logit, sum_exp = stacked[0], stacked[1]
        losses = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        count = (~ignored).sum().clamp(min=1)
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, index, outside, ignored, count)
        return losses.sum() / count

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, index, outside, ignored, count = ctx.saved_tensors
        grad_logits = softmax.clone()
        hit = (~outside).to(grad_logits.dtype).unsqueeze(-1)
        grad_logits.scatter_add_(-1, index, -hit)
        grad_logits.masked_fill_(ignored.unsqueeze(-1), 0.0)
        grad_logits.mul_(grad / count)
        return grad_logits, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, group, rank: int, world: int,
                                 ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """Mean cross-entropy of ``[N, V/t]`` local logits against ``[N]`` global class ids."""
    if reduction != "mean":
        raise TensorParallelError(f"vocab-parallel cross-entropy supports reduction='mean' only, got {reduction!r}")
    start = rank * logits.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits, target, group, start, ignore_index)


def shard_dims(module: nn.Module, prefix: str = "") -> dict[str, int | None]:
    """``{parameter name: dimension split over the TP group, or None if replicated}``."""
    dims: dict[str, int | None] = {}
    for module_name, sub in module.named_modules():
        base = ".".join(p for p in (prefix, module_name) if p)
        for name, _param in sub.named_parameters(recurse=False):
            dim: int | None = None
            if isinstance(sub, (ColumnParallelLinear, VocabParallelEmbedding)):
                dim = 0
            elif isinstance(sub, RowParallelLinear) and name == "weight":
                dim = 1
            dims[f"{base}.{name}" if base else name] = dim
    return dims


class VocabParallelCrossEntropy(nn.Module):
    """``F.cross_entropy`` replacement for vocabulary-split logits (holds the group, no parameters)."""

    def __init__(self, group, rank: int, world: int, ignore_index: int = -100, reduction: str = "mean") -> None:
        super().__init__()
        self.group, self.rank, self.world = group, rank, world
        self.ignore_index, self.reduction = ignore_index, reduction

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, target, group=self.group, rank=self.rank, world=self.world,
                                            ignore_index=self.ignore_index, reduction=self.reduction)
