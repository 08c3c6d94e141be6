"""Stage memory: closed-form outer terms over the per-block symbolic analysis (numpy-vectorised).

The inner terms come from the memory-analysis pass (per block class, symbolic in b, s, t and
evaluated per candidate): saved activations ``A`` per micro-batch, the block input ``I``, the
forward and backward peaks of live memory. The outer terms are closed forms here:

- **model states** per parameter (dtype-aware): mixed precision (float16/bfloat16) keeps a
  2-byte weight, a 2-byte gradient and 12 bytes of optimizer state (fp32 master weight, Adam
  first and second moments); float32 training keeps 4 + 4 + 8 (no master copy).
  ZeRO over the ``dp`` ranks: level 1 shards optimizer states, 2 also gradients, 3 also weights.
  Offload ratios move that fraction of each state to the host.
- **buffers**: ZeRO-3 gathers full layer weights on use, one layer in use and one prefetched
  (``2 * layer weight bytes``); levels 2-3 hold one layer's full gradients before the
  reduce-scatter; offloaded weights are brought back one layer ahead (two layers' offloaded
  part on the device) and offloaded gradients leave through one layer's staging buffer.
- **activations** under 1F1B: ``inflight`` micro-batches are alive at once (stage i of S holds
  S-i). A checkpointed layer keeps only its input ``I``; its activations come back during its
  backward (the recompute) and are transient there. Activation offload moves a fraction of the
  *held* micro-batches' activations (those not being processed) to the host.
- **peak**: during the forward of block j of the newest micro-batch, or the backward of block j
  of the oldest: ``(inflight - 1) * acts_per_microbatch + acts of the blocks before j + peak of j``;
  the stage's checkpointed layers are its first ``ckpt_layers`` layers (as the backend does).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIXED_PRECISION_BYTES = (2.0, 2.0, 12.0)  # weight, gradient, optimizer state per parameter
FP32_BYTES = (4.0, 4.0, 8.0)


def state_bytes_per_param(dtype: str) -> tuple[float, float, float]:
    """(weight, gradient, optimizer) bytes per parameter for Adam training in ``dtype``."""
    if dtype in ("float16", "bfloat16"):
        return MIXED_PRECISION_BYTES
    if dtype == "float32":
        return FP32_BYTES
    raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype!r}")


@dataclass
class ModelStateMemory:
    weights: np.ndarray
    grads: np.ndarray
    opt: np.ndarray
    buffers: np.ndarray  # ZeRO gather / gradient buckets

    @property
    def total(self) -> np.ndarray:
        return self.weights + self.grads + self.opt + self.buffers


def model_state_memory(stage_params, layer_params, dtype: str, zero, dp, offload_weights, offload_grads,
                       offload_opt) -> ModelStateMemory:
    """Device bytes of weights, gradients, optimizer states and ZeRO buffers of one stage rank.

    ``stage_params``: parameters on one device after tensor-parallel sharding (before ZeRO);
    ``layer_params``: the same for one layer (sizes the ZeRO-3 gather and gradient buffers).
    """
    weight_b, grad_b, opt_b = state_bytes_per_param(dtype)
    zero = np.asarray(zero)
    dp = np.asarray(dp, dtype=float)
    stage_params = np.asarray(stage_params, dtype=float)
    layer_params = np.asarray(layer_params, dtype=float)
    opt_share = np.where(zero >= 1, 1.0 / dp, 1.0)
    grad_share = np.where(zero >= 2, 1.0 / dp, 1.0)
    weight_share = np.where(zero >= 3, 1.0 / dp, 1.0)
    weights = stage_params * weight_b * weight_share * (1.0 - np.asarray(offload_weights))
    grads = stage_params * grad_b * grad_share * (1.0 - np.asarray(offload_grads))
    opt = stage_params * opt_b * opt_share * (1.0 - np.asarray(offload_opt))
    sharded = dp > 1
    gather = np.where((zero >= 3) & sharded, 2.0 * layer_params * weight_b, 0.0)
    grad_bucket = np.where((zero >= 2) & sharded, layer_params * grad_b, 0.0)
    # offloaded weights come back one layer ahead (in use + prefetched) unless ZeRO-3's gather buffer
    # already holds them; offloaded gradients leave one layer at a time
    weight_prefetch = np.where(gather > 0, 0.0, 2.0 * layer_params * weight_b * weight_share * np.asarray(offload_weights))
    grad_staging = layer_params * grad_b * grad_share * np.asarray(offload_grads)
    return ModelStateMemory(weights, grads, opt, gather + grad_bucket + weight_prefetch + grad_staging)


@dataclass
class BlockActivationTerms:
    """Per-candidate byte arrays of one block kind (from the memory-analysis pass)."""

    saved: np.ndarray  # A: activations kept for the backward, one micro-batch
    input: np.ndarray  # I: the block input (all a checkpointed block keeps)
    forward_peak: np.ndarray  # max over forward points of saved-so-far + live transient
    backward_peak: np.ndarray  # max over backward points of everything alive


def activation_peak(layer: BlockActivationTerms, pre: BlockActivationTerms, post: BlockActivationTerms,
                    num_layers, ckpt_layers, has_pre, has_post, inflight, offload_acts) -> tuple[np.ndarray, np.ndarray]:
    """(activation bytes of one micro-batch as held, peak activation bytes) per candidate."""
    num_layers = np.asarray(num_layers, dtype=float)
    ckpt = np.asarray(ckpt_layers, dtype=float)
    plain = num_layers - ckpt
    has_pre = np.asarray(has_pre, dtype=float)
    has_post = np.asarray(has_post, dtype=float)
    kept = 1.0 - np.asarray(offload_acts, dtype=float)
    pre_acts = has_pre * pre.saved
    post_acts = has_post * post.saved
    per_microbatch = pre_acts + ckpt * layer.input + plain * layer.saved + post_acts
    held = (np.asarray(inflight, dtype=float) - 1.0) * per_microbatch * kept
    zero = np.zeros_like(per_microbatch)
    candidates = [
        # forward of the newest micro-batch
        has_pre * pre.forward_peak,
        np.where(ckpt > 0, pre_acts + (ckpt - 1) * layer.input + layer.forward_peak, zero),
        np.where(plain > 0, pre_acts + ckpt * layer.input + (plain - 1) * layer.saved + layer.forward_peak, zero),
        has_post * (pre_acts + ckpt * layer.input + plain * layer.saved + post.forward_peak),
        # backward of the oldest micro-batch (post first, then layers last to first, then pre)
        has_post * (pre_acts + ckpt * layer.input + plain * layer.saved + post.backward_peak),
        np.where(plain > 0, pre_acts + ckpt * layer.input + (plain - 1) * layer.saved + layer.backward_peak, zero),
        # a checkpointed layer: its forward is recomputed, then its backward runs
        np.where(ckpt > 0, pre_acts + (ckpt - 1) * layer.input + np.maximum(layer.forward_peak, layer.backward_peak), zero),
        has_pre * pre.backward_peak,
    ]
    return per_microbatch, held + np.max(np.stack(candidates), axis=0)
