"""Measure the machine this runs on into a hardware profile (the engine of ``mistc profile``).

What is measured, on one "device" (a GPU, or on CPU one rank = one core, ``torch`` limited to one
thread as the CPU backend runs its ranks):

* compute: matmul throughput per dtype (fp32 and bf16 on CPU, bf16/fp16/fp32 on GPU), GEMM rates
  over a table of shapes in the main dtype (fitted to the profile's ``matmul_shape_model``), attention
  (``scaled_dot_product_attention`` forward+backward), elementwise add, row reduction, and the
  device-memory copy rate; a layer's elementwise chain compiled by inductor (``efficiency['fused']``,
  what compiled units achieve) and, on a GPU, the GEMM rate held under sustained load
  (``sustained_compute``), both in ``profiling.compiled``;
* host<->device copies (pinned, on GPU; on CPU a host-to-host copy stands in and the profile says so);
* every collective over every local group size available (2 and 4 ranks where cores/GPUs allow;
  gloo on CPU, NCCL on GPU), fitted to alpha-beta from a few message sizes; point-to-point;
* concurrency slowdowns: each ordered pair of channels (compute, collective, h2d, d2h) run
  together on threads (their own CUDA streams on GPU), the foreground channel timed against
  itself alone; the collective is an all-reduce of the sweep's largest message.

Multi-node shapes need ranks on several machines and are not measured; ``cost.comm`` derives them.
All distributed work runs in spawned processes with timeouts; nothing is left running.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from mist_compiler.cost import matmul_shapes
from mist_compiler.cost.hardware import HardwareProfile, ProfileError, load_profile
from mist_compiler.cost.op_time import ELEMENT_BYTES

from .comm import (
    _collective_worker,
    fit_collectives,
    measure_slowdowns,
    reduce_scatter_input_copies,
    run_collective_group,
    time_group_collectives,
)
from .compiled import fused_bytes_per_s, pointwise_extra_ns, sustained_fraction
from .state_rates import measure_adamw, measure_host_copies, stream_bytes_per_s
from .timing import ProfilerOptions, _sync_for, seconds_per_call

# Dense datasheet peaks (TFLOP/s) of GPUs we know; anything else gets its measured matmul rate.
GPU_PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    (r"H200", {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0}),
    (r"H100.*PCIe", {"bfloat16": 756.0, "float16": 756.0, "float32": 51.0}),
    (r"H100", {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0}),
    (r"A100", {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5}),
    (r"\bL4\b", {"bfloat16": 121.0, "float16": 121.0, "float32": 30.3}),
    (r"V100", {"float16": 125.0, "float32": 15.7}),
]


# --------------------------------------------------------------------------- compute and memory

@dataclass
class ComputeMeasurements:
    """Rates measured on one device (FLOP/s or bytes/s)."""

    matmul_flops: dict[str, float]  # dtype -> large-matmul rate
    matmul_model_flops: float  # rate of a transformer-sized matmul in the main dtype
    attention_flops: float
    copy_bytes_per_s: float
    elementwise_bytes_per_s: float
    reduction_bytes_per_s: float
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    main_dtype: str
    norm_bytes_per_s: float
    softmax_bytes_per_s: float
    op_overhead_s: float
    adam_params_per_s: float = 0.0  # the backend's AdamW kernel on the device (0: not measured)
    host_adam_params_per_s: float = 0.0  # the same on host tensors, with the worker's threads
    matmul_points: list = field(default_factory=list)  # (m, n, k, fraction of the main dtype's peak)
    fused_bytes_per_s: float = 0.0  # one memory pass of an inductor-compiled elementwise chain (0: not measured)
    sustained: float = 1.0  # large-GEMM rate held under sustained load / the first GEMMs' rate
    stream_bytes_per_s: float = 0.0  # one pass over buffers far beyond the caches (0: not measured)
    pointwise_extra_ns: dict = field(default_factory=dict)  # compiled GELU/SiLU math beyond a memory pass (CPU)


def _dtypes(device: str) -> list[str]:
    return ["bfloat16", "float16", "float32"] if device == "cuda" else ["float32", "bfloat16"]


def measure_compute(device: str, options: ProfilerOptions) -> ComputeMeasurements:
    import torch
    import torch.nn.functional as F

    log, sync, target = options.log, _sync_for(device), options.bench_s
    on_gpu = device == "cuda"
    main_dtype = ("bfloat16" if torch.cuda.is_bf16_supported() else "float16") if on_gpu else "float32"

    matmul: dict[str, float] = {}
    for dtype_name in _dtypes(device):
        dtype = getattr(torch, dtype_name)
        n = (8192 if dtype_name != "float32" else 4096) if on_gpu else (512 if options.quick else 1024)
        if not on_gpu and dtype_name != "float32":
            n = 256  # bf16 matmul on CPU is an order of magnitude slower
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        rate = 2 * n**3 / seconds_per_call(lambda: a @ b, sync, target)
        matmul[dtype_name] = rate
        log(f"matmul {dtype_name} {n}^3: {rate / 1e9:.1f} GFLOP/s")

    dtype = getattr(torch, main_dtype)
    tokens, hidden = (8192, 4096) if on_gpu else ((512, 256) if options.quick else (1024, 512))
    x, w = torch.randn(tokens, hidden, device=device, dtype=dtype), torch.randn(hidden, 4 * hidden, device=device, dtype=dtype)
    model_rate = 2 * tokens * hidden * 4 * hidden / seconds_per_call(lambda: x @ w, sync, target)
    log(f"matmul {main_dtype} {tokens}x{hidden}x{4 * hidden} (transformer MLP shape): {model_rate / 1e9:.1f} GFLOP/s")
    datasheet = _peaks(device, None)[0] if on_gpu else {}
    shape_peak = datasheet.get(main_dtype, matmul[main_dtype])
    shape_points = matmul_shapes.measure_shapes(device, main_dtype, shape_peak,
                                                lambda fn: seconds_per_call(fn, sync, target / 2),
                                                matmul_shapes.shapes_for(device, options.quick), log)
    if main_dtype not in datasheet:  # a measured peak
        matmul[main_dtype], shape_points = _best_gemm_as_peak(matmul[main_dtype], model_rate, shape_points, log)

    batch, heads, seq, head_dim = (4, 16, 2048, 128) if on_gpu else ((1, 4, 128, 64) if options.quick else (1, 4, 256, 64))
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))

    def attention_step() -> None:  # causal, as the models run it: a GPU's flash kernel skips the masked half
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()

    # forward 4*b*h*s^2*d (the full s^2, as cost_annotation counts causal attention), backward twice the forward
    attention_rate = 3 * 4 * batch * heads * seq * seq * head_dim / seconds_per_call(attention_step, sync, target)
    log(f"causal attention {main_dtype} b{batch} h{heads} s{seq} d{head_dim} fwd+bwd: {attention_rate / 1e9:.1f} GFLOP/s")

    numel = (64 << 20 if on_gpu else (1 << 20 if options.quick else 4 << 20))
    src = torch.randn(numel, device=device)
    other, dst = torch.randn(numel, device=device), torch.empty(numel, device=device)
    nbytes = src.element_size() * numel
    copy_rate = 2 * nbytes / seconds_per_call(lambda: dst.copy_(src), sync, target)
    log(f"device memory copy {nbytes / 1e6:.0f} MB: {copy_rate / 1e9:.2f} GB/s (read+write)")
    add_rate = 3 * nbytes / seconds_per_call(lambda: torch.add(src, other, out=dst), sync, target)
    log(f"elementwise add: {add_rate / 1e9:.2f} GB/s")
    rows = src.view(-1, 1024)
    sums = torch.empty(rows.shape[0], device=device)
    reduce_rate = nbytes / seconds_per_call(lambda: torch.sum(rows, dim=1, out=sums), sync, target)
    log(f"row reduction: {reduce_rate / 1e9:.2f} GB/s")
    norm_rate = 2 * nbytes / seconds_per_call(lambda: F.layer_norm(rows, (1024,)), sync, target)
    log(f"layer norm (rows of 1024): {norm_rate / 1e9:.2f} GB/s (read+write)")
    softmax_rate = 2 * nbytes / seconds_per_call(lambda: torch.softmax(rows, dim=1), sync, target)
    log(f"softmax (rows of 1024): {softmax_rate / 1e9:.2f} GB/s (read+write)")

    stream_rate = stream_bytes_per_s(device, (64 << 20) if options.quick else (256 << 20), target)
    log(f"one pass over {(64 if options.quick else 256)} MB of buffers (zeroing, beyond the caches): "
        f"{stream_rate / 1e9:.2f} GB/s")
    h2d_rate, d2h_rate = measure_host_copies(device, numel, sync, target, log)
    tiny = torch.ones(1, device=device)
    tiny_out = torch.empty(1, device=device)
    overhead = seconds_per_call(lambda: torch.add(tiny, tiny, out=tiny_out), sync, target)
    log(f"per-op overhead (one-element add): {overhead * 1e6:.2f} us")
    adam_rate, host_adam_rate = measure_adamw(device, options)
    fused_rate, pointwise = 0.0, {}
    if options.compiled if options.compiled is not None else not options.quick:
        chain = (8192, 4096) if on_gpu else ((256, 256) if options.quick else (1024, 512))
        fused_rate = fused_bytes_per_s(device, main_dtype, *chain, lambda fn: seconds_per_call(fn, sync, target), log)
        if not on_gpu:  # a GPU's compiled pointwise kernels are memory-bound: their math hides under the pass
            pointwise = pointwise_extra_ns(device, main_dtype, *((256, 1024) if options.quick else (512, 3072)),
                                           lambda fn: seconds_per_call(fn, sync, target), log)
    sustain = options.sustain_s if options.sustain_s is not None else (20.0 if on_gpu and not options.quick else 0.0)
    sustained = sustained_fraction(device, main_dtype, 8192 if on_gpu else 512, sustain, sync, log) if sustain > 0 else 1.0
    return ComputeMeasurements(matmul, model_rate, attention_rate, copy_rate, add_rate, reduce_rate,
                               h2d_rate, d2h_rate, main_dtype, norm_rate, softmax_rate, overhead,
                               adam_rate, host_adam_rate, shape_points, fused_rate, sustained, stream_rate, pointwise)


# --------------------------------------------------------------------------- the whole profile

def _device_count(device: str) -> int:
    import torch

    if device == "cuda":
        return torch.cuda.device_count()
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _device_memory(device: str, per_node: int) -> float:
    import torch

    if device == "cuda":
        return float(torch.cuda.get_device_properties(0).total_memory)
    with open("/proc/meminfo") as handle:
        total_kb = next(int(line.split()[1]) for line in handle if line.startswith("MemTotal"))
    return total_kb * 1024 / per_node


def _memory_headroom(device: str, per_node: int) -> dict[str, float]:
    """GPU: ``memory_headroom_gb`` from the measured context (memory in use that torch did not reserve)
    plus the typical workspaces, NCCL buffers and fragmentation; CPU: none."""
    if device != "cuda":
        return {}
    import torch

    from mist_compiler.cost.hardware import default_memory_headroom

    free, total = torch.cuda.mem_get_info(0)
    context = max(0.0, float(total - free - torch.cuda.memory_reserved(0)))
    return {"memory_headroom_gb": round(default_memory_headroom(_device_memory(device, per_node), context) / 1e9, 3)}


def _best_gemm_as_peak(peak: float, model_rate: float, points: list[tuple[int, int, int, float]],
                       log: Callable[[str], None]) -> tuple[float, list[tuple[int, int, int, float]]]:
    """A measured peak is the best GEMM rate the device reached in this run: a large GEMM timed while
    other work ran can come out below a later shape's rate (a shared CPU), and a profile whose GEMMs
    beat its own peak would price work above 100% of the device. Returns the peak and the shape table
    as fractions of it."""
    best = max([peak, model_rate, *(efficiency * peak for *_, efficiency in points)])
    if best <= peak:
        return peak, points
    log(f"peak raised to the best GEMM rate measured: {best / 1e9:.1f} GFLOP/s (the large GEMM ran at "
        f"{peak / 1e9:.1f})")
    return best, [(m, n, k, round(float(efficiency * peak / best), 4)) for m, n, k, efficiency in points]


def _peaks(device: str, measured: ComputeMeasurements | None) -> tuple[dict[str, float], str]:
    """Dense peaks: datasheet values of a known GPU, else the measured large-matmul rates (None: not yet measured)."""
    import torch

    if device == "cuda":
        name = torch.cuda.get_device_name(0)
        for pattern, peaks in GPU_PEAK_TFLOPS:
            if re.search(pattern, name):
                return {k: v * 1e12 for k, v in peaks.items()}, f"datasheet peaks of {name}"
        if measured is None:
            return {}, f"{name} is not in the datasheet table"
        return dict(measured.matmul_flops), f"{name} is not in the datasheet table: peaks are measured large-matmul rates"
    return dict(measured.matmul_flops), "peaks are measured single-thread large-matmul rates (no datasheet for a CPU core)"


def _efficiencies(measured: ComputeMeasurements, peaks: dict[str, float]) -> dict[str, float]:
    peak = peaks.get(measured.main_dtype, measured.matmul_flops[measured.main_dtype])
    clamp = lambda value: round(float(min(1.0, max(1e-4, value))), 4)  # noqa: E731
    efficiency = {
        "matmul": clamp(measured.matmul_model_flops / peak),
        "attention": clamp(measured.attention_flops / peak),
        "elementwise": clamp(measured.elementwise_bytes_per_s / measured.copy_bytes_per_s),
        "reduction": clamp(measured.reduction_bytes_per_s / measured.copy_bytes_per_s),
        "norm": clamp(measured.norm_bytes_per_s / measured.copy_bytes_per_s),
        "softmax": clamp(measured.softmax_bytes_per_s / measured.copy_bytes_per_s),
    }
    efficiency["default"] = round(float(np.median(list(efficiency.values()))), 4)  # unknown ops: the typical class
    if measured.fused_bytes_per_s > 0:  # compiled units' elementwise kernels (cost.compiled)
        efficiency["fused"] = clamp(measured.fused_bytes_per_s / measured.copy_bytes_per_s)
    return efficiency


def _group_sizes(device: str, options: ProfilerOptions) -> list[int]:
    available = _device_count(device)
    wanted = options.world_sizes if options.world_sizes is not None else ((2, 4, 8) if device == "cuda" else (2, 4))
    for size in wanted:
        if size < 2:
            raise ProfileError(f"profile option world_sizes: a collective group needs >= 2 ranks, got {size}")
        if options.world_sizes is not None and size > available:
            raise ProfileError(f"profile option world_sizes: {size} ranks asked for, this machine has {available} "
                               f"{'GPUs' if device == 'cuda' else 'cores'}")
    return [size for size in wanted if size <= available]


def _resolve_device(options: ProfilerOptions) -> str:
    import torch

    device = options.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ProfileError(f"profile option device: expected 'cpu', 'cuda' or 'auto', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ProfileError("profile option device: 'cuda' asked for but no CUDA device is available")
    return device


@contextlib.contextmanager
def _as_one_rank(device: str):
    """Torch limited to one thread on CPU and freed host memory kept for reuse, as the CPU backend runs
    its ranks; GPU memory handed back after."""
    import torch

    from ..runtime.host_allocator import keep_freed_host_memory

    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)
        keep_freed_host_memory()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if device == "cuda":
            torch.cuda.empty_cache()  # leave GPU 0's memory to the rank processes


def _load_note() -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"1-minute load average {load:.1f} when it started (other work on the machine slows every measurement)"


def _assemble(options: ProfilerOptions, device: str, per_node: int, measured: ComputeMeasurements,
              links: dict, factors: dict, slowdown: dict, notes: list[str], started: float,
              gpus_per_node: int | None = None, reduce_scatter_copies: float = 0.0) -> HardwareProfile:
    """Turn measurements into a validated profile (the same checks as a YAML file gets)."""
    peaks, peak_note = _peaks(device, measured)
    notes = notes + [peak_note]
    if device == "cpu":
        notes.append("one 'device' is one core running one rank with torch limited to 1 thread; device memory is "
                     "total RAM divided by the cores; h2d/d2h are a CPU->CPU copy standing in for host<->device; "
                     "slowdowns include the CPU contention of threads sharing the cores")
    data = {
        "name": options.name or f"measured-{device}",
        "description": f"Measured by `mistc profile` in {time.perf_counter() - started:.0f} s"
                       f"{' (--quick)' if options.quick else ''}. " + "; ".join(notes) + ".",
        "device_memory_gb": round(_device_memory(device, per_node) / 1e9, 3),
        **_memory_headroom(device, per_node),
        "gpus_per_node": gpus_per_node or per_node,
        "peak_tflops": {k: float(f"{v / 1e12:.6g}") for k, v in peaks.items()},
        "efficiency": _efficiencies(measured, peaks),
        "memory_bandwidth_gbps": round(measured.copy_bytes_per_s / 1e9, 3),
        **({"stream_gbps": round(measured.stream_bytes_per_s / 1e9, 3)} if measured.stream_bytes_per_s else {}),
        **({"compiled_pointwise_ns": measured.pointwise_extra_ns} if measured.pointwise_extra_ns else {}),
        "collectives": links,
        "collective_factor": factors,
        "h2d_gbps": round(measured.h2d_bytes_per_s / 1e9, 3),
        "d2h_gbps": round(measured.d2h_bytes_per_s / 1e9, 3),
        "slowdown": slowdown,
        "op_overhead_s": float(f"{measured.op_overhead_s:.3g}"),
        "reduce_scatter_copies": reduce_scatter_copies,
        **_optimizer_rates(measured),
        **_shape_fields(measured, peaks),
        **({"sustained_compute": round(measured.sustained, 4)} if measured.sustained < 1.0 else {}),
    }
    profile = HardwareProfile.from_dict(data, source="measured profile")
    options.log(f"done in {time.perf_counter() - started:.1f} s")
    return profile


def _shape_fields(measured: ComputeMeasurements, peaks: dict[str, float]) -> dict:
    """The measured GEMM table (fractions of the profile's peak) and the shape model fitted to it."""
    if not measured.matmul_points:
        return {}
    peak = peaks.get(measured.main_dtype, measured.matmul_flops[measured.main_dtype])
    model = matmul_shapes.fit_shape_model(measured.matmul_points, peak, measured.copy_bytes_per_s,
                                          ELEMENT_BYTES.get(measured.main_dtype, 2.0))
    return {"matmul_shapes": [list(point) for point in measured.matmul_points],
            "matmul_shape_model": {"peak_efficiency": model.peak_efficiency, "half_intensity": model.half_intensity,
                                   "tail_s": model.tail_s}}


def _optimizer_rates(measured: ComputeMeasurements) -> dict[str, float]:
    rates = {"optimizer_gparams_per_s": measured.adam_params_per_s,
             "host_optimizer_gparams_per_s": measured.host_adam_params_per_s}
    return {key: float(f"{rate / 1e9:.4g}") for key, rate in rates.items() if rate > 0}


def profile_machine(options: ProfilerOptions) -> HardwareProfile:
    """Measure this machine (spawning local ranks for collectives) and return its profile."""
    started = time.perf_counter()
    notes = [_load_note()]
    device = _resolve_device(options)
    per_node = _device_count(device)
    sizes = _group_sizes(device, options)
    if not sizes and options.links_from is None:
        raise ProfileError(f"collectives: no group of >= 2 {device} ranks to measure here ({per_node} available); "
                           "pass links_from (--links-from PROFILE) to take the fits from a shipped profile")
    base = load_profile(options.links_from) if options.links_from and not sizes else None
    options.log(f"profiling {device}: {per_node} {'GPUs' if device == 'cuda' else 'cores (one rank each, 1 thread)'}")

    with _as_one_rank(device):
        measured = measure_compute(device, options)
        local_slowdown = measure_slowdowns(device, options, distributed=False) if not sizes else {}

    results = []
    for index, world in enumerate(sizes):
        options.log(f"collectives over {world} local ranks ({'NCCL' if device == 'cuda' else 'gloo'}), spawning them")
        results.append(run_collective_group(world, device, options, measure_concurrency=index == 0,
                                            timeout_s=options.timeout_s))
    if base is None:
        links, factors = fit_collectives(results)
        slowdown = results[0]["slowdown"]
        notes.append("inter-node shapes not measured (run `mistc profile` under torchrun on several nodes for them); "
                     "cost.comm derives them from the intra-node fits")
    else:
        links = {f"{n}x{g}": {"bandwidth_gbps": f.bandwidth / 1e9, "latency_s": f.latency} for (n, g), f in base.links.items()}
        factors = dict(base.collective_factor)
        slowdown = dict(local_slowdown)
        slowdown.update({f"{a}|{b}": v for (a, b), v in base.slowdown.items() if "collective" in (a, b)})
        notes.append(f"collective fits, collective slowdowns and devices per node ({base.gpus_per_node}) copied from "
                     f"profile {base.name!r}: no group of 2+ devices was measured here")
    copies = max((result.get("reduce_scatter_copies", 0.0) for result in results), default=base.reduce_scatter_copies
                 if base else 0.0)
    return _assemble(options, device, per_node, measured, links, factors, slowdown, notes, started,
                     gpus_per_node=max(per_node, base.gpus_per_node) if base else per_node,
                     reduce_scatter_copies=copies)


def recalibrate_compute(base: HardwareProfile, options: ProfilerOptions | None = None) -> HardwareProfile:
    """``base`` with its compute side (peaks, efficiencies, memory bandwidth, op overhead) measured here.

    Links, copies and slowdowns stay as ``base`` has them: a quick way to re-anchor a shipped or
    older profile to the machine's current speed (seconds, no ranks spawned). The compiled chain and
    the sustained GEMM rate are re-measured only when ``options`` ask for them (``compiled=True``,
    ``sustain_s > 0``); otherwise ``base``'s values stay.
    """
    import dataclasses

    options = options or ProfilerOptions()
    options = dataclasses.replace(options, compiled=bool(options.compiled), sustain_s=options.sustain_s or 0.0)
    device = _resolve_device(options)
    with _as_one_rank(device):
        measured = measure_compute(device, options)
    peaks, peak_note = _peaks(device, measured)
    shape = _shape_fields(measured, peaks)
    efficiency = _efficiencies(measured, peaks)
    if "fused" not in efficiency and "fused" in base.efficiency:
        efficiency["fused"] = base.efficiency["fused"]
    profile = dataclasses.replace(
        base, peak_flops={**base.peak_flops, **peaks}, efficiency=efficiency,
        sustained_compute=measured.sustained if options.sustain_s > 0 else base.sustained_compute,
        matmul_model=HardwareProfile.from_dict({**base.to_dict(), **shape}).matmul_model if shape else base.matmul_model,
        matmul_points=tuple(tuple(p) for p in shape.get("matmul_shapes", ())) or base.matmul_points,
        memory_bandwidth=measured.copy_bytes_per_s, op_overhead=measured.op_overhead_s,
        stream_bandwidth=measured.stream_bytes_per_s or base.stream_bandwidth,
        compiled_pointwise_ns=measured.pointwise_extra_ns or base.compiled_pointwise_ns,
        optimizer_params_per_s=measured.adam_params_per_s or base.optimizer_params_per_s,
        host_optimizer_params_per_s=measured.host_adam_params_per_s or base.host_optimizer_params_per_s,
        description=f"{base.description} Compute side re-measured by recalibrate_compute ({peak_note}; {_load_note()}).")
    return HardwareProfile.from_dict(profile.to_dict(), source="recalibrated profile")


# --------------------------------------------------------------------------- a cluster, under torchrun

def launched_by_torchrun() -> bool:
    """True when this process is one rank of a ``torchrun`` job with more than one rank."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "LOCAL_WORLD_SIZE" in os.environ


def _powers_up_to(limit: int) -> list[int]:
    sizes = [1 << i for i in range(limit.bit_length()) if (1 << i) <= limit]
    return sizes + ([limit] if limit not in sizes else [])


def profile_cluster(options: ProfilerOptions) -> HardwareProfile | None:
    """Run as one rank of ``torchrun --nnodes N --nproc-per-node G``: measure every group shape
    ``n x g`` (n, g powers of two up to N, G, and N, G themselves), intra- and inter-node.

    The rank on the first node with local rank 0 measures compute and writes nothing itself; it gets
    the profile back, every other rank gets None.
    """
    import datetime

    import torch
    import torch.distributed as dist

    started = time.perf_counter()
    notes = [_load_note()]
    device = _resolve_device(options)
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if device == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=options.timeout_s))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        places: list = [None] * world
        dist.all_gather_object(places, (int(os.environ.get("GROUP_RANK", "0")), local_rank))
        node_ids = sorted({node for node, _ in places})
        if world != len(node_ids) * local_world:
            raise ProfileError(f"torchrun layout: {world} ranks over {len(node_ids)} nodes is not "
                               f"{local_world} per node on every node")
        rank_of = {place: r for r, place in enumerate(places)}
        reporter = rank_of[(node_ids[0], 0)]
        log = options.log if rank == reporter else (lambda message: None)
        quiet_options = ProfilerOptions(quick=options.quick, device=device, log=log)
        log(f"profiling a cluster: {len(node_ids)} nodes x {local_world} {device} ranks ({dist.get_backend()})")
        measured = measure_compute(device, quiet_options) if rank == reporter else None
        dist.barrier()
        results = []
        for nodes in _powers_up_to(len(node_ids)):
            for gpus in _powers_up_to(local_world):
                if nodes * gpus < 2:
                    continue
                members = [rank_of[(node_ids[i], local)] for i in range(nodes) for local in range(gpus)]
                group = dist.new_group(members)  # every rank creates every group, in the same order
                if rank in members:
                    shape_log = (lambda m, s=f"{nodes}x{gpus}": log(f"[{s}] {m}"))
                    times = time_group_collectives(device, options.quick, options.bench_s, members, group, shape_log)
                    results.append({"shape": [nodes, gpus], "times": times})
                dist.barrier()
        slowdown = measure_slowdowns(device, quiet_options, distributed=True)
        copies = reduce_scatter_input_copies(device, world)
    finally:
        dist.destroy_process_group()
    if rank != reporter:
        return None
    links, factors = fit_collectives(results)
    notes.append(f"measured under torchrun over {len(node_ids)} node(s) x {local_world} rank(s); slowdowns with the "
                 "collective spanning all of them")
    return _assemble(options, device, local_world, measured, links, factors, slowdown, notes, started,
                     reduce_scatter_copies=copies)


if __name__ == "__main__":
    # internal entry point of the rank processes that run_collective_group starts
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        import json as _json

        _collective_worker(*_json.loads(sys.argv[2]))
    else:
        print("internal module: use `mistc profile`", file=sys.stderr)
        sys.exit(2)
