"""Where each element of a rank's flat buffers sits in the model's full (logical) parameters.

The runtime keeps a stage's parameters in flat per-unit buckets (``zero.UnitBucket``): a unit's
tensor-parallel pieces back to back, padded, and (ZeRO >= 1) cut into equal data-parallel shards
that ignore parameter boundaries. A checkpoint that any other plan can read must name every value
by the model's parameter name and its position in the *full* tensor, so this module maps a flat
range of a bucket to boxes (offsets, sizes) of full parameters:

1. flat range -> each parameter slot it meets -> a row-major range of that TP piece;
2. a row-major range of an n-d tensor -> at most ``2 * ndim - 1`` boxes (:func:`range_boxes`);
3. a box of a TP piece -> boxes of the full tensor (the split dimension moved by the rank's
   offset, and cut at fused-projection segment boundaries: :func:`piece_to_full`).

``BucketView`` says, per bucket, which master elements this rank *owns* (writes to a checkpoint
and counts in the gradient norm: every element of the model exactly once over the world: the
data-parallel shard of ``shard_range``, tensor-parallel-replicated parameters only on tp rank 0)
and which it *holds* (reads back from a checkpoint: everything its master buffer covers).
DTensor cannot describe these layouts (ZeRO shards cut across parameters, fused projections are
split per segment), hence the hand-written mapping.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..ir.model_graph import ShardSpec

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def range_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[Box]:
    """The row-major elements ``[lo, hi)`` of a tensor of ``shape`` as disjoint boxes, in order."""
    if lo >= hi:
        return []
    if len(shape) == 0:
        return [((), ())]
    if len(shape) == 1:
        return [((lo,), (hi - lo,))]
    row = 1
    for size in shape[1:]:
        row *= size
    boxes: list[Box] = []
    first, last = lo // row, hi // row
    if lo % row:  # a partial first row
        end = min(hi, (first + 1) * row)
        boxes += [((first,) + o, (1,) + s) for o, s in range_boxes(shape[1:], lo - first * row, end - first * row)]
        first += 1
        if end == hi:
            return boxes
    if last > first:  # whole rows
        boxes.append(((first,) + (0,) * (len(shape) - 1), (last - first,) + tuple(shape[1:])))
    if hi % row and last >= first:  # a partial last row
        boxes += [((last,) + o, (1,) + s) for o, s in range_boxes(shape[1:], 0, hi - last * row)]
    return boxes


def full_shape(piece_shape: tuple[int, ...], spec: ShardSpec | None, tp: int) -> tuple[int, ...]:
    if spec is None or tp == 1:
        return tuple(piece_shape)
    shape = list(piece_shape)
    shape[spec.dim] *= tp
    return tuple(shape)


def piece_to_full(box: Box, piece_shape: tuple[int, ...], spec: ShardSpec | None, tp_index: int,
                  tp: int) -> list[tuple[Box, Box]]:
    """(box in the piece, the same elements' box in the full tensor) pairs covering ``box``."""
    if spec is None or tp == 1:
        return [(box, box)]
    full = full_shape(piece_shape, spec, tp)
    dim = spec.dim
    slices = spec.rank_slices(full[dim], tp_index, tp)  # this rank's ranges of ``dim``, in piece order
    offsets, sizes = box
    out, piece_start = [], 0
    for piece in slices:
        length = piece.stop - piece.start
        lo, hi = max(offsets[dim], piece_start), min(offsets[dim] + sizes[dim], piece_start + length)
        if lo < hi:
            local = (offsets[:dim] + (lo,) + offsets[dim + 1:], sizes[:dim] + (hi - lo,) + sizes[dim + 1:])
            moved = (offsets[:dim] + (piece.start + lo - piece_start,) + offsets[dim + 1:], local[1])
            out.append((local, moved))
        piece_start += length
    return out


def box_view(flat: torch.Tensor, flat_start: int, piece_shape: tuple[int, ...], box: Box) -> torch.Tensor:
    """A view of ``flat`` (holding the piece's row-major elements from ``flat_start`` on) as ``box``."""
    strides, step = [], 1
    for size in reversed(piece_shape):
        strides.append(step)
        step *= size
    strides.reverse()
    origin = sum(o * s for o, s in zip(box[0], strides))
    return flat.as_strided(box[1], strides, flat.storage_offset() + origin - flat_start)


@dataclass(frozen=True)
class Piece:
    """A run of master elements ``[lo, hi)`` (master coordinates) that is part of one parameter's TP piece."""

    fqn: str
    lo: int
    hi: int
    piece_lo: int  # the run's first element in the piece's row-major order
    piece_shape: tuple[int, ...]
    spec: ShardSpec | None
    full_shape: tuple[int, ...]

    def boxes(self, tp_index: int, tp: int) -> list[tuple[Box, Box]]:
        """(piece box, full box) pairs of this run."""
        pairs = []
        for box in range_boxes(self.piece_shape, self.piece_lo, self.piece_lo + self.hi - self.lo):
            pairs += piece_to_full(box, self.piece_shape, self.spec, tp_index, tp)
        return pairs


class BucketView:
    """One bucket's master buffer in the model's terms (see the module docstring)."""

    def __init__(self, bucket: Any, fqn: dict[str, str], shards: dict[str, ShardSpec], tp_index: int, tp: int) -> None:
        self.bucket = bucket
        self.tp_index, self.tp = tp_index, tp
        layout = bucket.layout
        zero = bucket.ctx.zero
        self.base = 0 if zero == 0 else bucket.shard_lo  # master element 0 is this flat element
        shard_lo, shard_hi = layout.shard_range(bucket.ctx.rank)  # this data-parallel rank's share
        self.held: list[Piece] = []
        self.owned: list[Piece] = []
        for slot in layout.slots:
            spec = shards.get(slot.name)
            name = fqn.get(slot.name, slot.name)
            shape = tuple(slot.shape)
            ranges = ((self.held, self.base, self.base + bucket.master.numel), (self.owned, shard_lo, shard_hi))
            for target, lo, hi in ranges:
                if target is self.owned and spec is None and tp > 1 and tp_index != 0:
                    continue  # every tp rank holds it whole: tp rank 0 speaks for it
                a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                if a < b:
                    target.append(Piece(name, a - self.base, b - self.base, a - slot.offset, shape, spec,
                                        full_shape(shape, spec, tp)))

    def owned_runs(self) -> list[tuple[int, int]]:
        """The owned master ranges, adjacent ones merged (for the gradient norm)."""
        runs: list[tuple[int, int]] = []
        for piece in self.owned:
            if runs and runs[-1][1] == piece.lo:
                runs[-1] = (runs[-1][0], piece.hi)
            else:
                runs.append((piece.lo, piece.hi))
        return runs


def bucket_views(engine: Any) -> list[BucketView]:
    """Every runtime bucket of this rank's stage, as :class:`BucketView`."""
    return [BucketView(bucket, engine.program.fqn, engine.program.shards, engine.coord.tp_index, engine.stage_plan.tp)
            for bucket in engine.runtime.buckets]
