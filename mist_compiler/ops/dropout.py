"""Dropout whose mask is a function of where an element sits in the global batch, not of a
random-number stream: every plan draws the masks one process would.

Megatron keeps tensor-parallel training correct and reproducible with an RNG tracker: replicated
regions draw one stream on every tensor-parallel rank, split regions a stream per rank. Here the
mask goes one step further: element ``i`` (row-major index within its sample, in the *whole*
tensor, split or not) of sample ``n`` (global index in the step's batch) at dropout site ``s`` of
layer ``l`` is kept iff ``hash(seed(n, step), l, s, i) >= p * 2**32``. So a data-parallel rank,
a micro-batch, a pipeline stage, a tensor-parallel rank holding heads ``[a, b)`` and the one-process
reference (``verify.check``) all draw the same mask for the same element; a recomputed
(checkpointed) layer draws it again; replicated values get one mask on every rank.

- :func:`sample_seeds` gives the per-sample seeds of a step (``seeds[n]``, int64 in ``[0, 2**32)``);
- :func:`counter_dropout` is ``F.dropout(x, p, training=True)`` with that mask; ``split`` says which
  part of the whole tensor ``x`` is on a tensor-parallel rank: ``(dimension, block, parts, rank,
  degree)`` (:func:`global_index`);
- :func:`counter_attention` is ``scaled_dot_product_attention`` with ``dropout_p > 0`` written out
  (scores, softmax, :func:`counter_dropout` of the probabilities, ``@ v``).

The hash is integer arithmetic on int64 tensors kept below 2**32 before every product (no overflow),
so CPU, GPU and compiled code agree bit for bit. The sample is the leading dimension: ``x`` must be
``[batch * k, ...]`` with the batch outermost, as every layer of a causal LM keeps it.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

_MASK = 0xFFFFFFFF
_MIX = 0x45D9F3B  # a 32-bit integer hash multiplier (< 2**27: products stay below 2**59)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A bijective avalanche of 32-bit values held in int64."""
    x = x ^ (x >> 16)
    x = (x * _MIX) & _MASK
    x = x ^ (x >> 16)
    x = (x * _MIX) & _MASK
    return x ^ (x >> 16)


def _mix_int(value: int) -> int:
    return int(_mix(torch.tensor(value & _MASK, dtype=torch.int64)))


def sample_seeds(base: int, step: int, samples: torch.Tensor) -> torch.Tensor:
    """The dropout seed of each global sample index in ``samples`` at training step ``step``."""
    key = _mix_int(_mix_int(base) ^ _mix_int(step + 0x9E3779B9))
    return _mix((samples.to(torch.int64) & _MASK) ^ key)


def _positions(shape: list[int], device: torch.device, split) -> torch.Tensor:
    """Row-major index within its sample of every element of a ``[k, *rest]`` per-sample block, in the
    whole tensor's layout when ``x`` is a tensor-parallel rank's part (``split``)."""
    full = list(shape)
    if split is not None:
        dim, block, parts, rank, world = split
        full[dim] = shape[dim] * world
    index = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for d in range(len(shape) - 1, -1, -1):
        local = torch.arange(shape[d], dtype=torch.int64, device=device)
        if split is not None and d == dim:
            local = global_index(local, shape[d], min(block, full[d]), parts, rank, world)
        view = [1] * len(shape)
        view[d] = shape[d]
        index = index + (local * stride).view(view)
        stride *= full[d]
    return index


