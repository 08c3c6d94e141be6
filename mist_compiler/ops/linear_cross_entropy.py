"""``mist::linear_cross_entropy``: the LM head's matmul fused with the cross-entropy loss, by vocabulary slices.

``linear_cross_entropy(hidden [N, H], weight [V, H], labels [N], ignore_index, reduction)`` is
``F.cross_entropy(hidden @ weight.T, labels, ignore_index=, reduction=)`` computed ``columns``
vocabulary entries at a time (:func:`slice_columns`, ``min(V, H)``): a slice's logits ``[N, columns]``
are at most as many elements as the hidden input ``[N, H]``, so nothing of size ``N x V`` (fp32 or
not) ever exists.

- forward (``mist::linear_cross_entropy``, returns ``(loss, lse)``): per slice, logits in the
  compute dtype, then each row's fp32 log-sum-exp over the slice and its label's logit when the
  label falls in it (``chunk_kernels``), merged into the running per-row log-sum-exp
  (``logaddexp``) and target logit; the loss is fp32. ``lse [N]`` (fp32) is a second output so that
  autograd saves it: the op saves ``hidden``, ``weight``, ``labels`` and ``lse``, nothing else;
- backward (``mist::linear_cross_entropy_backward``): per slice, the logits again (recompute),
  turned in place into ``(softmax - onehot) * grad / count``, then the slice's rows of
  ``grad_weight`` (one GEMM over all ``N`` rows, written once: no accumulator over the ``[V, H]``
  weight) and ``grad_hidden`` accumulated over slices (fp32 accumulator ``[N, H]`` for fp16/bf16).
  Slicing the vocabulary rather than the rows matters for speed: cutting the rows instead
  re-reads and re-writes the whole ``[V, H]`` weight gradient once per chunk (``V / H`` chunks,
  ``8 V^2`` bytes of traffic: more than the GEMMs themselves on a CPU, and on a GPU for a 128K
  vocabulary), and its row chunks (``N H / V`` rows) are GEMMs too skinny to run at speed;
- FLOPs (``torch.utils.flop_counter``): forward ``2NHV``; backward ``6NHV`` (``4NHV`` for the two
  gradients plus ``2NHV`` recomputing the logits);
- memory (:func:`workspace_points`): the transient each op holds besides its inputs and outputs,
  the closed form the memory-analysis pass charges at the op's program point.

``reduction`` is ``"mean"`` (over the labels that are not ``ignore_index``; nan when there are
none, as ``F.cross_entropy``) or ``"sum"``.
"""
from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

from .chunk_kernels import chunk_backward, chunk_forward

REDUCTIONS = ("mean", "sum")
FP32_BYTES = 4


def slice_columns(vocab: int, hidden: int) -> int:
    """Vocabulary entries per slice: ``min(V, H)`` (at least 1), so that a slice's logits ``[N, columns]``
    hold at most ``N * H`` elements: the transient is bounded by the size of the input."""
    return max(1, min(vocab, hidden))


def workspace_points(num_rows, vocab, hidden, dtype_bytes: int, weight_bytes: int, phase: str) -> list:
    """Bytes the op holds at each of its internal peak points besides its inputs and its outputs
    (outputs counted as allocated from the op's start; a point below them is a negative term).
    Plain arithmetic: ints or sympy expressions. ``vocab``: this rank's vocabulary; ``dtype_bytes``:
    the compute (hidden) dtype's size; ``weight_bytes``: the weight's.

    - forward: one slice of logits (``N*H`` elements, :func:`slice_columns`; ``V >= H`` for a
      language model) and three fp32 per-row vectors (the target logits and the slice's
      log-sum-exp and target);
    - backward, fp32: one slice of logits (turned into its gradient in place); both gradients
      (outputs) are written in place;
    - backward, fp16/bf16: (1) in the loop: the slice, the fp32 ``[N, H]`` accumulator of the hidden
      gradient and one fp32 product of the same size added into it (``mm(out_dtype=float32)``),
      while the hidden-gradient output does not exist yet; (2) at the end: the accumulator while it
      is cast into the output. The weight gradient is written slice by slice in its own dtype (each
      slice one GEMM over all rows, accumulated in fp32 by the GEMM itself).
    On CPU the fp16/bf16 path upcasts operands instead (no mixed-dtype matmul there): the model
    describes the GPU kernels for those dtypes; fp32 is the same everywhere."""
    chunk = num_rows * hidden * dtype_bytes
    if phase == "forward":
        return [chunk + 3 * num_rows * FP32_BYTES]
    if phase != "backward":
        raise ValueError(f"workspace_points: phase must be 'forward' or 'backward', got {phase!r}")
    if dtype_bytes >= FP32_BYTES:
        return [chunk]
    accumulator = num_rows * hidden * FP32_BYTES
    return [chunk + 2 * accumulator - num_rows * hidden * dtype_bytes, accumulator]


