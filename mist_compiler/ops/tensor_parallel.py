"""Tensor-parallel collectives as modules a lowered graph calls (Megatron's f and g, vocab ops).

The ``tp_sharding`` lowering pass rewrites a unit's graph to call ``tp.copy`` (Megatron's *f*:
identity forward, all-reduce of the gradient backward), ``tp.reduce`` (*g*: all-reduce forward,
identity backward), ``tp.embedding`` (a vocabulary slice of an embedding: ids outside it give
zeros, then *g*) and ``tp.cross_entropy`` (cross-entropy over logits split along the vocabulary:
the max, the sum of exponentials and the target logit are all-reduced),
``tp.linear_cross_entropy`` (the fused head + loss over the head's vocabulary rows,
:mod:`.vocab_parallel`), ``tp.scatter`` (this rank's part of a replicated value: an ALiBi table,
a shared rotary key) and ``tp.layer_norm`` / ``tp.rms_norm`` (norms over split features). The pass only names
them; the runtime attaches a :class:`TensorParallelOps` holding the real group, and the
lowering-time proof (``passes/tp_check.py``) one holding a :class:`~.groups.ThreadGroup`, which runs the
ranks as threads of one process. The autograd functions are written here, not taken from
DTensor, because the lowered graph is sharded by rewriting it (head counts, fused projections),
not by module-level placement.
"""
from __future__ import annotations

import torch
from torch import nn

from .dropout import counter_attention, counter_dropout
from .groups import Group
from .sequence_parallel import SP_CHILDREN
from .vocab_parallel import vocab_parallel_linear_cross_entropy


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        ctx.group.all_reduce(grad)
        return grad, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        out = x.contiguous().clone()
        group.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _VocabCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group: Group, ignore_index: int,
                reduction: str) -> torch.Tensor:
        logits = logits.float()
        vocab_local = logits.shape[-1]
        start = group.rank * vocab_local
        local_max = logits.max(dim=-1).values
        group.all_reduce(local_max, "max")
        shifted = logits - local_max.unsqueeze(-1)
        ignored = target == ignore_index
        local_target = target - start
        outside = (local_target < 0) | (local_target >= vocab_local) | ignored
        index = local_target.masked_fill(outside, 0).unsqueeze(-1)
        target_logit = shifted.gather(-1, index).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        stacked = torch.stack([target_logit, exp.sum(dim=-1)])
        group.all_reduce(stacked)
        target_logit, sum_exp = stacked[0], stacked[1]
        losses = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        count = (~ignored).sum().clamp(min=1) if reduction == "mean" else torch.ones((), dtype=torch.long)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, index, outside, ignored, count)
        return losses.sum() / count

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, index, outside, ignored, count = ctx.saved_tensors
        grad_logits = softmax.clone()
        grad_logits.scatter_add_(-1, index, -(~outside).to(grad_logits.dtype).unsqueeze(-1))
        grad_logits.masked_fill_(ignored.unsqueeze(-1), 0.0)
        grad_logits.mul_(grad / count)
        return grad_logits, None, None, None, None


class _Scatter(torch.autograd.Function):
    """This rank's part of a replicated tensor (forward); the whole gradient, assembled from every
    rank's part by an all-reduce of zero-padded copies (backward)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, dim: int, block: int, segments: tuple) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.block, ctx.segments, ctx.shape = group, dim, block, segments, x.shape
        pieces = _rank_pieces(x.contiguous(), group.rank, group.world, dim, block, segments)
        local = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim + 1)
        return local.reshape(*x.shape[:dim], -1, *x.shape[dim + 1:])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        dim, shape = ctx.dim, ctx.shape
        whole = grad.new_zeros(shape)
        blocked = grad.reshape(*shape[:dim], shape[dim] // ctx.block, -1, *shape[dim + 1:])
        offset = 0
        for piece in _rank_pieces(whole, ctx.group.rank, ctx.group.world, dim, ctx.block, ctx.segments):
            piece.copy_(blocked.narrow(dim + 1, offset, piece.shape[dim + 1]))
            offset += piece.shape[dim + 1]
        ctx.group.all_reduce(whole)
        return whole, None, None, None, None


def _rank_pieces(x: torch.Tensor, rank: int, world: int, dim: int, block: int, segments: tuple) -> list[torch.Tensor]:
    """Views of the elements of contiguous ``x`` a rank holds along ``dim``, as ``[..., blocks, n, ...]``:
    in each block of ``block`` entries, its contiguous share of every part (``segments``: sizes within
    a block; one part when empty)."""
    shape = list(x.shape)
    blocked = x.view(*shape[:dim], shape[dim] // block, block, *shape[dim + 1:])
    pieces, start = [], 0
    for part in segments or (block,):
        piece = part // world
        pieces.append(blocked.narrow(dim + 1, start + rank * piece, piece))
        start += part
    return pieces


class _GroupModule(nn.Module):
    def __init__(self, group: Group) -> None:
        super().__init__()
        self.group = group


class CopyToTP(_GroupModule):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Copy.apply(x, self.group)


class ReduceFromTP(_GroupModule):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Reduce.apply(x, self.group)


class VocabEmbedding(_GroupModule):
    """``F.embedding`` with this rank's rows ``[rank * V_local, (rank + 1) * V_local)`` of the table."""

    def forward(self, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None, *rest) -> torch.Tensor:
        start = self.group.rank * weight.shape[0]
        outside = (ids < start) | (ids >= start + weight.shape[0])
        local = (ids - start).masked_fill(outside, 0)
        pad = None
        if padding_idx is not None and start <= padding_idx < start + weight.shape[0]:
            pad = padding_idx - start
        out = torch.nn.functional.embedding(local, weight, pad).masked_fill(outside.unsqueeze(-1), 0.0)
        return _Reduce.apply(out, self.group)


