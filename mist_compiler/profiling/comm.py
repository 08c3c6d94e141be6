"""Collective and concurrency measurements of ``mistc profile`` and their alpha-beta fits.

Every collective over every local group size (gloo on CPU, NCCL on GPU) is timed at a few message
sizes in spawned worker processes with timeouts; each ordered pair of channels (compute,
collective, h2d, d2h) is run together to measure how much one slows the other."""
from __future__ import annotations

import math
import os
import sys
import threading
import time

import numpy as np

from mist_compiler.cost.hardware import CHANNELS

from .timing import ProfilerOptions, _agree, _free_port, _stderr, _sync_for

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all")


class _Channel:
    """One unit of work of a channel, repeatable; runs on the calling thread (its own stream on GPU)."""

    def __init__(self, name: str, device: str, quick: bool, group=None) -> None:
        import torch

        self.name, self.device = name, device
        on_gpu = device == "cuda"
        self.stream = torch.cuda.Stream() if on_gpu else None
        # OpenMP thread counts are per thread: a channel on a fresh thread would otherwise use every core
        self.threads = torch.get_num_threads()
        if name == "compute":
            n = 4096 if on_gpu else 256
            dtype = torch.bfloat16 if on_gpu else torch.float32
            self.a, self.b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
            self.out = torch.empty(n, n, device=device, dtype=dtype)
            self._step = lambda: torch.matmul(self.a, self.b, out=self.out)
        elif name == "collective":
            import torch.distributed as dist

            # the sweep's largest message: the bandwidth regime gradient buckets and weight gathers are
            # in (on CPU a small one is latency-bound and hardly competes with compute for the cores)
            self.buffer = torch.ones(max(_message_sizes(device, quick)) // 4, device=device)
            self._step = lambda: dist.all_reduce(self.buffer, group=group)
        else:
            numel = (64 << 20) if on_gpu else ((1 << 20) if quick else (2 << 20))
            host = torch.randn(numel, pin_memory=on_gpu)
            dev = torch.randn(numel, device=device)
            src, dst = (host, dev) if name == "h2d" else (dev, host)
            self._step = lambda: dst.copy_(src, non_blocking=on_gpu)

    def run(self, steps: int) -> float:
        """Run ``steps`` units; seconds elapsed on this thread until they are done."""
        import torch

        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        start = time.perf_counter()
        if self.stream is None:
            for _ in range(steps):
                self._step()
        else:
            with torch.cuda.stream(self.stream):
                for _ in range(steps):
                    self._step()
            self.stream.synchronize()
        return time.perf_counter() - start


def _run_together(fore: _Channel, steps: int, back: _Channel, back_steps: int) -> float:
    """Seconds ``fore`` takes for ``steps`` while ``back`` runs ``back_steps`` on another thread."""
    failure: list[BaseException] = []

    def background() -> None:
        try:
            back.run(back_steps)
        except BaseException as error:  # re-raised on the calling thread
            failure.append(error)

    worker = threading.Thread(target=background, daemon=True)
    worker.start()
    seconds = fore.run(steps)
    worker.join()
    if failure:
        raise RuntimeError(f"profile: channel {back.name} failed while measuring {fore.name}") from failure[0]
    return seconds


def measure_slowdowns(device: str, options: ProfilerOptions, distributed: bool) -> dict[str, float]:
    """``{'A|B': factor}``: foreground A timed while B runs on another thread, against A alone.

    With ``distributed`` (a process group is up) the collective channel takes part; every rank runs
    the same schedule, and iteration counts are agreed across ranks so collectives always match.
    """
    import torch.distributed as dist

    names = [c for c in CHANNELS if c != "collective" or distributed]
    channels = {c: _Channel(c, device, options.quick, dist.group.WORLD if distributed else None) for c in names}
    per_step = {}
    for name, channel in channels.items():
        channel.run(2)  # warm-up; fixed counts so that collectives match across ranks
        seconds = channel.run(3) / 3
        steps = int(_agree(max(1, int(options.bench_s / 3 / max(seconds, 1e-7))), distributed))
        per_step[name] = _agree(channel.run(steps) / steps, distributed)
    factors: dict[str, float] = {}
    for fore in names:
        steps = max(2, math.ceil(options.bench_s / per_step[fore]))
        for back in names:
            if back == fore:
                continue
            back_steps = max(2, math.ceil(1.6 * steps * per_step[fore] / per_step[back]))
            ratios = []
            for _ in range(1 if options.quick else 3):  # alone and together back to back: slow drift cancels
                if distributed:
                    dist.barrier()
                alone = channels[fore].run(steps)
                if distributed:
                    dist.barrier()
                ratios.append(_run_together(channels[fore], steps, channels[back], back_steps) / alone)
            factor = _agree(float(np.median(ratios)), distributed, mean=True)
            factors[f"{fore}|{back}"] = round(max(1.0, factor), 4)
            options.log(f"slowdown {fore} while {back} runs: x{factor:.3f}")
    return factors


def _message_sizes(device: str, quick: bool) -> list[int]:
    if device == "cuda":
        return [1 << 20, 16 << 20, 128 << 20] if not quick else [1 << 20, 32 << 20]
    return [64 << 10, 1 << 20, 8 << 20] if not quick else [64 << 10, 1 << 20]


def _collective_call(kind: str, nbytes: int, device: str, members: list[int], group=None):
    """A zero-argument callable running collective ``kind`` on an ``nbytes`` full buffer within ``group``.

    ``members`` are the group's global ranks in order; point-to-point goes from the first to the second.
    """
    import torch
    import torch.distributed as dist

    from ..runtime.dist_compat import ALL_GATHER, REDUCE_SCATTER

    size = len(members)
    numel = max(size, nbytes // 4 // size * size)
    full = torch.ones(numel, device=device)
    shard = torch.ones(numel // size, device=device)
    if kind == "all_gather":
        return lambda: ALL_GATHER(full, shard, group=group)
    if kind == "reduce_scatter":
        return lambda: REDUCE_SCATTER(shard, full, group=group)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if kind == "broadcast":
        return lambda: dist.broadcast(full, src=members[0], group=group)
    if kind == "all_to_all":
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full, group=group)
    if kind == "p2p":
        rank = dist.get_rank()
        if rank == members[0]:
            return lambda: dist.send(full, dst=members[1], group=group)
        if rank == members[1]:
            return lambda: dist.recv(full, src=members[0], group=group)
        return lambda: None
    raise ValueError(f"unknown collective {kind!r}")


def _time_collective(call, sync, target_s: float, group=None, rounds: int = 3) -> float:
    """Per-call seconds, slowest rank of ``group``, best of ``rounds``; iteration counts agreed."""
    import torch.distributed as dist

    call()
    sync()
    dist.barrier(group=group)
    start = time.perf_counter()
    call()
    sync()
    once = _agree(time.perf_counter() - start, True, group)
    calls = int(max(1, min(200, target_s / rounds / max(once, 1e-6))))
    best = math.inf
    for _ in range(rounds):
        dist.barrier(group=group)
        start = time.perf_counter()
        for _ in range(calls):
            call()
        sync()
        best = min(best, _agree((time.perf_counter() - start) / calls, True, group))
    return best


def time_group_collectives(device: str, quick: bool, bench_s: float, members: list[int], group, log) -> dict:
    """``{kind: [(nbytes, seconds), ...]}`` for every collective in one group (p2p in pairs); members call it."""
    sync = _sync_for(device)
    times: dict[str, list[tuple[int, float]]] = {}
    for kind in KINDS + (("p2p",) if len(members) == 2 else ()):
        for nbytes in _message_sizes(device, quick):
            call = _collective_call(kind, nbytes, device, members, group)
            seconds = _time_collective(call, sync, bench_s, group, rounds=2 if quick else 3)
            times.setdefault(kind, []).append((nbytes, seconds))
            log(f"{kind} {nbytes / 1e6:.3f} MB: {seconds * 1e3:.3f} ms")
    return times


def _collective_worker(rank: int, world: int, port: int, device: str, quick: bool, bench_s: float,
                       measure_concurrency: bool, result_path: str) -> None:
    """One spawned rank: times every collective, optionally the slowdowns; rank 0 writes the JSON result."""
    import datetime
    import json

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    quiet = lambda message: None  # noqa: E731
    options = ProfilerOptions(quick=quick, log=(lambda m: _stderr(f"[{world} ranks] {m}")) if rank == 0 else quiet)
    times = time_group_collectives(device, quick, bench_s, list(range(world)), None, options.log)
    slowdown = measure_slowdowns(device, options, distributed=True) if measure_concurrency else {}
    copies = reduce_scatter_input_copies(device, world)
    dist.barrier()
    if rank == 0:  # written whole, then renamed: the parent never reads half a file
        with open(result_path + ".part", "w") as handle:
            json.dump({"world": world, "times": times, "slowdown": slowdown, "reduce_scatter_copies": copies}, handle)
        os.replace(result_path + ".part", result_path)
    dist.destroy_process_group()


def reduce_scatter_input_copies(device: str, world: int, numel: int = 1 << 20) -> float:
    """Transient copies of its input one reduce-scatter allocates (peak live memory during the call
    beyond its input and output, in units of the input), to a quarter copy."""
    import torch

    from ..runtime.dist_compat import REDUCE_SCATTER
    from .live_memory import DevicePeakMemory

    numel = numel // world * world
    with DevicePeakMemory(device) as probe:
        full = torch.ones(numel, device=device)
        shard = torch.empty(numel // world, device=device)
        before = probe.current_bytes
        probe.reset_peak()
        REDUCE_SCATTER(shard, full, group=None)
        extra = probe.peak_bytes - before
    return round(max(0.0, extra / (4 * numel)) * 4) / 4


def run_collective_group(world: int, device: str, options: ProfilerOptions, measure_concurrency: bool,
                         timeout_s: float) -> dict:
    """Start ``world`` local rank processes, time all collectives; kill them all if they overrun ``timeout_s``.

    Ranks are fresh interpreters (``python -m mist_compiler.profiling.profiler``), so this works from any
    caller, including scripts without a ``__main__`` guard.
    """
    import json
    import subprocess
    import tempfile

    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p))
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="mist-profile-") as scratch:
        result_path = os.path.join(scratch, "result.json")
        ranks = []
        try:
            for rank in range(world):
                config = json.dumps([rank, world, port, device, options.quick, options.bench_s,
                                     measure_concurrency, result_path])
                ranks.append(subprocess.Popen([sys.executable, "-m", "mist_compiler.profiling.profiler", "--worker", config],
                                              env=env, stdin=subprocess.DEVNULL))
            deadline = time.monotonic() + timeout_s
            while not os.path.exists(result_path):
                codes = [p.poll() for p in ranks]
                if any(code not in (None, 0) for code in codes) or all(code is not None for code in codes):
                    break  # a rank failed, or all exited without a result
                if time.monotonic() > deadline:
                    raise RuntimeError(f"profile: {world}-rank collective measurement did not finish within {timeout_s:.0f} s")
                time.sleep(0.1)
            for process in ranks:  # past the last collective: a moment to exit, then the finally kills
                try:
                    process.wait(timeout=2.0)
                except subprocess.TimeoutExpired:
                    pass
            codes = [p.poll() for p in ranks]
            if not os.path.exists(result_path):
                raise RuntimeError(f"profile: a {world}-rank collective worker failed (exit codes {codes}; "
                                   "its error is printed above)")
            with open(result_path) as handle:
                return json.load(handle)
        finally:
            for process in ranks:
                if process.poll() is None:
                    process.kill()
                    process.wait(timeout=10)


