"""Timing primitives of ``mistc profile``: options, best-of-batches timers and cross-rank agreement.

Shared by the compute measurements (``profiler``) and the collective/concurrency measurements
(``profile_comm``)."""
from __future__ import annotations

import math
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Callable


def _stderr(message: str) -> None:
    print(f"[mistc profile] {message}", file=sys.stderr, flush=True)


@dataclass
class ProfilerOptions:
    """How much to measure. ``quick`` shrinks sizes and durations (tests, smoke runs)."""

    quick: bool = False
    device: str = "auto"  # "cpu", "cuda" or "auto"
    world_sizes: tuple[int, ...] | None = None  # local group sizes for collectives; None: 2 and 4 as available
    name: str | None = None
    links_from: str | None = None  # shipped profile to take collective fits from when none can be measured
    timeout_s: float = 240.0  # for all spawned collective workers together
    compiled: bool | None = None  # time inductor-compiled fused kernels (None: unless quick)
    sustain_s: float | None = None  # seconds of back-to-back GEMMs for the sustained rate (None: 20 on a GPU, else 0)
    log: Callable[[str], None] = field(default=_stderr, repr=False)

    @property
    def bench_s(self) -> float:
        """Target duration of one timed measurement."""
        return 0.03 if self.quick else 0.15


def _sync_for(device: str) -> Callable[[], None]:
    import torch

    if device == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def seconds_per_call(fn: Callable[[], object], sync: Callable[[], None], target_s: float, repeats: int = 5) -> float:
    """Best per-call time over ``repeats`` batches, each batch sized to last about ``target_s / repeats``.

    The best batch, not the mean: on a shared machine other processes only ever make a batch slower,
    and the profile describes the machine, not its momentary load.
    """
    fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    once = max(time.perf_counter() - start, 1e-7)
    calls = max(1, min(10_000, int(target_s / repeats / once)))
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def _backend_device() -> str:
    """NCCL reduces CUDA tensors only; gloo takes CPU ones."""
    import torch.distributed as dist

    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def _agree(value: float, distributed: bool, group=None, mean: bool = False) -> float:
    """The maximum (or mean) of ``value`` over the ranks of ``group``; all of them must call it."""
    if not distributed:
        return value
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([float(value)], dtype=torch.float64, device=_backend_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if mean else dist.ReduceOp.MAX, group=group)
    return float(tensor.item()) / (dist.get_world_size(group) if mean else 1)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]