class VocabCrossEntropy(_GroupModule):
    """Mean (or sum) cross-entropy of ``[N, V/t]`` vocabulary-split logits against ``[N]`` class ids."""

    def forward(self, logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                reduction: str = "mean") -> torch.Tensor:
        return _VocabCrossEntropy.apply(logits, target, self.group, ignore_index, reduction)


class VocabLinearCrossEntropy(_GroupModule):
    """The fused head + loss (``mist::linear_cross_entropy``) over this rank's vocabulary rows of the
    head; returns ``(loss, None)`` like the op's ``(loss, lse)`` (only the loss is read)."""

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                reduction: str = "mean") -> tuple[torch.Tensor, None]:
        return vocab_parallel_linear_cross_entropy(hidden, weight, labels, self.group, ignore_index, reduction), None


class Scatter(_GroupModule):
    """This rank's part of a replicated value along ``dim`` made of blocks of ``block`` entries (see
    :class:`_Scatter`; ``block`` 0: the whole dimension is one block)."""

    def forward(self, x: torch.Tensor, dim: int, block: int = 0, segments: tuple = ()) -> torch.Tensor:
        return _Scatter.apply(x, self.group, dim, block or x.shape[dim], tuple(segments))


class SplitDropout(_GroupModule):
    """:func:`.dropout.counter_dropout` of this rank's part of a split value (``dim``, ``block``: as
    for :class:`Scatter`): the mask the whole value would get, this rank's part of it."""

    def forward(self, x, p, seeds, layer, site, dim: int = 0, block: int = 0, parts: tuple = ()):
        split = (dim, block or x.shape[dim] * self.group.world, tuple(parts), self.group.rank, self.group.world)
        return counter_dropout(x, p, seeds, layer, site, split)


class SplitAttention(_GroupModule):
    """:func:`.dropout.counter_attention` over this rank's heads (the probabilities' dropout mask is
    the whole attention's, this rank's heads of it)."""

    def forward(self, *args, dim: int = 1, block: int = 0, parts: tuple = (), **kwargs):
        heads = args[0].shape[dim]
        split = (dim, block or heads * self.group.world, tuple(parts), self.group.rank, self.group.world)
        return counter_attention(*args, split=split, **kwargs)


class _SplitNorm(_GroupModule):
    """A norm over features split over the ranks: per-rank sums of the statistics all-reduced
    (Megatron's *g*), read through *f* (their gradient all-reduced: every rank's features use them)."""

    def _mean(self, x: torch.Tensor, dims: tuple[int, ...], count: int) -> torch.Tensor:
        total = _Reduce.apply(x.sum(dim=dims, keepdim=True), self.group)
        return _Copy.apply(total / count, self.group)

    @staticmethod
    def _dims(x: torch.Tensor, normalized_shape) -> tuple[tuple[int, ...], int]:
        k = len(normalized_shape) if isinstance(normalized_shape, (tuple, list, torch.Size)) else 1
        dims = tuple(range(x.dim() - k, x.dim()))
        count = 1
        for d in dims:
            count *= x.shape[d]
        return dims, count


class SplitLayerNorm(_SplitNorm):
    def forward(self, x, normalized_shape, weight=None, bias=None, eps: float = 1e-5):
        dims, count = self._dims(x, normalized_shape)
        count *= self.group.world
        work = x.float()
        mean = self._mean(work, dims, count)
        centred = work - mean
        out = (centred * torch.rsqrt(self._mean(centred * centred, dims, count) + eps)).to(x.dtype)
        out = out * weight if weight is not None else out
        return out + bias if bias is not None else out


class SplitRMSNorm(_SplitNorm):
    def forward(self, x, normalized_shape, weight=None, eps: float | None = None):
        dims, count = self._dims(x, normalized_shape)
        work = x.float()
        eps = torch.finfo(x.dtype).eps if eps is None else eps
        out = (work * torch.rsqrt(self._mean(work * work, dims, count * self.group.world) + eps)).to(x.dtype)
        return out * weight if weight is not None else out


TP_CHILDREN = ("copy", "reduce", "embedding", "cross_entropy", "linear_cross_entropy", "scatter", "layer_norm",
               "rms_norm", "dropout", "attention",
               *SP_CHILDREN)  # what a graph may call (sequence parallelism: ops.sequence_parallel)


class TensorParallelOps(nn.Module):
    """The ``tp`` child of a sharded unit: its collectives, bound to one group."""

    def __init__(self, group: Group) -> None:
        super().__init__()
        self.copy = CopyToTP(group)
        self.reduce = ReduceFromTP(group)
        self.embedding = VocabEmbedding(group)
        self.cross_entropy = VocabCrossEntropy(group)
        self.linear_cross_entropy = VocabLinearCrossEntropy(group)
        self.scatter = Scatter(group)
        self.layer_norm = SplitLayerNorm(group)
        self.rms_norm = SplitRMSNorm(group)
        self.dropout = SplitDropout(group)
        self.attention = SplitAttention(group)
        for name, op in SP_CHILDREN.items():
            setattr(self, name, op(group))
