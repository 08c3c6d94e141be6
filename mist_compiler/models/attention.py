"""Causal self-attention kernels: flash-attn where installed and it applies, else torch's SDPA.

``causal_attention(q, k, v)`` takes ``[batch, heads, seq, head_dim]`` queries and
``[batch, kv_heads, seq, head_dim]`` keys/values (grouped-query when ``kv_heads < heads``) and
returns ``[batch, heads, seq, head_dim]``.

flash-attn (``flash_attn.flash_attn_func``, Dao et al.) runs when it is importable, the tensors are
fp16/bf16 on a CUDA device, the head size is one it supports (a multiple of 8, at most 256) and
no graph is being captured. It reads keys/values of grouped-query attention without repeating
them. Otherwise ``F.scaled_dot_product_attention(is_causal=True)`` runs (on a GPU, torch picks its
own flash or memory-efficient kernel). Both save the same tensors for backward (q, k, v, the
output and the log-sum-exp), which is what the memory model assumes for its ``flash`` target
kernel, so the choice changes time, not predicted memory. Capture always sees SDPA (the IR and the
cost tables know its op names); :func:`attention_kernel` says which kernel a run uses, for reports.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    from flash_attn import __version__ as FLASH_ATTN_VERSION
    from flash_attn import flash_attn_func
except Exception:  # not installed (CPU machines, CI) or built for another torch
    flash_attn_func = None
    FLASH_ATTN_VERSION = None

FLASH_DTYPES = (torch.float16, torch.bfloat16)


def flash_attn_applies(q: torch.Tensor) -> bool:
    """flash-attn is installed and can run these tensors (see the module docstring)."""
    head_dim = q.shape[-1]
    return (flash_attn_func is not None and q.is_cuda and q.dtype in FLASH_DTYPES
            and head_dim % 8 == 0 and head_dim <= 256 and not torch.compiler.is_compiling())


def attention_kernel(q: torch.Tensor) -> str:
    """The kernel :func:`causal_attention` runs for tensors like ``q``."""
    if flash_attn_applies(q):
        return f"flash-attn {FLASH_ATTN_VERSION}"
    return "sdpa"


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    if flash_attn_applies(q):
        # flash-attn works on [batch, seq, heads, head_dim]; the transposes are views
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        return out.transpose(1, 2)
    repeats = q.shape[1] // k.shape[1]
    if repeats > 1:  # grouped-query attention: repeat key/value heads up to the query heads
        k = k.repeat_interleave(repeats, dim=1)
        v = v.repeat_interleave(repeats, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)
