"""Pricing the plan's loss kernel (``Plan.fused_loss``): the fused, chunked head + loss or the plain one.

The captured program (and so every block analysis) runs the fused ``mist::linear_cross_entropy``:
no ``N x V`` logits, ``2NHV`` FLOPs forward and ``6NHV`` backward (the logits are recomputed).
The plain head + cross-entropy (``passes/loss_kernel``) is priced here as the difference to it, in
closed form over the fused op's shape (``N`` rows, hidden ``H``, ``V`` vocabulary rows on one
device, compute dtype of ``d`` bytes), as eager PyTorch runs it (a compiled head saves no more):

- time: the backward's recompute GEMM (``2NHV``) goes; the softmax-class passes over the logits
  come: forward ``.float()`` (when ``d < 4``) and log-softmax, backward the loss gradient,
  log-softmax's backward and the cast back; the fused op's own passes over its chunks (written
  and read forward, written, read and rewritten backward: ``2d`` and ``3d`` bytes per logit, which
  its op cost leaves out) go;
- memory: the fp32 log-probabilities (``4NV`` bytes) are saved for the backward; at the loss the
  forward also holds the logits (``d NV``, and their fp32 copy when ``d < 4``), the backward the
  two fp32 gradients (``8NV``, and the cast when ``d < 4``). The fused op's own chunk is not taken
  off (a bound, within ``N H d`` bytes).

:func:`loss_shape` reads the fused op's shape off a block's forward graph (``cost.analysis``);
:func:`plain_loss_deltas` gives the per-candidate differences the stage model adds to the post
block's terms. The stage model prices both for a candidate whose ``fused_loss`` is ``LOSS_CHOOSE``
(the tuner's) and keeps the plain loss where it fits in memory and is faster.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import sympy
import torch.fx as fx

from ..passes.cost_annotation import FUSED_LOSS, T, op_name, tensor_shape
from .hardware import HardwareProfile
from .op_time import matmul_time, op_class_time

FP32 = 4


@dataclass(frozen=True)
class LossShape:
    """The fused op's sizes on one device, symbolic in b, s, t."""

    rows: sympy.Expr  # N: tokens of a micro-batch
    hidden: sympy.Expr  # H
    vocab: sympy.Expr  # V on one device (V / t when the head is split)
    dtype_bytes: int  # d: the hidden states' element size


def loss_shape(forward: fx.GraphModule, names: set[str], symbols, states: dict[str, str]) -> LossShape | None:
    """The shape of the block's fused loss (``names``: the block's nodes), or None without one."""
    for node in forward.graph.nodes:
        if node.name in names and node.op == "call_function" and op_name(node) == FUSED_LOSS:
            hidden, weight = node.args[0], node.args[1]
            rows, width = tensor_shape(hidden.meta["val"], symbols)
            vocab = tensor_shape(weight.meta["val"], symbols)[0]
            if states.get(weight.name) == "S":
                vocab = vocab / T
            return LossShape(rows, width, vocab, hidden.meta["val"].element_size())
    return None


@dataclass
class PlainLossDeltas:
    """What the plain loss adds to (or, negative, takes from) the fused one's post-block terms."""

    forward_compute: np.ndarray
    backward_compute: np.ndarray
    saved: np.ndarray
    forward_peak: np.ndarray
    backward_peak: np.ndarray


def plain_loss_deltas(rows: np.ndarray, hidden: np.ndarray, vocab: np.ndarray, dtype_bytes: int,
                      profile: HardwareProfile, dtype: str) -> PlainLossDeltas:
    """Per candidate (arrays of N, H and V on one device): the module docstring's closed forms."""
    logits = np.asarray(rows, float) * np.asarray(vocab, float)  # N V elements
    low = dtype_bytes < FP32
    cast = np.where(low, (dtype_bytes + FP32) * logits, 0.0)  # one fp32 <-> d conversion pass
    # .float(), log-softmax (read, write); less the fused op's chunk written and read
    forward_bytes = cast + 2 * FP32 * logits - 2 * dtype_bytes * logits
    # loss gradient; log-softmax backward; cast back; less the fused chunk's recompute, read and rewrite
    backward_bytes = FP32 * logits + 3 * FP32 * logits + cast - 3 * dtype_bytes * logits
    recompute = 2.0 * np.asarray(rows, float) * np.asarray(hidden, float) * np.asarray(vocab, float)
    gemm_bytes = dtype_bytes * (np.asarray(rows, float) * hidden + np.asarray(vocab, float) * hidden + logits)
    ops = 3 * profile.op_overhead
    return PlainLossDeltas(
        forward_compute=op_class_time(profile, dtype, "softmax", 0.0, forward_bytes) + ops,
        backward_compute=op_class_time(profile, dtype, "softmax", 0.0, backward_bytes) + ops
        - matmul_time(profile, dtype, recompute, gemm_bytes),
        saved=FP32 * logits,
        forward_peak=dtype_bytes * logits + np.where(low, FP32 * logits, 0.0),
        backward_peak=2 * FP32 * logits + np.where(low, dtype_bytes * logits, 0.0),
    )