def _check_args(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, reduction: str) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or labels.dim() != 1:
        raise ValueError(f"linear_cross_entropy: expected hidden [N, H], weight [V, H], labels [N]; got "
                         f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(labels.shape)}")
    if hidden.shape[1] != weight.shape[1] or hidden.shape[0] != labels.shape[0]:
        raise ValueError(f"linear_cross_entropy: shapes disagree: hidden {tuple(hidden.shape)}, weight "
                         f"{tuple(weight.shape)}, labels {tuple(labels.shape)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"linear_cross_entropy: reduction must be one of {REDUCTIONS}, got {reduction!r}")


def forward_slices(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                   target: torch.Tensor, vocab_start: int = 0, ignore_index: int = -100) -> None:
    """Per-row log-sum-exp over ``weight``'s vocabulary and the label's logit (0 outside it), slice by slice."""
    vocab = weight.shape[0]
    columns = slice_columns(vocab, hidden.shape[1])
    buffer = torch.empty(hidden.shape[0], columns, dtype=hidden.dtype, device=hidden.device)
    part_lse, part_target = torch.empty_like(lse), torch.empty_like(target)
    lse.fill_(float("-inf"))
    target.zero_()
    for start in range(0, vocab, columns):
        end = min(start + columns, vocab)
        logits = buffer if end - start == columns else torch.empty(hidden.shape[0], end - start, dtype=hidden.dtype,
                                                                    device=hidden.device)
        torch.mm(hidden, weight[start:end].t(), out=logits)
        chunk_forward(logits, labels, part_lse, part_target, vocab_start + start, ignore_index)
        torch.logaddexp(lse, part_lse, out=lse)
        target.add_(part_target)


def _add_hidden_grad(accumulator: torch.Tensor, grad_logits: torch.Tensor, weight: torch.Tensor) -> None:
    """``accumulator += grad_logits @ weight`` with fp32 accumulation."""
    if accumulator.dtype == grad_logits.dtype:
        accumulator.addmm_(grad_logits, weight)
    elif accumulator.is_cuda:
        accumulator.add_(torch.mm(grad_logits, weight, out_dtype=torch.float32))
    else:  # CPU has no mixed-dtype matmul
        accumulator.addmm_(grad_logits.float(), weight.float())


def backward_slices(grad_scale: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                    lse: torch.Tensor, vocab_start: int = 0, ignore_index: int = -100
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_hidden, grad_weight)`` of ``sum_rows scale * (lse - target)``, slice by slice; the
    grad_hidden of a vocabulary shard is this shard's partial sum."""
    vocab = weight.shape[0]
    columns = slice_columns(vocab, hidden.shape[1])
    grad_weight = torch.empty_like(weight)
    accumulator = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    buffer = torch.empty(hidden.shape[0], columns, dtype=hidden.dtype, device=hidden.device)
    for start in range(0, vocab, columns):
        end = min(start + columns, vocab)
        logits = buffer if end - start == columns else torch.empty(hidden.shape[0], end - start, dtype=hidden.dtype,
                                                                    device=hidden.device)
        part = weight[start:end]
        torch.mm(hidden, part.t(), out=logits)
        chunk_backward(logits, labels, lse, grad_scale, vocab_start + start, ignore_index)
        torch.mm(logits.t(), hidden, out=grad_weight[start:end])
        _add_hidden_grad(accumulator, logits, part)
    del buffer
    return (accumulator if hidden.dtype == torch.float32 else accumulator.to(hidden.dtype)), grad_weight


def _reduced(total: torch.Tensor, count: torch.Tensor, reduction: str) -> torch.Tensor:
    return total / count if reduction == "mean" else total


@torch.library.custom_op("mist::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                            reduction: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, lse): see the module docstring."""
    _check_args(hidden, weight, labels, reduction)
    lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    target = torch.empty_like(lse)
    forward_slices(hidden, weight, labels, lse, target, 0, ignore_index)
    valid = labels != ignore_index
    total = torch.where(valid, lse - target, torch.zeros((), device=lse.device)).sum()
    return _reduced(total, valid.sum(), reduction), lse


@linear_cross_entropy_op.register_fake
def _(hidden, weight, labels, ignore_index, reduction):
    _check_args(hidden, weight, labels, reduction)
    return hidden.new_empty((), dtype=torch.float32), hidden.new_empty((hidden.shape[0],), dtype=torch.float32)


@torch.library.custom_op("mist::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward_op(grad_loss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                                     labels: torch.Tensor, lse: torch.Tensor, ignore_index: int,
                                     reduction: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_hidden, grad_weight) of the loss: see the module docstring."""
    scale = grad_loss.float().reshape(1)
    if reduction == "mean":
        scale = scale / (labels != ignore_index).sum()
    return backward_slices(scale, hidden, weight, labels, lse, 0, ignore_index)


@linear_cross_entropy_backward_op.register_fake
def _(grad_loss, hidden, weight, labels, lse, ignore_index, reduction):
    return torch.empty_like(hidden), torch.empty_like(weight)


def _setup_context(ctx, inputs, output) -> None:
    hidden, weight, labels, ignore_index, reduction = inputs
    ctx.save_for_backward(hidden, weight, labels, output[1])
    ctx.ignore_index, ctx.reduction = ignore_index, reduction


def _backward(ctx, grad_loss, _grad_lse):
    hidden, weight, labels, lse = ctx.saved_tensors
    grad_hidden, grad_weight = linear_cross_entropy_backward_op(grad_loss, hidden, weight, labels, lse,
                                                                ctx.ignore_index, ctx.reduction)
    return grad_hidden, grad_weight, None, None, None


linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


@register_flop_formula(torch.ops.mist.linear_cross_entropy)
def _forward_flops(hidden_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * hidden_shape[0] * hidden_shape[1] * weight_shape[0]


@register_flop_formula(torch.ops.mist.linear_cross_entropy_backward)
def _backward_flops(grad_shape, hidden_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    return 6 * hidden_shape[0] * hidden_shape[1] * weight_shape[0]


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                         reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T, labels, ...)`` without the logits (fp32 scalar)."""
    return torch.ops.mist.linear_cross_entropy(hidden, weight, labels, ignore_index, reduction)[0]


def reference_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                   reduction: str = "mean") -> torch.Tensor:
    """The unfused computation the op replaces (for tests)."""
    logits = (hidden @ weight.t()).float()
    return torch.nn.functional.cross_entropy(logits, labels, ignore_index=ignore_index, reduction=reduction)


def flops(num_rows: int, vocab: int, hidden: int, phase: str) -> int:
    """Closed form of the registered FLOP formulas (forward 2NHV, backward 6NHV)."""
    return {"forward": 2, "backward": 6}[phase] * num_rows * hidden * vocab


__all__ = ["REDUCTIONS", "slice_columns", "flops", "linear_cross_entropy", "reference_loss", "workspace_points",
           "forward_slices", "backward_slices"]
