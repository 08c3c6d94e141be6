"""The words every part of the compiler shares, defined once.

Training dtypes (names, their torch types, the default), the symbols shapes are written in (``b`` micro-batch,
``s`` sequence, ``t`` tensor-parallel degree), the target attention kernels and the kinds of state
that can be offloaded. Every sub-package imports them from here.
"""
from __future__ import annotations

import sympy
import torch

TRAINING_DTYPES = ("float32", "float16", "bfloat16")
DEFAULT_DTYPE = "bfloat16"  # what a plan trains in unless the user says otherwise (every entry point)
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
    "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1,
}

B = sympy.Symbol("b", positive=True, integer=True)  # micro-batch size
S = sympy.Symbol("s", positive=True, integer=True)  # sequence length
T = sympy.Symbol("t", positive=True, integer=True)  # tensor-parallel degree
SYMBOLS: dict[str, sympy.Symbol] = {"b": B, "s": S, "t": T}

ATTENTION_KERNELS = ("flash", "math")  # flash keeps the log-sum-exp; math keeps the s x s probabilities
OFFLOAD_KINDS = ("weights", "grads", "opt", "acts")
# whether a plan's units run (and are priced) as inductor-compiled code unless it says otherwise
# (lowering.compile); a plan's "compiled": false runs and prices them op by op
COMPILED_DEFAULT = True


def torch_dtype(name: str) -> torch.dtype:
    if name not in TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {list(TRAINING_DTYPES)}, got {name!r}")
    return TORCH_DTYPES[name]
