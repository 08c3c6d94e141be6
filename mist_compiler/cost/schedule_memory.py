"""Peak memory of a group of devices under a pipeline schedule, by walking its action list.

A group runs one chunk (1F1B, GPipe, ZB-H1) or several (interleaved, ZB-V) and holds, at any
moment of its action list (``ir/schedule.py``, run as ``runtime/engine.py`` does):

- the weights and optimizer states of every chunk (the whole step);
- per chunk, its gradients: none before its first gradient-producing action of the step (``B``,
  or ``W`` where the backward is split), its accumulators between micro-batches, after its last
  one what it keeps until the optimizer step;
- per (chunk, micro-batch) in flight: what one more in-flight micro-batch of that chunk keeps
  (activations, its boundary output) from its ``F`` until its ``B`` or ``I``, then what the weight
  half keeps (the stash) until its ``W``;
- on top of that, the action that runs: a ``B`` peaks as the chunk's own backward with one
  micro-batch held (the stage model's peak at one in flight, its own gradients included); an
  ``I`` the same without the micro-batch gradient buffer (its weight half makes none); a ``W``
  the same with that micro-batch's stash in place of its activations (the runtime drops each
  unit's stash once its weight half has run, as a backward frees saved tensors) and, in a chunk of
  eager layers, a layer's gradients, which its weight half returns together before they are added
  to their buffer (a chunk with the pre or post block is priced from that block's backward peak,
  which is above a layer's weight half); an ``F`` adds its micro-batch to what is held.

The group's peak is the largest of these over its actions and of the optimizer step's point. For
one chunk the walk is the stage model's 1F1B rule (the peak at one in flight plus what the
other in-flight micro-batches keep); with several, each chunk is priced as itself (its layers, its
boundary, its gradient state at that action), not as one stage holding them all.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir.schedule import B, F, I, W, Schedule
from .memory import SCHEDULE_MEMORY_PARTS
from .stage_api import StageEstimates


@dataclass
class ChunkMemory:
    """Per virtual stage (rows) and candidate (columns): bytes of one chunk from the stage model,
    evaluated as its own stage at one micro-batch in flight."""

    static: np.ndarray  # weights and optimizer states on the device
    first: np.ndarray  # the step's first backward's peak above ``static``, one micro-batch held
    middle: np.ndarray  # the same of a backward neither first nor last (its own accumulators kept)
    last: np.ndarray  # the same of the last (its gradients reduced)
    input_half: np.ndarray  # what an input half adds to that: less the gradients it does not make
    weight_half: np.ndarray  # what a weight half adds to that: its stash in place of the activations
    held: np.ndarray  # what one more in-flight micro-batch keeps
    stash: np.ndarray  # what a weight half keeps from its input half (0 without a split backward)
    accumulators: np.ndarray  # gradients kept between micro-batches
    reduced: np.ndarray  # gradients kept after the last micro-batch, until the step

    def backward(self, virtual: int, made: int, total: int) -> np.ndarray:
        """The running backward's peak above ``static``: the chunk's ``made``-th of ``total``."""
        if made == 0:
            return self.first[virtual]
        return self.last[virtual] if made >= total - 1 else self.middle[virtual]


def has_memory_parts(estimates: StageEstimates) -> bool:
    """The estimates carry what the walk needs (a test double of the stage model may not)."""
    return all(name in estimates.breakdown for name in (*SCHEDULE_MEMORY_PARTS, "params", "opt"))


def chunk_memory(estimates: StageEstimates, split_backward: bool) -> ChunkMemory:
    """The walk's inputs from the stage model's estimates of each virtual stage (one column)."""
    parts = {name: np.asarray(values, dtype=float) for name, values in estimates.breakdown.items()}
    static = parts["params"] + parts["opt"]
    peak = np.asarray(estimates.peak_memory_bytes, dtype=float)
    in_steps = parts.get("peak_forward_backward", peak)
    stash = parts.get("weight_stash", np.zeros_like(static)) if split_backward else np.zeros_like(static)
    held, accumulators = parts["held_per_microbatch"], parts["accumulators"]
    # the breakdown's parts are those of the backward's peak point unless the optimizer step is higher: then
    # an input half is priced as a whole backward, a weight half with its micro-batch's stash for its held bytes
    at_point = in_steps >= peak
    input_half = np.where(at_point, accumulators - parts.get("grads", 0.0), 0.0)
    weight_half = np.where(at_point, -parts.get("acts", 0.0), -held) + stash
    if split_backward:  # a layer's gradients, returned together beside their buffer (eager layer chunks)
        weight_half = weight_half + parts.get("weight_half_grads", 0.0)
    column = lambda values: np.asarray(values, dtype=float)[:, None]  # noqa: E731
    return ChunkMemory(column(static), *(column(parts[f"peak_backward_{phase}"] - static)
                                         for phase in ("first", "middle", "last")),
                       column(input_half), column(weight_half), column(held), column(stash), column(accumulators),
                       column(parts["grads_at_step"]))


def _producing(kind: str, split: bool) -> bool:
    """The action makes weight gradients: a whole backward, or the weight half of a split one."""
    return kind == B or (kind == W and split)


def stage_peak(schedule: Schedule, stage: int, memory: ChunkMemory) -> np.ndarray:
    """[n] the peak over ``stage``'s actions (see the module docstring)."""
    split = schedule.split_backward
    actions = [(a.kind, schedule.virtual_stage(stage, a.chunk), a.micro) for a in schedule.compute(stage)]
    chunks = list(schedule.chunks(stage))
    total = {j: sum(1 for kind, v, _ in actions if v == j and _producing(kind, split)) for j in chunks}
    made = dict.fromkeys(chunks, 0)
    static = sum(memory.static[j] for j in chunks)
    grads = {j: np.zeros_like(static) for j in chunks}
    stashed: set[tuple[int, int]] = set()
    held = np.zeros_like(static)
    peak = np.zeros_like(static)
    for kind, v, micro in actions:
        others = sum(grads[j] for j in chunks if j != v)
        if kind == F:
            held = held + memory.held[v]
            peak = np.maximum(peak, static + others + grads[v] + held)
            continue
        here = memory.backward(v, made[v], total[v])
        if kind in (B, I):
            held = held - memory.held[v]
            here = here + (memory.input_half[v] if kind == I and split else 0.0)
        else:  # W: this micro-batch holds its stash, not its activations
            if (v, micro) in stashed:
                held = held - memory.stash[v]
                stashed.discard((v, micro))
            here = here + memory.weight_half[v]
        peak = np.maximum(peak, static + others + held + here)
        if kind == I and split:
            held = held + memory.stash[v]
            stashed.add((v, micro))
        if _producing(kind, split):
            made[v] += 1
            grads[v] = memory.reduced[v] if made[v] >= max(total[v], 1) else memory.accumulators[v]
    return peak


def group_peaks(schedule: Schedule, memory: ChunkMemory, step: np.ndarray) -> np.ndarray:
    """[pp, n] each group's peak: the walk over its actions, or the optimizer step's point
    (``step``: [pp, n]) where that is higher."""
    walked = np.stack([stage_peak(schedule, stage, memory) for stage in range(schedule.stages)])
    return np.maximum(walked, step)
