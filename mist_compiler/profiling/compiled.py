"""Rates of compiled code and sustained compute, for ``mistc profile``.

* ``fused_bytes_per_s``: a transformer layer's elementwise chain (residual add, RMSNorm, SwiGLU)
  compiled by inductor, as the runtime compiles a unit: one kernel reading its inputs and writing its
  outputs once. Its bytes are counted as ``cost.compiled`` counts a fused region's (inputs once,
  stored outputs once), so the profile's ``efficiency['fused']`` is what the cost model needs. The
  same chain run eagerly is timed beside it for the log.
* ``pointwise_extra_ns``: per op of ``cost.compiled.COMPILED_POINTWISE_OPS`` (GELU, SiLU and their
  backwards, the runtime's hashed dropout), the time an inductor-compiled kernel of it takes beyond a
  compiled memory pass over the same bytes, per element: the profile's ``compiled_pointwise_ns`` (a
  CPU's vectorised erf and exp outlast the pass, and so does the dropout's 64-bit integer hash;
  inductor's erf ran at half the speed of eager's on the machine that wrote this).
* ``sustained_fraction``: the large-GEMM rate after ``seconds`` of back-to-back GEMMs against the rate
  of the first ones (a GPU at its power limit settles below the clock short benchmarks run at); the
  profile's ``sustained_compute``.
"""
from __future__ import annotations

import time
from typing import Callable


def _layer_chain(x, residual, gate, up, weight):
    """The elementwise work between a layer's GEMMs: residual add + RMSNorm, and SwiGLU."""
    import torch

    hidden = x + residual
    variance = hidden.float().pow(2).mean(-1, keepdim=True)
    normed = (hidden.float() * torch.rsqrt(variance + 1e-5)).to(x.dtype) * weight
    return hidden, normed, torch.nn.functional.silu(gate) * up


def fused_bytes_per_s(device: str, dtype_name: str, tokens: int, hidden: int, timer: Callable[[Callable], float],
                      log: Callable[[str], None]) -> float:
    """Bytes per second of the layer chain compiled by inductor (inputs read once, outputs written once)."""
    import torch

    dtype = getattr(torch, dtype_name)
    ffn = 3 * hidden
    x, residual = (torch.randn(tokens, hidden, device=device, dtype=dtype) for _ in range(2))
    gate, up = (torch.randn(tokens, ffn, device=device, dtype=dtype) for _ in range(2))
    weight = torch.ones(hidden, device=device, dtype=dtype)
    element = x.element_size()
    one_pass = element * tokens * (hidden * 4 + ffn * 3) + element * hidden  # x, r in; h, y out; gate, up in; out
    started = time.perf_counter()
    compiled = torch.compile(_layer_chain, backend="inductor", fullgraph=True, dynamic=False)
    compiled(x, residual, gate, up, weight)
    compile_s = time.perf_counter() - started
    fused = one_pass / timer(lambda: compiled(x, residual, gate, up, weight))
    eager = one_pass / timer(lambda: _layer_chain(x, residual, gate, up, weight))
    log(f"fused layer chain (residual add + RMSNorm + SwiGLU, {tokens}x{hidden}, {dtype_name}) compiled by inductor "
        f"in {compile_s:.0f} s: {fused / 1e9:.2f} GB/s of one memory pass (eager ops: {eager / 1e9:.2f})")
    return fused


def _pointwise_programs():
    """(op, compiled function, compiled memory pass over the same bytes) for every op the cost model
    prices beyond its pass (``cost.compiled.COMPILED_POINTWISE_OPS``); ``g`` is the incoming gradient."""
    import torch
    from torch.ops import aten

    from ..cost.compiled import COMPILED_POINTWISE_OPS

    def compiled(fn):
        return torch.compile(fn, backend="inductor", fullgraph=True, dynamic=False)

    from ..ops.dropout import counter_dropout, sample_seeds

    unary_pass, binary_pass = compiled(lambda x, g: x * 2.0), compiled(lambda x, g: x + g)
    seeds = sample_seeds(0, 0, torch.arange(1))  # one sample: the tensor's rows are its positions
    # the runtime's dropout mask: a hash of each element's place (drawn again in the backward)
    ops = {"gelu": (compiled(lambda x, g: aten.gelu(x)), unary_pass),
           "gelu_backward": (compiled(lambda x, g: aten.gelu_backward(g, x)), binary_pass),
           "silu": (compiled(lambda x, g: aten.silu(x)), unary_pass),
           "silu_backward": (compiled(lambda x, g: aten.silu_backward(g, x)), binary_pass),
           "native_dropout": (compiled(lambda x, g: counter_dropout(x, 0.1, seeds, 3, 1)), unary_pass)}
    return [(op, *ops[op]) for op in COMPILED_POINTWISE_OPS]


def pointwise_extra_ns(device: str, dtype_name: str, tokens: int, width: int, timer: Callable[[Callable], float],
                       log: Callable[[str], None]) -> dict[str, float]:
    """Nanoseconds per element each compiled op takes beyond a compiled memory pass of the same bytes."""
    import torch

    dtype = getattr(torch, dtype_name)
    x, g = (torch.randn(tokens, width, device=device, dtype=dtype) for _ in range(2))
    extra, times = {}, {}  # times: each program's, timed once (the memory passes are shared)
    for op, compiled, memory_pass in _pointwise_programs():
        for program in (compiled, memory_pass):
            if program not in times:
                program(x, g)  # compile outside the timing
                times[program] = timer(lambda: program(x, g))
        beyond = times[compiled] - times[memory_pass]
        extra[op] = round(max(0.0, beyond) / x.numel() * 1e9, 4)
    log(f"compiled pointwise math beyond a memory pass ({tokens}x{width}, {dtype_name}), ns per element: "
        + ", ".join(f"{op} {ns:.3f}" for op, ns in extra.items()))
    return extra


def sustained_fraction(device: str, dtype_name: str, size: int, seconds: float, sync: Callable[[], None],
                       log: Callable[[str], None]) -> float:
    """Large-GEMM rate over the last quarter of ``seconds`` of back-to-back GEMMs / the rate of the first
    ones (at most 1)."""
    import torch

    dtype = getattr(torch, dtype_name)
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    flops = 2 * size ** 3

    def burst(count: int) -> float:
        sync()
        start = time.perf_counter()
        for _ in range(count):
            a @ b
        sync()
        return count * flops / (time.perf_counter() - start)

    burst(2)
    per_call = flops / burst(4)
    count = max(1, int(0.1 / per_call))
    first = burst(count)
    ends_at = time.perf_counter() + seconds
    rates = []
    while time.perf_counter() < ends_at:
        rates.append(burst(count))
    held = rates[-max(1, len(rates) // 4):]
    fraction = min(1.0, (sum(held) / len(held)) / first) if rates else 1.0
    log(f"sustained GEMM rate after {seconds:.0f} s of {size}^3 {dtype_name} GEMMs: {fraction:.3f} of the first "
        f"{first / 1e12:.1f} TFLOP/s")
    return fraction
