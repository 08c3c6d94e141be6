"""Triton kernels for the per-stage runtime, each with a plain-torch twin used as fallback and reference.

- ``scale_accumulate``: ``dst (+)= scale * float(src)`` over a whole flat gradient bucket: the
  "pack" step (cast the bucket's param-dtype gradients to the fp32 reduction/accumulation buffer,
  pre-scaled by 1/dp) in one launch. Gradients are views into their unit's flat bucket, so the
  gather of many tensors into one buffer is free and the kernel is the remaining per-bucket pass.
- ``pack`` / ``unpack``: gather many tensors into one flat buffer (with a scale, e.g. 1/dp, and
  a cast to the buffer's dtype) and scatter a flat buffer back into many tensors, in ONE launch:
  a table of per-block (tensor, offset) entries plus the tensors' addresses drives the kernel. The
  runtime's own buckets do not need it (their tensors are views of the flat buffer); it serves
  tensors that are not bucket views (e.g. the engine's pipeline-send or cross-stage buffers).
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
# the torch AdamW fallback updates this many elements at a time: its temporaries (the denominator,
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


    @triton.jit
    def _pack_kernel(addresses_ptr, blocks_ptr, flat_ptr, scale, TENSOR_DTYPE: tl.constexpr, UNPACK: tl.constexpr,
                     BLOCK: tl.constexpr):
        # blocks: rows of (tensor index, element offset in that tensor, offset in the flat buffer, count)
        row = blocks_ptr + tl.program_id(0) * 4
        tensor_index = tl.load(row)
        tensor_offset = tl.load(row + 1)
        flat_offset = tl.load(row + 2)
        count = tl.load(row + 3)
        tensor_ptr = tl.load(addresses_ptr + tensor_index).to(tl.pointer_type(TENSOR_DTYPE))
        lanes = tl.arange(0, BLOCK)
        mask = lanes < count
        if UNPACK:
            value = tl.load(flat_ptr + flat_offset + lanes, mask=mask, other=0.0).to(tl.float32) * scale
            tl.store(tensor_ptr + tensor_offset + lanes, value.to(TENSOR_DTYPE), mask=mask)
        else:
            value = tl.load(tensor_ptr + tensor_offset + lanes, mask=mask, other=0.0).to(tl.float32) * scale
            tl.store(flat_ptr + flat_offset + lanes, value.to(flat_ptr.dtype.element_ty), mask=mask)


_TRITON_DTYPES = {}
if HAVE_TRITON:
    _TRITON_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
_BLOCK_TABLES: dict[tuple[int, ...], torch.Tensor] = {}


def _block_table(numels: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Per-launch-block rows (tensor, offset in tensor, offset in flat, count); cached per layout."""
    key = numels + (hash(str(device)),)
    if key not in _BLOCK_TABLES:
        rows, flat_offset = [], 0
        for index, numel in enumerate(numels):
            for start in range(0, numel, BLOCK):
                rows.append((index, start, flat_offset + start, min(BLOCK, numel - start)))
            flat_offset += numel
        _BLOCK_TABLES[key] = torch.tensor(rows or [(0, 0, 0, 0)], dtype=torch.int64, device=device)
    return _BLOCK_TABLES[key]


def _check_pack(name: str, tensors: list[torch.Tensor], flat: torch.Tensor) -> int:
    total = sum(t.numel() for t in tensors)
    if not flat.is_contiguous() or flat.dim() != 1 or flat.numel() < total:
        raise ValueError(f"kernels.{name}: flat buffer must be 1-D contiguous with >= {total} elements, "
                         f"got shape {tuple(flat.shape)}")
    for index, tensor in enumerate(tensors):
        if not tensor.is_contiguous() or tensor.device != flat.device or tensor.dtype != tensors[0].dtype:
            raise ValueError(f"kernels.{name}: tensors[{index}] must be contiguous, on {flat.device} and of "
                             f"dtype {tensors[0].dtype}")
    return total


def _multi_tensor_launch(tensors: list[torch.Tensor], flat: torch.Tensor, scale: float, unpack: bool) -> None:
    table = _block_table(tuple(t.numel() for t in tensors), flat.device)
    addresses = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=flat.device)
    _pack_kernel[(table.shape[0],)](addresses, table, flat, float(scale), TENSOR_DTYPE=_TRITON_DTYPES[tensors[0].dtype],
                                    UNPACK=unpack, BLOCK=BLOCK)


def pack(tensors: list[torch.Tensor], flat: torch.Tensor, scale: float = 1.0) -> None:
    """``flat[:total] = scale * cat(tensors)`` (fp32 math, cast to flat's dtype), one launch."""
    if not tensors or _check_pack("pack", tensors, flat) == 0:
        return
    if use_triton(flat) and tensors[0].dtype in _TRITON_DTYPES:
        _multi_tensor_launch(tensors, flat, scale, unpack=False)
        return
    total = sum(t.numel() for t in tensors)
    torch.cat([t.reshape(-1).to(flat.dtype) for t in tensors], out=flat[:total])
    if scale != 1.0:
        flat[:total].mul_(scale)


def unpack(flat: torch.Tensor, tensors: list[torch.Tensor], scale: float = 1.0) -> None:
    """``tensors[i] = scale * flat[offset_i : offset_i + numel_i]`` for consecutive offsets, one launch."""
    if not tensors or _check_pack("unpack", tensors, flat) == 0:
        return
    if use_triton(flat) and tensors[0].dtype in _TRITON_DTYPES:
        _multi_tensor_launch(tensors, flat, scale, unpack=True)
        return
    pieces = torch.split(flat[:sum(t.numel() for t in tensors)], [t.numel() for t in tensors])
    sources = [piece.view(t.shape) for piece, t in zip(pieces, tensors)]
    if scale != 1.0:
        sources = torch._foreach_mul(sources, scale)
    torch._foreach_copy_(tensors, sources)


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
    # no full-size temporary: mixed dtypes are cast element by element, an fp32 dst is scaled in place
    if accumulate:
        dst.add_(src, alpha=scale)
    elif scale == 1.0 or dst.dtype == torch.float32:
        dst.copy_(src)
        if scale != 1.0:
            dst.mul_(scale)
    else:
        dst.copy_(src.float() * scale)


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
