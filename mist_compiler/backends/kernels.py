"""Triton kernels for the per-stage runtime, each with a plain-torch twin used as fallback and reference.

- ``scale_accumulate``: ``dst (+)= scale * float(src)`` over a whole flat gradient bucket: the
  "pack" step (cast the bucket's param-dtype gradients to the fp32 reduction/accumulation buffer,
  pre-scaled by 1/dp) in one launch. Gradients are views into their unit's flat bucket, so the
  gather of many tensors into one buffer is free and the kernel is the remaining per-bucket pass.
- ``cast_copy``: ``dst = src.to(dst.dtype)``, the "unpack" of fp32 master shards into the
  param-dtype weight bucket after the optimizer step.
- ``adamw``: one fused AdamW update of a flat fp32 shard (param, grad, exp_avg, exp_avg_sq), with
  the step-dependent bias corrections passed as scalars. Same math as ``torch.optim.AdamW``.

Kernels upcast to fp32 inside (bf16 arithmetic is wrong under ``TRITON_INTERPRET=1``). They run when
the tensors are on a CUDA device and triton imports (``use_triton``), or on CPU tensors when
``TRITON_INTERPRET=1`` was set before this module was first imported (tests); otherwise the torch
versions run, which are flat tensor ops as well (no per-parameter Python work either way).
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

    @triton.jit
    def _cast_copy_kernel(dst_ptr, src_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        value = tl.load(src_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(dst_ptr + offsets, value.to(dst_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _adamw_kernel(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, n, decay_factor, beta1, beta2,
                      step_size, inv_bias_correction2_sqrt, eps, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        param = tl.load(param_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask, other=0.0)
        exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask, other=0.0)
        param = param * decay_factor
        exp_avg = exp_avg + (1.0 - beta1) * (grad - exp_avg)
        exp_avg_sq = exp_avg_sq * beta2 + (1.0 - beta2) * grad * grad
        denom = tl.sqrt(exp_avg_sq) * inv_bias_correction2_sqrt + eps
        param = param - step_size * (exp_avg / denom)
        tl.store(param_ptr + offsets, param, mask=mask)
        tl.store(exp_avg_ptr + offsets, exp_avg, mask=mask)
        tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=mask)


def _grid(n: int) -> tuple[int]:
    return (max(1, triton.cdiv(n, BLOCK)),)


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
    if accumulate:
        dst.add_(src.to(dst.dtype), alpha=scale) if dst.dtype != src.dtype else dst.add_(src, alpha=scale)
    elif scale == 1.0:
        dst.copy_(src)
    else:
        torch.mul(src.to(torch.float32), scale, out=dst) if dst.dtype == torch.float32 else dst.copy_(src.float() * scale)


def cast_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` with a dtype cast (fp32 master -> param dtype)."""
    _check_flat("cast_copy", dst, src)
    if dst.numel() == 0:
        return
    if use_triton(dst) and dst.device == src.device:
        _cast_copy_kernel[_grid(dst.numel())](dst, src, dst.numel(), BLOCK=BLOCK)
        return
    dst.copy_(src)


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
    """One AdamW update of flat fp32 tensors, in place (``step`` counts from 1)."""
    _check_flat("adamw", param, grad, exp_avg, exp_avg_sq)
    if param.numel() == 0:
        return
    coeffs = adamw_coefficients(step, lr, betas, weight_decay)
    if use_triton(param) and len({t.device for t in (param, grad, exp_avg, exp_avg_sq)}) == 1:
        _adamw_kernel[_grid(param.numel())](
            param, grad, exp_avg, exp_avg_sq, param.numel(), coeffs["decay_factor"], betas[0], betas[1],
            coeffs["step_size"], 1.0 / coeffs["bias_correction2_sqrt"], eps, BLOCK=BLOCK,
        )
        return
    adamw_torch(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def adamw_torch(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """The plain-torch AdamW update on flat tensors (reference and fallback)."""
    coeffs = adamw_coefficients(step, lr, betas, weight_decay)
    grad = grad.to(param.dtype)
    if weight_decay:
        param.mul_(coeffs["decay_factor"])
    exp_avg.lerp_(grad, 1.0 - betas[0])
    exp_avg_sq.mul_(betas[1]).addcmul_(grad, grad, value=1.0 - betas[1])
    denom = (exp_avg_sq.sqrt() / coeffs["bias_correction2_sqrt"]).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-coeffs["step_size"])
