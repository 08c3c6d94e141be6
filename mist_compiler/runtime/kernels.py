"""The runtime's flat-buffer math: one Triton kernel (with its torch twin) and the AdamW update.

- ``scale_accumulate``: ``dst (+)= scale * float(src)`` over a whole flat gradient bucket: the
  "pack" step (cast the bucket's param-dtype gradients to the fp32 reduction/accumulation buffer,
  pre-scaled by 1/dp) in one pass; torch needs two (a cast copy, then a scale) when ``dst`` is not
  accumulated into. Gradients are views into their unit's flat bucket, so the gather of many
  tensors into one buffer is free and this is the remaining per-bucket pass. The kernel upcasts to
  fp32 inside (bf16 arithmetic is wrong under ``TRITON_INTERPRET=1``); it runs when the tensors are
  on a CUDA device and triton imports, or on CPU tensors when ``TRITON_INTERPRET=1`` was set before
  this module was first imported (tests). ``benchmarks/kernels.py`` times it against the torch
  twin on the device it targets.
- ``adamw``: one AdamW update of a flat fp32 shard (param, grad, exp_avg, exp_avg_sq) through
  torch's fused AdamW kernel (``torch.optim.AdamW(fused=True)``'s, on CPU and CUDA); a gradient in
  another dtype (low-precision gradients) is cast chunk by chunk by the plain-torch twin,
  ``adamw_torch``, whose temporaries stay at one chunk (the cost model counts them).

The earlier Triton ``pack``/``unpack``, ``cast_copy`` and AdamW kernels are gone: each replaced
one torch kernel (``copy_``, the fused AdamW) that it could not beat.
"""
from __future__ import annotations

import math
import os

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # triton missing or broken: torch fallbacks only
    HAVE_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK = 1024
# the torch AdamW twin updates this many elements at a time: its temporaries (the denominator,
# a cast gradient) stay at one chunk whatever the shard size (the cost model counts them)
ADAMW_TORCH_CHUNK = 1 << 20


def use_triton(tensor: torch.Tensor) -> bool:
    """Triton path for this tensor: CUDA with triton, or any tensor under the interpreter."""
    return HAVE_TRITON and (tensor.is_cuda or INTERPRET)


if HAVE_TRITON:

    @triton.jit
    def _scale_accumulate_kernel(dst_ptr, src_ptr, n, scale, ACCUMULATE: tl.constexpr, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        value = tl.load(src_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * scale
        if ACCUMULATE:
            value += tl.load(dst_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(dst_ptr + offsets, value.to(dst_ptr.dtype.element_ty), mask=mask)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, BLOCK),)


def _check_flat(name: str, *tensors: torch.Tensor) -> None:
    n = tensors[0].numel()
    for tensor in tensors:
        if not tensor.is_contiguous() or tensor.numel() != n:
            raise ValueError(f"kernels.{name}: tensors must be contiguous with {n} elements, "
                             f"got shape {tuple(tensor.shape)} (contiguous={tensor.is_contiguous()})")


def scale_accumulate(dst: torch.Tensor, src: torch.Tensor, scale: float, accumulate: bool) -> None:
    """``dst = scale * src`` or ``dst += scale * src`` (computed in fp32, stored in dst's dtype)."""
    _check_flat("scale_accumulate", dst, src)
    if dst.numel() == 0:
        return
    if use_triton(dst):
        _scale_accumulate_kernel[_grid(dst.numel())](dst, src, dst.numel(), float(scale), ACCUMULATE=accumulate, BLOCK=BLOCK)
        return
    scale_accumulate_torch(dst, src, scale, accumulate)


def scale_accumulate_torch(dst: torch.Tensor, src: torch.Tensor, scale: float, accumulate: bool) -> None:
    # no full-size temporary: mixed dtypes are cast element by element, an fp32 dst is scaled in place
    if accumulate:
        dst.add_(src, alpha=scale)
    elif scale == 1.0 or dst.dtype == torch.float32:
        dst.copy_(src)
        if scale != 1.0:
            dst.mul_(scale)
    else:
        dst.copy_(src.float() * scale)


def adamw_coefficients(step: int, lr: float, betas: tuple[float, float], weight_decay: float) -> dict[str, float]:
    """The step-dependent scalars of one AdamW update (as torch.optim.AdamW computes them)."""
    beta1, beta2 = betas
    bias_correction1 = 1.0 - beta1 ** step
    bias_correction2 = 1.0 - beta2 ** step
    return {
        "decay_factor": 1.0 - lr * weight_decay,
        "step_size": lr / bias_correction1,
        "bias_correction2_sqrt": math.sqrt(bias_correction2),
    }


def adamw(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
          step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """One AdamW update of flat fp32 tensors, in place (``step`` counts from 1): torch's fused kernel
    when the four tensors share a device and a dtype, else the chunked torch twin."""
    _check_flat("adamw", param, grad, exp_avg, exp_avg_sq)
    if param.numel() == 0:
        return
    if len({(t.device, t.dtype) for t in (param, grad, exp_avg, exp_avg_sq)}) == 1:
        steps = [torch.tensor(float(step), device=param.device)]
        torch._fused_adamw_([param], [grad], [exp_avg], [exp_avg_sq], [], steps, lr=lr, beta1=betas[0],
                            beta2=betas[1], weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
        return
    adamw_torch(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def adamw_torch(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """The plain-torch AdamW update on flat tensors (reference and fallback)."""
    coeffs = adamw_coefficients(step, lr, betas, weight_decay)
    for start in range(0, param.numel(), ADAMW_TORCH_CHUNK):  # bounds the temporaries at one chunk
        window = slice(start, start + ADAMW_TORCH_CHUNK)
        chunk, grad_chunk = param[window], grad[window].to(param.dtype)
        avg, avg_sq = exp_avg[window], exp_avg_sq[window]
        if weight_decay:
            chunk.mul_(coeffs["decay_factor"])
        avg.lerp_(grad_chunk, 1.0 - betas[0])
        avg_sq.mul_(betas[1]).addcmul_(grad_chunk, grad_chunk, value=1.0 - betas[1])
        denom = avg_sq.sqrt().div_(coeffs["bias_correction2_sqrt"]).add_(eps)
        chunk.addcdiv_(avg, denom, value=-coeffs["step_size"])