def global_index(local: torch.Tensor, size: int, block: int, parts: tuple, rank: int, world: int) -> torch.Tensor:
    """Where each of a rank's ``size`` entries along a split dimension sits in the whole one: the
    dimension is blocks of ``block`` entries (one block unless a leading factor is merged into it,
    as Bloom's ``batch * heads``), and in each block the rank holds its share of every part
    (``parts``, sizes within a block; one part when empty)."""
    local_block = block // world
    whole_parts = tuple(parts) or (block,)
    within = local % local_block
    result = torch.zeros_like(local)
    begin = local_begin = 0
    for part in whole_parts:
        piece = part // world
        inside = (within >= local_begin) & (within < local_begin + piece)
        result = torch.where(inside, within - local_begin + begin + rank * piece, result)
        begin, local_begin = begin + part, local_begin + piece
    return (local // local_block) * block + result


def keep_mask(shape, p: float, seeds: torch.Tensor, layer: torch.Tensor | int, site: int, split=None) -> torch.Tensor:
    """Whether each element of a tensor of ``shape`` is kept (see the module docstring)."""
    rows = shape[0]
    if rows % seeds.shape[0]:
        raise ValueError(f"dropout: a tensor of shape {tuple(shape)} does not have the batch ({seeds.shape[0]} "
                         "samples) as its leading dimension")
    per_sample = [rows // seeds.shape[0], *shape[1:]]
    positions = _positions(per_sample, seeds.device, split)
    layer = torch.as_tensor(layer, dtype=torch.int64, device=seeds.device)
    key = _mix(seeds.to(torch.int64) ^ _mix((layer * 0x10001 + site + 1) & _MASK))
    key = key.view(-1, *([1] * len(per_sample)))
    hashed = _mix(((positions & _MASK) ^ key) & _MASK)
    hashed = _mix((hashed + (positions >> 32) + key) & _MASK)
    threshold = min(int(p * 2 ** 32), 2 ** 32)
    return (hashed >= threshold).reshape(shape)


def counter_dropout(x: torch.Tensor, p: float, seeds: torch.Tensor, layer: torch.Tensor | int, site: int,
                    split=None) -> torch.Tensor:
    """``F.dropout(x, p, training=True)`` with the mask :func:`keep_mask` gives."""
    if p <= 0.0:
        return x
    if p >= 1.0:
        return x * 0.0
    return apply_keep(x, dropout_keep(x, p, seeds, layer, site, split), p)


def dropout_keep(x: torch.Tensor, p: float, seeds: torch.Tensor, layer: torch.Tensor | int, site: int,
                 split=None) -> torch.Tensor:
    """The mask :func:`counter_dropout` applies to ``x`` (``0 < p < 1``): the first of its two halves. A
    compiled unit draws it again in the backward rather than save it (``lowering.compile``)."""
    return keep_mask(x.shape, p, seeds, layer, site, split)


def apply_keep(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """``x`` where ``keep``, scaled by ``1 / (1 - p)``, else 0: the second half of :func:`counter_dropout`
    (its backward reads the boolean mask, as ``F.dropout``'s does)."""
    return torch.where(keep, x * (1.0 / (1.0 - p)), 0.0)


def counter_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask=None,
                      dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                      enable_gqa: bool = False, *, seeds: torch.Tensor, layer: torch.Tensor | int, site: int,
                      split=None) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with dropout on the probabilities by :func:`counter_dropout`
    (``split``: the tensor-parallel part of the heads, for the probabilities ``[batch, heads, q, k]``)."""
    probs, value = attention_probabilities(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    probs = counter_dropout(probs, dropout_p, seeds, layer, site, split)
    return torch.matmul(probs, value)


def attention_probabilities(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask=None,
                            is_causal: bool = False, scale: float | None = None,
                            enable_gqa: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The first half of :func:`counter_attention`: the softmax probabilities and the values (their heads
    repeated for grouped-query attention) that the dropped-out probabilities multiply."""
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeat, dim=-3), value.repeat_interleave(repeat, dim=-3)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    if is_causal:
        length_q, length_k = query.shape[-2], key.shape[-2]
        causal = torch.ones(length_q, length_k, dtype=torch.bool, device=query.device).tril(length_k - length_q)
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    return F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype), value


__all__ = ["apply_keep", "attention_probabilities", "counter_attention", "counter_dropout", "dropout_keep", "global_index", "keep_mask",
           "sample_seeds"]
