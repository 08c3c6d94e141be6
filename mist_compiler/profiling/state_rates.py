"""Rates of the once-a-step passes over model state that the profile prices: streaming over buffers
no cache holds, the flat-shard AdamW step on the device and (for offloaded optimizer states) on the
host worker threads, and host<->device copies."""
from __future__ import annotations

import os
from typing import Callable

from .timing import ProfilerOptions, _sync_for, seconds_per_call


def stream_bytes_per_s(device: str, total_bytes: int, target_s: float, timer: Callable = seconds_per_call) -> float:
    """Bytes/s of zeroing ``total_bytes`` spread over 32 MB buffers, one after another: the rate of a
    once-a-step pass over the model state (gradient buffers, accumulators), which no cache holds. On
    a CPU it is about a third of the copy rate measured on one buffer the caches keep."""
    import torch

    chunk = 32 << 20
    buffers = [torch.zeros(chunk // 4, device=device) for _ in range(max(2, total_bytes // chunk))]

    def one_pass() -> None:
        for buffer in buffers:
            buffer.zero_()

    return chunk * len(buffers) / timer(one_pass, _sync_for(device), target_s)


def adamw_params_per_s(device: str, numel: int, target_s: float, timer: Callable = seconds_per_call) -> float:
    """Parameters per second of one step of the backend's flat-shard AdamW (``kernels.adamw``, the
    fused Triton kernel on a GPU, torch's update elsewhere) over ``numel`` fp32 parameters."""
    update = _adamw_update(numel, device)
    return numel / timer(lambda: update(0, numel), _sync_for(device), target_s)


def _adamw_update(numel: int, device: str) -> Callable[[int, int], None]:
    """``update(lo, hi)``: one ``kernels.adamw`` step over elements ``[lo, hi)`` of a flat fp32 shard."""
    import torch

    from ..runtime import kernels

    param, grad = torch.randn(numel, device=device), torch.randn(numel, device=device)
    exp_avg, exp_avg_sq = torch.zeros(numel, device=device), torch.zeros(numel, device=device)

    def update(lo: int, hi: int) -> None:
        kernels.adamw(param[lo:hi], grad[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi], step=10, lr=1e-3,
                      betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

    return update


def host_adamw_params_per_s(numel: int, target_s: float, timer: Callable = seconds_per_call) -> float:
    """Parameters per second of the offloaded optimizer states' update as ``runtime.optimizer`` runs
    it: ``kernels.adamw`` over the flat host shard, chunked over the backend's host worker threads
    (``runtime.streams.HostWorkers``, ``host_threads()`` of them: this rank's share of the cores)."""
    from ..runtime.streams import HostWorkers

    update, workers = _adamw_update(numel, "cpu"), HostWorkers()
    try:
        return numel / timer(lambda: HostWorkers.wait(workers.chunks(numel, update), 600.0, "host AdamW"),
                             lambda: None, target_s)
    finally:
        workers.shutdown()


def measure_adamw(device: str, options: ProfilerOptions) -> tuple[float, float]:
    """AdamW rates on the device and, for offloaded optimizer states, on the host as the backend runs
    it there: torch's intra-op threads as a worker process has them (``OMP_NUM_THREADS``, else 1),
    the update split over its host worker threads. On a CPU the two are the same kernel."""
    import torch

    from ..runtime.streams import host_threads

    # the state of 16M parameters (256 MB) is beyond a CPU's caches, as a model's is; 4M stayed in them
    numel = 64 << 20 if device == "cuda" else (1 << 20 if options.quick else 16 << 20)
    rate = adamw_params_per_s(device, numel, options.bench_s)
    options.log(f"AdamW step ({numel >> 20}M fp32 params on {device}): {rate / 1e9:.3f} G params/s")
    if device == "cpu":
        return rate, rate
    threads, worker_threads = torch.get_num_threads(), int(os.environ.get("OMP_NUM_THREADS", 1))
    torch.set_num_threads(worker_threads)
    try:
        # 32M parameters: 512 MB of state, beyond the host's caches; one thread's 16M measured 0.79-1.46
        # G params/s on an H200 host, whose runtime (16 worker threads) updated 650M in about 0.19 s
        host_rate = host_adamw_params_per_s(1 << 20 if options.quick else 32 << 20, options.bench_s)
    finally:
        torch.set_num_threads(threads)
    options.log(f"AdamW step on the host ({host_threads()} worker threads, {worker_threads} intra-op): "
                f"{host_rate / 1e9:.3f} G params/s")
    return rate, host_rate


def measure_host_copies(device: str, numel: int, sync, target: float, log) -> tuple[float, float]:
    """Host-to-device and device-to-host bytes/s over ``numel`` fp32 (pinned on a GPU; on a CPU a
    host-to-host copy stands in)."""
    import torch

    pinned = device == "cuda"
    host = torch.randn(numel, pin_memory=pinned)
    host_out = torch.empty(numel, pin_memory=pinned)
    on_device = torch.randn(numel, device=device)
    nbytes = host.element_size() * numel
    h2d = nbytes / seconds_per_call(lambda: on_device.copy_(host, non_blocking=pinned), sync, target)
    d2h = nbytes / seconds_per_call(lambda: host_out.copy_(on_device, non_blocking=pinned), sync, target)
    what = "pinned" if pinned else "CPU->CPU stand-in for"
    log(f"{what} host-to-device copy: {h2d / 1e9:.2f} GB/s, device-to-host: {d2h / 1e9:.2f} GB/s")
    return h2d, d2h
