"""``mist::linear_cross_entropy``: the LM head's matmul fused with the cross-entropy loss, chunked.

``linear_cross_entropy(hidden [N, H], weight [V, H], labels [N], ignore_index, reduction)`` is
``F.cross_entropy(hidden @ weight.T, labels, ignore_index=, reduction=)`` computed ``rows`` rows at
a time (:func:`chunk_rows`): a chunk's logits ``[rows, V]`` are about as many elements as the
hidden input ``[N, H]``, so nothing of size ``N x V`` (fp32 or not) ever exists.

- forward (``mist::linear_cross_entropy``, returns ``(loss, lse)``): per chunk, logits in the
  compute dtype, then the per-row fp32 log-sum-exp and target logit (``chunk_kernels``); the loss
  is fp32. ``lse [N]`` (fp32) is a second output so that autograd saves it: the op saves
  ``hidden``, ``weight``, ``labels`` and ``lse``, nothing else;
- backward (``mist::linear_cross_entropy_backward``): per chunk, the logits again (recompute),
  turned in place into ``(softmax - onehot) * grad / count``, then ``grad_hidden[rows]`` (written
  directly) and ``grad_weight`` accumulated over chunks in fp32 (a ``[V, H]`` fp32 accumulator for
  fp16/bf16 weights; fp32 weights accumulate into their gradient directly);
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


def chunk_rows(num_rows: int, vocab: int, hidden: int) -> int:
    """Rows per chunk: ``ceil(N * H / V)`` (at least 1, at most N), so that a chunk's logits
    ``[rows, V]`` hold about ``N * H`` elements: the transient is bounded by the size of the input."""
    if num_rows <= 0:
        return 1
    return max(1, min(num_rows, -(-num_rows * hidden // max(vocab, 1))))


def workspace_points(num_rows, vocab, hidden, dtype_bytes: int, weight_bytes: int, phase: str) -> list:
    """Bytes the op holds at each of its internal peak points besides its inputs and its outputs
    (outputs counted as allocated from the op's start; a point below them is a negative term).
    Plain arithmetic: ints or sympy expressions. ``vocab``: this rank's vocabulary; ``dtype_bytes``:
    the compute (hidden) dtype's size; ``weight_bytes``: the weight's.

    - forward: one chunk of logits (``~N*H`` elements, :func:`chunk_rows`) and the fp32 per-row
      target logits;
    - backward, fp32 weight: one chunk of logits (turned into its gradient in place); the weight
      gradient (an output) is accumulated in place;
    - backward, fp16/bf16 weight: (1) in the loop: the fp32 ``[V, H]`` accumulator, the chunk and
      one fp32 product of ``~N*H`` elements added into the accumulator (``mm(out_dtype=float32)``
      over a slice of the vocabulary), while the weight gradient output does not exist yet;
      (2) at the end: the accumulator while it is cast into the output.
    The chunk is modelled as ``N*H`` elements (the rounding of ``chunk_rows`` adds at most one row
    of ``V``). On CPU the fp16/bf16 path upcasts operands instead (no mixed-dtype matmul there):
    the model describes the GPU kernels for those dtypes; fp32 is the same everywhere."""
    chunk = num_rows * hidden * dtype_bytes
    if phase == "forward":
        return [chunk + num_rows * FP32_BYTES]
    if phase != "backward":
        raise ValueError(f"workspace_points: phase must be 'forward' or 'backward', got {phase!r}")
    if weight_bytes >= FP32_BYTES:
        return [chunk]
    accumulator = vocab * hidden * FP32_BYTES
    return [accumulator + chunk + num_rows * hidden * FP32_BYTES - vocab * hidden * weight_bytes, accumulator]


def _check_args(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, reduction: str) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or labels.dim() != 1:
        raise ValueError(f"linear_cross_entropy: expected hidden [N, H], weight [V, H], labels [N]; got "
                         f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(labels.shape)}")
    if hidden.shape[1] != weight.shape[1] or hidden.shape[0] != labels.shape[0]:
        raise ValueError(f"linear_cross_entropy: shapes disagree: hidden {tuple(hidden.shape)}, weight "
                         f"{tuple(weight.shape)}, labels {tuple(labels.shape)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"linear_cross_entropy: reduction must be one of {REDUCTIONS}, got {reduction!r}")


def forward_rows(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                 target: torch.Tensor, vocab_start: int = 0, ignore_index: int = -100) -> None:
    """Per-row log-sum-exp over ``weight``'s vocabulary and the label's logit (0 outside it), chunk by chunk."""
    rows = chunk_rows(hidden.shape[0], weight.shape[0], hidden.shape[1])
    buffer = torch.empty(min(rows, hidden.shape[0]), weight.shape[0], dtype=hidden.dtype, device=hidden.device)
    for start in range(0, hidden.shape[0], rows):
        end = min(start + rows, hidden.shape[0])
        logits = buffer[:end - start]
        torch.mm(hidden[start:end], weight.t(), out=logits)
        chunk_forward(logits, labels[start:end], lse[start:end], target[start:end], vocab_start, ignore_index)


def _add_weight_grad(accumulator: torch.Tensor, grad_logits: torch.Tensor, hidden: torch.Tensor) -> None:
    """``accumulator += grad_logits.T @ hidden`` with fp32 accumulation, ``~rows*V`` elements at a time."""
    if accumulator.dtype == grad_logits.dtype:
        accumulator.addmm_(grad_logits.t(), hidden)
        return
    vocab, width = accumulator.shape
    step = max(1, grad_logits.numel() // max(width, 1))  # slice of the vocabulary: a product of ~one chunk
    for start in range(0, vocab, step):
        end = min(start + step, vocab)
        part = grad_logits[:, start:end]
        if accumulator.is_cuda:
            accumulator[start:end].add_(torch.mm(part.t(), hidden, out_dtype=torch.float32))
        else:  # CPU has no mixed-dtype matmul
            accumulator[start:end].addmm_(part.t().float(), hidden.float())


def backward_rows(grad_scale: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                  lse: torch.Tensor, vocab_start: int = 0, ignore_index: int = -100
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_hidden, grad_weight)`` of ``sum_rows scale * (lse - target)``, chunk by chunk; the
    grad_hidden of a vocabulary shard is this shard's partial sum."""
    rows = chunk_rows(hidden.shape[0], weight.shape[0], hidden.shape[1])
    grad_hidden = torch.empty_like(hidden)
    fp32_weight = weight.dtype == torch.float32
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    buffer = torch.empty(min(rows, hidden.shape[0]), weight.shape[0], dtype=hidden.dtype, device=hidden.device)
    for start in range(0, hidden.shape[0], rows):
        end = min(start + rows, hidden.shape[0])
        logits = buffer[:end - start]
        torch.mm(hidden[start:end], weight.t(), out=logits)
        chunk_backward(logits, labels[start:end], lse[start:end], grad_scale, vocab_start, ignore_index)
        torch.mm(logits, weight, out=grad_hidden[start:end])
        _add_weight_grad(grad_weight, logits, hidden[start:end])
    del buffer
    return grad_hidden, grad_weight if fp32_weight else grad_weight.to(weight.dtype)


def _reduced(total: torch.Tensor, count: torch.Tensor, reduction: str) -> torch.Tensor:
    return total / count if reduction == "mean" else total


@torch.library.custom_op("mist::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                            reduction: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, lse): see the module docstring."""
    _check_args(hidden, weight, labels, reduction)
    lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    target = torch.empty_like(lse)
    forward_rows(hidden, weight, labels, lse, target, 0, ignore_index)
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
    return backward_rows(scale, hidden, weight, labels, lse, 0, ignore_index)


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


__all__ = ["REDUCTIONS", "chunk_rows", "flops", "linear_cross_entropy", "reference_loss", "workspace_points",
           "forward_rows", "backward_rows"]
