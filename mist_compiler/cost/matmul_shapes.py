"""GEMM rates by shape: the shapes ``mistc profile`` times and the fit of a profile's ``matmul_shape_model``.

The model (``cost.hardware``): an M x N x K GEMM with intensity ``I = MNK / (MK + KN + MN)`` takes
``max(2MNK / (peak * e * I / (I + h)), bytes / bandwidth) + tail``. The shapes cover what
transformer training runs: large square GEMMs, the token x hidden x hidden projections, skinny ones
(tensor-parallel shards, grouped-query key/value heads) and small ones; :func:`fit_shape_model`
finds (e, h, tail) minimising the squared log error of the predicted times.
"""
from __future__ import annotations

import itertools
from typing import Callable

import numpy as np

from .hardware import MatmulShapeModel

GPU_SHAPES = [(8192, 8192, 8192), (4096, 4096, 4096), (2048, 2048, 2048), (1024, 1024, 1024), (512, 512, 512),
              (16384, 4096, 4096), (8192, 14336, 4096), (8192, 4096, 14336), (8192, 1024, 8192), (8192, 256, 8192),
              (8192, 128, 16384), (2048, 8192, 1024), (256, 4096, 4096)]
CPU_SHAPES = [(1024, 1024, 1024), (512, 512, 512), (256, 256, 256), (128, 128, 128), (2048, 512, 512),
              (1024, 64, 1024), (1024, 1024, 64), (64, 1024, 1024)]
CPU_QUICK_SHAPES = [(512, 512, 512), (256, 256, 256), (128, 128, 128), (512, 64, 512)]


def shapes_for(device: str, quick: bool) -> list[tuple[int, int, int]]:
    if device == "cuda":
        return GPU_SHAPES[:6] if quick else GPU_SHAPES
    return CPU_QUICK_SHAPES if quick else CPU_SHAPES


def measure_shapes(device: str, dtype_name: str, peak: float, timer: Callable[[Callable[[], object]], float],
                   shapes: list[tuple[int, int, int]], log: Callable[[str], None]) -> list[tuple[int, int, int, float]]:
    """(m, n, k, achieved fraction of ``peak``) for each shape, timed by ``timer`` (seconds per call)."""
    import torch

    dtype = getattr(torch, dtype_name)
    points = []
    for m, n, k in shapes:
        operands = _operand_sets(m, n, k, device, dtype)
        turn = itertools.count()
        seconds = timer(lambda: _multiply(operands, next(turn)))
        efficiency = 2.0 * m * n * k / seconds / peak
        points.append((m, n, k, round(float(efficiency), 4)))
        log(f"matmul {dtype_name} {m}x{n}x{k}: {2.0 * m * n * k / seconds / 1e9:.1f} GFLOP/s ({efficiency:.1%} of peak)")
    return points


OPERAND_BYTES = 128 << 20  # operands cycled through per shape: more than a CPU's L2 or a GPU's L2 holds


def _operand_sets(m: int, n: int, k: int, device: str, dtype) -> list:
    """Enough distinct ``(a, b)`` pairs that each GEMM reads its operands from memory, as a model's
    GEMMs do (they read activations the previous kernel wrote and weights not touched since the last
    step); one pair timed again and again runs from cache, 3-10% faster on this CPU for a layer's shapes."""
    import torch

    size = torch.tensor([], dtype=dtype).element_size() * (m * k + k * n)
    count = max(2, min(64, OPERAND_BYTES // max(size, 1)))
    return [(torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype))
            for _ in range(count)]


def _multiply(operands: list, turn: int):
    a, b = operands[turn % len(operands)]
    return a @ b


def predicted_seconds(model: MatmulShapeModel, m, n, k, peak: float, bandwidth: float,
                      element_bytes: float) -> np.ndarray:
    """The model's time for M x N x K GEMMs (arrays broadcast): the closed form the cost model uses."""
    m, n, k = (np.asarray(x, dtype=float) for x in (m, n, k))
    flops = 2.0 * m * n * k
    nbytes = element_bytes * (m * k + k * n + m * n)
    intensity = m * n * k / (m * k + k * n + m * n)
    return np.maximum(flops / (peak * model.efficiency(intensity)), nbytes / bandwidth) + model.tail_s


def fit_shape_model(points: list[tuple[int, int, int, float]], peak: float, bandwidth: float,
                    element_bytes: float) -> MatmulShapeModel:
    """The (peak_efficiency, half_intensity, tail_s) that best reproduce the measured GEMM times (grid search,
    squared error of log time)."""
    if not points:
        raise ValueError("matmul shapes: no measured GEMM to fit")
    data = np.array(points, dtype=float)
    m, n, k, efficiency = data[:, 0], data[:, 1], data[:, 2], data[:, 3]
    measured = 2.0 * m * n * k / (efficiency * peak)
    intensity = m * n * k / (m * k + k * n + m * n)
    memory = element_bytes * (m * k + k * n + m * n) / bandwidth
    top = float(min(1.0, max(efficiency.max() * 1.3, 1e-3)))
    peaks = np.linspace(top / 60, top, 60)[:, None, None, None]
    halves = np.concatenate([[0.0], np.geomspace(1.0, 4000.0, 40)])[None, :, None, None]
    tails = np.concatenate([[0.0], np.geomspace(measured.min() * 1e-3, measured.min(), 30)])[None, None, :, None]
    rate = peak * peaks * intensity / (intensity + halves)
    predicted = np.maximum(2.0 * m * n * k / rate, memory) + tails
    error = (np.log(predicted) - np.log(measured)) ** 2
    best = np.unravel_index(np.argmin(error.sum(axis=3)), error.shape[:3])
    return MatmulShapeModel(round(float(peaks.ravel()[best[0]]), 4), round(float(halves.ravel()[best[1]]), 2),
                            float(f"{float(tails.ravel()[best[2]]):.3g}"))