def fit_alpha_beta(x_bytes: np.ndarray, seconds: np.ndarray) -> tuple[float, float]:
    """Least-squares ``seconds = x / bandwidth + latency`` (latency >= 0, bandwidth > 0)."""
    x, t = np.asarray(x_bytes, dtype=float), np.asarray(seconds, dtype=float)
    slope, intercept = np.polyfit(x, t, 1) if len(x) > 1 else (t[0] / x[0], 0.0)
    if intercept < 0 or slope <= 0:  # noise: fit through the origin instead
        slope, intercept = float(np.dot(x, t) / np.dot(x, x)), 0.0
    return 1.0 / slope, float(intercept)


def _factor(z: np.ndarray, excess: np.ndarray) -> float:
    """Least-squares ``excess = factor * z`` (absolute seconds, so the large messages dominate)."""
    return max(1e-3, float(np.dot(z, excess) / np.dot(z, z)))


def _shape_of(result: dict) -> tuple[int, int]:
    """A result's group shape: ``shape`` [nodes, gpus_per_node], or ``world`` local ranks on one node."""
    nodes, gpus = result.get("shape", (1, result.get("world")))
    return int(nodes), int(gpus)


def fit_collectives(results: list[dict]) -> tuple[dict[str, dict], dict[str, float]]:
    """Alpha-beta fits per group shape and collective factors relative to all-gather.

    The all-gather timings give each shape's bandwidth and latency. The profile keeps one latency
    per shape, so each other kind's factor is the least-squares fit of ``time - latency`` against
    ``bytes * (n-1)/n / bandwidth``; over shapes the factors are averaged geometrically. Point-to-point
    comes from the two-device shapes (``1x2``, ``2x1``).
    """
    links: dict[str, dict] = {}
    ratios: dict[str, list[float]] = {k: [] for k in KINDS + ("p2p",)}
    for result in sorted(results, key=_shape_of):
        nodes, gpus = _shape_of(result)
        n = nodes * gpus
        times = {kind: np.array(pairs, dtype=float) for kind, pairs in result["times"].items()}
        gathered = times["all_gather"]
        bandwidth, latency = fit_alpha_beta(gathered[:, 0] * (n - 1) / n, gathered[:, 1])
        links[f"{nodes}x{gpus}"] = {"bandwidth_gbps": round(bandwidth / 1e9, 6), "latency_s": float(f"{latency:.3g}")}
        for kind in KINDS:
            z = times[kind][:, 0] * (n - 1) / n / bandwidth
            ratios[kind].append(_factor(z, times[kind][:, 1] - latency))
        if n == 2:
            ratios["p2p"].append(_factor(times["p2p"][:, 0] / bandwidth, times["p2p"][:, 1] - latency))
    factors = {kind: round(float(np.exp(np.mean(np.log(values)))), 4) for kind, values in ratios.items() if values}
    return links, factors

