"""The contract between the cost model and the tuner: vectorised stage evaluation.

The tuner enumerates stage configurations as parallel numpy arrays (one entry per candidate)
and asks a :class:`StageCostModel` for the time and memory of all of them at once. A stage costs
``G * stable + delta`` per iteration (DESIGN.md 2.3): ``stable`` is one micro-batch's steady
forward+backward, ``delta`` the extra work of the first forward / last backward of an iteration
(ZeRO gathers, gradient synchronisation, optimizer step and its offload traffic).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Protocol

import numpy as np

# the last stage's head + loss (Plan.fused_loss, priced by cost.loss_kernel): as a candidate's ``fused_loss``
LOSS_PLAIN, LOSS_FUSED, LOSS_CHOOSE = 0, 1, -1  # plain, fused and chunked, the faster that fits (the tuner)


@dataclass
class StageCandidates:
    """Stage configurations, as equal-length arrays (ints unless noted)."""

    num_layers: np.ndarray  # transformer layers in the stage
    has_pre: np.ndarray  # bool: the stage holds the embedding (first stage)
    has_post: np.ndarray  # bool: the stage holds final norm + head + loss (last stage)
    nodes: np.ndarray
    gpus_per_node: np.ndarray
    micro_batch: np.ndarray  # per data-parallel rank
    dp: np.ndarray
    tp: np.ndarray
    zero: np.ndarray  # 0..3
    ckpt_layers: np.ndarray  # checkpointed layers, <= num_layers
    offload_weights: np.ndarray  # float 0..1
    offload_grads: np.ndarray  # float 0..1
    offload_opt: np.ndarray  # float 0..1
    offload_acts: np.ndarray  # float 0..1
    inflight: np.ndarray  # micro-batches whose activations are alive at once (1F1B: stages from here to the end)
    grad_accum: np.ndarray = 1  # micro-batches per iteration (gradient accumulators live between them)
    low_precision_grads: np.ndarray = False  # bool: ZeRO 0/1 keep gradients in the param dtype (plan grad_dtype)
    # the last stage's head + loss (Plan.fused_loss): LOSS_FUSED (old plans' meaning), LOSS_PLAIN, or
    # LOSS_CHOOSE: the faster that fits in memory (the choice is breakdown["fused_loss"], 1.0 fused)
    fused_loss: np.ndarray = LOSS_FUSED
    sp: np.ndarray = False  # bool: sequence parallelism with the stage's tensor parallelism (plan ``sp``)
    act_policy: np.ndarray = -1  # index of the per-tensor activation policy (cost model's ``policies``); -1: none

    def __post_init__(self) -> None:
        lengths = {f.name: len(np.atleast_1d(getattr(self, f.name))) for f in fields(self)}
        size = max(lengths.values())
        for f in fields(self):
            value = np.atleast_1d(np.asarray(getattr(self, f.name)))
            if len(value) == 1 and size > 1:
                value = np.repeat(value, size)
            if len(value) != size:
                raise ValueError(f"StageCandidates.{f.name} has {len(value)} entries, expected {size}")
            setattr(self, f.name, value)

    def __len__(self) -> int:
        return len(self.num_layers)

    def select(self, index: np.ndarray) -> "StageCandidates":
        return StageCandidates(**{f.name: getattr(self, f.name)[index] for f in fields(self)})


@dataclass
class StageEstimates:
    """Predictions for each candidate, same order as the :class:`StageCandidates`."""

    stable_s: np.ndarray  # steady-state forward+backward of one micro-batch, seconds
    delta_s: np.ndarray  # extra first/last micro-batch work per iteration, seconds
    peak_memory_bytes: np.ndarray  # predicted peak device memory
    # named parts of the above (e.g. "compute", "exposed_comm", "exposed_copy", "params", "acts")
    breakdown: dict[str, np.ndarray] = field(default_factory=dict)


class StageCostModel(Protocol):
    """What the tuner needs from the cost model (and, optionally, ``totals(candidates)``: ``evaluate``
    without the breakdown, and ``peak_memory(candidates)``: its peaks, priced without the times
    where they can be)."""

    device_memory_bytes: float

    def evaluate(self, candidates: StageCandidates) -> StageEstimates: ...


def pipeline_iteration_time(stable_s: np.ndarray, delta_s: np.ndarray, grad_accum: int) -> float:
    """``(G-1) * max_i T_i + sum_i T_i + max_i (D_i - sum_{j<i} T_j)`` over the stages in order."""
    stable = np.asarray(stable_s, dtype=float)
    delta = np.asarray(delta_s, dtype=float)
    before = np.concatenate(([0.0], np.cumsum(stable)[:-1]))
    return float((grad_accum - 1) * stable.max() + stable.sum() + max(0.0, float((delta - before).max())))
