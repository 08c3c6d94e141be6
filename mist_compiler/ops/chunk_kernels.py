"""Per-chunk cross-entropy math of the fused LM-head loss: Triton kernels and their torch twins.

A *chunk* is ``logits [C, V]`` (``C`` rows of the micro-batch, ``V`` this rank's vocabulary,
columns ``vocab_start .. vocab_start + V`` of the full vocabulary) in the compute dtype; the
caller owns it and reuses it for the next chunk. Two steps, one program per row:

- ``chunk_forward``: the row's log-sum-exp over its ``V`` logits (one pass, online max) and the
  logit of its label when the label falls in this rank's vocabulary range (else 0); both fp32;
- ``chunk_backward``: in place, ``logits <- (exp(logits - lse) - onehot(label)) * scale`` with
  ``scale`` a 1-element fp32 tensor (the incoming gradient over the token count; no host sync),
  rows whose label is ``ignore_index`` get zeros.

Arithmetic is fp32 whatever the chunk's dtype (kernels upcast on load: bf16 math is wrong under
``TRITON_INTERPRET=1``, and fp16/bf16 sums of exponentials lose digits). The torch twins work in
place on the chunk too, so in fp32 they keep no chunk-sized temporary either; with a fp16/bf16
chunk they need one fp32 copy (the Triton kernels do not). Triton runs when the chunk is on a
CUDA device and triton imports, or on any tensor when ``TRITON_INTERPRET=1`` was set before this
module was first imported (tests); otherwise the torch twins run.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # triton missing or broken: torch twins only
    HAVE_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK = 1024  # vocabulary columns per step of a row's loop


def use_triton(tensor: torch.Tensor) -> bool:
    return HAVE_TRITON and (tensor.is_cuda or INTERPRET)


if HAVE_TRITON:

    @triton.jit
    def _forward_kernel(logits_ptr, stride, labels_ptr, lse_ptr, target_ptr, vocab, vocab_start, ignore_index,
                        BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        label = tl.load(labels_ptr + row)
        running_max = float("-inf")
        running_sum = 0.0
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(running_max, tl.max(x, 0))
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), 0)
            running_max = new_max
        tl.store(lse_ptr + row, running_max + tl.log(running_sum))
        local = label - vocab_start
        inside = (label != ignore_index) & (local >= 0) & (local < vocab)
        target = tl.load(base + tl.where(inside, local, 0)).to(tl.float32)
        tl.store(target_ptr + row, tl.where(inside, target, 0.0))

    @triton.jit
    def _backward_kernel(logits_ptr, stride, labels_ptr, lse_ptr, scale_ptr, vocab, vocab_start, ignore_index,
                         BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        label = tl.load(labels_ptr + row)
        lse = tl.load(lse_ptr + row)
        scale = tl.where(label == ignore_index, 0.0, tl.load(scale_ptr))
        local = label - vocab_start
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < vocab
            x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            grad = (tl.exp(x - lse) - tl.where(cols == local, 1.0, 0.0)) * scale
            tl.store(base + cols, grad.to(logits_ptr.dtype.element_ty), mask=mask)


def _check(name: str, logits: torch.Tensor, labels: torch.Tensor, *rows: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"chunk_kernels.{name}: logits must be 2-D with contiguous rows, got shape "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    for tensor in (labels, *rows):
        if tensor.dim() != 1 or tensor.shape[0] != logits.shape[0] or not tensor.is_contiguous():
            raise ValueError(f"chunk_kernels.{name}: per-row tensors must be 1-D contiguous with {logits.shape[0]} "
                             f"elements, got shape {tuple(tensor.shape)}")


def chunk_forward(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, target: torch.Tensor,
                  vocab_start: int = 0, ignore_index: int = -100) -> None:
    """Write each row's fp32 log-sum-exp into ``lse`` and its label's logit (0 when the label is
    ignored or outside ``[vocab_start, vocab_start + V)``) into ``target``. Reads ``logits`` only
    on the Triton path; the torch twin overwrites it (the caller recomputes chunks anyway)."""
    _check("chunk_forward", logits, labels, lse, target)
    if logits.shape[0] == 0:
        return
    if use_triton(logits):
        _forward_kernel[(logits.shape[0],)](logits, logits.stride(0), labels, lse, target, logits.shape[1],
                                            vocab_start, ignore_index, BLOCK=BLOCK)
        return
    chunk_forward_torch(logits, labels, lse, target, vocab_start, ignore_index)


def _local_labels(labels: torch.Tensor, vocab: int, vocab_start: int, ignore_index: int):
    local = labels - vocab_start
    inside = (labels != ignore_index) & (local >= 0) & (local < vocab)
    return local.where(inside, torch.zeros_like(local)).unsqueeze(1), inside


def chunk_forward_torch(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, target: torch.Tensor,
                        vocab_start: int = 0, ignore_index: int = -100) -> None:
    """The torch twin of the forward kernel (exponentiates the chunk in place)."""
    x = logits if logits.dtype == torch.float32 else logits.float()
    local, inside = _local_labels(labels, x.shape[1], vocab_start, ignore_index)
    torch.where(inside, x.gather(1, local).squeeze(1), torch.zeros((), dtype=x.dtype, device=x.device), out=target)
    row_max = x.amax(dim=1, keepdim=True)
    x.sub_(row_max).exp_()
    torch.log(x.sum(dim=1), out=lse)
    lse.add_(row_max.squeeze(1))


def chunk_backward(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor,
                   vocab_start: int = 0, ignore_index: int = -100) -> None:
    """In place: ``logits <- (softmax(logits) - onehot(label)) * scale`` per row (softmax from the
    saved ``lse``; zeros for ignored rows). ``scale``: 1-element fp32 tensor."""
    _check("chunk_backward", logits, labels, lse)
    if logits.shape[0] == 0:
        return
    if use_triton(logits):
        _backward_kernel[(logits.shape[0],)](logits, logits.stride(0), labels, lse, scale, logits.shape[1],
                                             vocab_start, ignore_index, BLOCK=BLOCK)
        return
    chunk_backward_torch(logits, labels, lse, scale, vocab_start, ignore_index)


def chunk_backward_torch(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor,
                         vocab_start: int = 0, ignore_index: int = -100) -> None:
    """The torch twin of the backward kernel."""
    x = logits if logits.dtype == torch.float32 else logits.float()
    local, inside = _local_labels(labels, x.shape[1], vocab_start, ignore_index)
    x.sub_(lse.unsqueeze(1)).exp_()
    x.scatter_add_(1, local, -inside.to(x.dtype).unsqueeze(1))
    row_scale = torch.where(labels != ignore_index, scale.to(x.dtype), torch.zeros((), dtype=x.dtype, device=x.device))
    x.mul_(row_scale.unsqueeze(1))
    if x is not logits:
        logits.copy_(x)
