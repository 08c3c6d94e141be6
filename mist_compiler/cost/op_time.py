"""Op-time model: roofline time of FLOPs and bytes per op class on a hardware profile.

Compute-bound classes (``matmul``, ``attention``) run at ``peak * efficiency[class]`` FLOP/s and
at least as long as their bytes take at the memory bandwidth; memory-bound classes
(``elementwise``, ``norm``, ``softmax``, ``embedding``, and ``fused``: a compiled kernel running a
chain of them in one memory pass, ``cost.compiled``) move their bytes at
``memory_bandwidth * efficiency[class]`` and take at least their FLOPs at peak. No op ever runs
faster than the profile's peak FLOP/s (efficiencies are at most 1): a prediction's MFU is at most 100%.
A ``pointwise:<op>`` class is the time a compiled kernel spends on that op's math beyond its memory
pass: its elements times the profile's ``compiled_pointwise_ns[op]`` (none: zero).
Efficiencies come from the profile's table (measured by ``mistc profile``); a class the
profile does not list falls back to its family (``norm``/``softmax`` -> ``reduction``,
``embedding``/``fused`` -> ``elementwise``) and then to ``default``. Everything is numpy-vectorised.

GEMMs are priced one by one where the profile has a ``matmul_shape_model`` (:func:`matmul_time`):
small and skinny GEMMs run well below the rate of a large square one, and each pays a fixed tail.
Compute-bound rates are scaled by the profile's ``sustained_compute`` (the clock a device holds under
training load, below the one short benchmarks run at).
"""
from __future__ import annotations

import numpy as np

from .hardware import HardwareProfile

COMPUTE_BOUND = ("matmul", "attention")
POINTWISE_PREFIX = "pointwise:"  # a compiled pointwise op's math beyond its region's memory pass (cost.compiled)
MEMORY_BOUND = ("elementwise", "norm", "softmax", "embedding", "fused")
FALLBACK = {"norm": "reduction", "softmax": "reduction", "embedding": "elementwise", "fused": "elementwise"}


def class_efficiency(profile: HardwareProfile, op_class: str) -> float:
    if op_class in profile.efficiency:
        return profile.efficiency[op_class]
    family = FALLBACK.get(op_class)
    if family is not None and family in profile.efficiency:
        return profile.efficiency[family]
    return profile.efficiency_of("default")


def peak_flops(profile: HardwareProfile, dtype: str) -> float:
    """Peak FLOP/s for a dtype; bfloat16/float16 share the tensor-core rate if one is missing."""
    if dtype in profile.peak_flops:
        return profile.peak_flops[dtype]
    for alias in ("float16", "bfloat16"):
        if dtype in ("float16", "bfloat16") and alias in profile.peak_flops:
            return profile.peak_flops[alias]
    raise ValueError(f"hardware profile {profile.name!r} has no peak_tflops for dtype {dtype!r}")


def op_class_time(profile: HardwareProfile, dtype: str, op_class: str, flops, nbytes) -> np.ndarray:
    """Seconds for ``flops`` and ``nbytes`` of one op class (arrays broadcast)."""
    if op_class == "view":
        return np.zeros(np.broadcast(np.asarray(flops), np.asarray(nbytes)).shape)
    if op_class.startswith(POINTWISE_PREFIX):  # elements in the place of bytes (cost.compiled)
        ns = profile.compiled_pointwise_ns.get(op_class[len(POINTWISE_PREFIX):], 0.0)
        return np.asarray(nbytes, dtype=float) * ns * 1e-9 + np.zeros(np.shape(flops))
    flops = np.asarray(flops, dtype=float)
    nbytes = np.asarray(nbytes, dtype=float)
    efficiency = class_efficiency(profile, op_class)
    peak = peak_flops(profile, dtype)
    if op_class in COMPUTE_BOUND:
        return np.maximum(flops / (peak * efficiency * profile.sustained_compute), nbytes / profile.memory_bandwidth)
    return np.maximum(flops / peak, nbytes / (profile.memory_bandwidth * efficiency))


ELEMENT_BYTES = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0}


def gemm_intensity(flops, nbytes, element_bytes: float) -> np.ndarray:
    """``MNK / (MK + KN + MN)`` of a GEMM from its FLOPs (2MNK) and bytes moved (elements x size)."""
    flops = np.asarray(flops, dtype=float)
    nbytes = np.asarray(nbytes, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(nbytes > 0, flops * element_bytes / (2.0 * nbytes), np.inf)


def matmul_time(profile: HardwareProfile, dtype: str, flops, nbytes) -> np.ndarray:
    """Seconds of one GEMM (arrays broadcast): by the profile's shape model, else the class efficiency."""
    model = profile.matmul_model
    if model is None:
        return op_class_time(profile, dtype, "matmul", flops, nbytes)
    flops = np.asarray(flops, dtype=float)
    nbytes = np.asarray(nbytes, dtype=float)
    intensity = gemm_intensity(flops, nbytes, ELEMENT_BYTES.get(dtype, 2.0))
    rate = peak_flops(profile, dtype) * profile.sustained_compute * np.where(
        np.isfinite(intensity), model.efficiency(intensity), model.peak_efficiency)
    with np.errstate(divide="ignore", invalid="ignore"):
        busy = np.maximum(np.where(flops > 0, flops / rate, 0.0), nbytes / profile.memory_bandwidth)
    return np.where(flops > 0, busy + model.tail_s, busy)
