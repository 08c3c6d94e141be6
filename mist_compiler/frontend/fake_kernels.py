"""Eager forwards under fake tensors that torch's meta kernels would refuse for no reason of shape.

Capture runs the model eagerly on FakeTensors twice (the output check and the layer-chain proof).
Some meta kernels copy the dtype rules of one CUDA backend although the op runs elsewhere in other
dtypes: ``aten._grouped_mm`` (mixture-of-experts layers of Hugging Face models call it through
``F.grouped_mm`` when not compiling) accepts only bfloat16 in its meta kernel, while the CPU kernel
takes float32 and float16 too, and under ``torch.compile`` transformers routes other dtypes to its
own fallback op. :func:`eager_fake` enters the capture's fake mode with a dispatch mode that gives
such ops their output shapes from the bfloat16 meta rule, in the caller's dtype: nothing outside
the ``with`` block changes, and the traced program (dynamo's) is not affected.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_BF16_ONLY_META = {aten._grouped_mm.default}


class _ShapeInBfloat16(TorchDispatchMode):
    """Runs the ops of ``_BF16_ONLY_META`` on bfloat16 copies of their inputs (shapes only: fake
    tensors) and casts the result back to the inputs' dtype."""

    supports_higher_order_operators = True  # they pass through unchanged

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _BF16_ONLY_META:
            return func(*args, **kwargs)
        dtypes = {a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()}
        if dtypes <= {torch.bfloat16}:
            return func(*args, **kwargs)
        cast = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
        out_dtype = kwargs.get("out_dtype") or next(iter(dtypes))
        kwargs = {k: v for k, v in kwargs.items() if k != "out_dtype"}
        return func(*cast, **kwargs).to(out_dtype)


@contextlib.contextmanager
def eager_fake(fake_mode: FakeTensorMode) -> Iterator[None]:
    """``with fake_mode`` for an eager forward of the captured model (see the module docstring)."""
    with fake_mode, _ShapeInBfloat16():
        yield


__all__ = ["eager_fake"]
