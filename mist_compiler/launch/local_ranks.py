"""Run a function on N local ranks (tests, benchmarks): free port, one process per rank (one torch
thread each; gloo, or NCCL with one GPU per rank), a timeout, errors surfaced.

Usage (the worker must be a module-level function, TORCH-NOTES section 4)::

    def _worker(rank: int, world: int, arg) -> dict: ...        # runs with the process group set up
    results = run_ranks(_worker, world=2, args=(arg,))          # one result per rank, in rank order

Each rank runs ``fn(rank, world, *args)`` after ``dist.init_process_group("gloo")``; its return
value (picklable) comes back to the parent. An exception in any rank is re-raised in the parent
as ``RankError`` with that rank's traceback; a run longer than ``timeout_s`` kills the ranks and
raises ``RankError`` too, so a deadlocked collective never hangs the caller.

On gloo the ranks are forked from a fork server that imported torch, dynamo, inductor, transformers
and the compiler once (``PRELOADED``): a rank starts in a fraction of a second where a spawned one
spends seconds of CPU importing them again, which the test suite paid ~100 times. Each rank takes
the caller's environment and working directory as they are at the call, as a spawned one would;
only what a preloaded module read from the environment when it was imported (``TRITON_INTERPRET``
in ``runtime/kernels.py``, torch's own settings) keeps the value it had when the server started.
NCCL ranks, and every rank on a machine with a GPU (a gloo rank may train on it: ``gpu_check``'s one-device
rows), are spawned: a preloaded module may initialise CUDA in the server, and a forked child cannot
use it then.
"""
from __future__ import annotations

import datetime
import os
import socket
import traceback
from typing import Any, Callable, Sequence

import torch.multiprocessing as mp


# What the fork server imports once (a module that fails to import is skipped; the rank imports it).
PRELOADED = ("torch", "torch.distributed", "torch._dynamo", "torch._inductor.compile_fx", "transformers",
             "mist_compiler.driver")


class RankError(RuntimeError):
    """A rank raised, died or timed out; the message carries the rank's traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, fn: Callable, args: Sequence[Any],
               queue: Any, collective_timeout_s: float, backend: str, environ: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(environ)  # the caller's environment now, not the fork server's when it started
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = str(rank), str(world)  # one node: as torchrun sets them
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        extra = {}
        if backend == "nccl":  # the rank's own GPU, current before anything touches CUDA
            torch.cuda.set_device(rank)
            extra["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(
            backend, rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=collective_timeout_s), **extra,
        )
        result = fn(rank, world, *args)
        queue.put((rank, True, result))
    except BaseException:  # report everything, including assertion errors, to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _context(backend: str):
    """gloo: the fork server (module docstring); NCCL, or any rank where CUDA is: spawn."""
    import torch

    if backend == "nccl" or torch.cuda.is_available():  # (is_available does not initialise CUDA)
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOADED))
    return context


def run_ranks(fn: Callable, world: int, args: Sequence[Any] = (), timeout_s: float = 120.0,
              collective_timeout_s: float = 60.0, backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks (gloo; ``backend="nccl"``: one GPU per rank);
    return the per-rank results."""
    if world < 1:
        raise ValueError(f"run_ranks: world must be >= 1, got {world}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"run_ranks: backend must be gloo or nccl, got {backend!r}")
    context = _context(backend)
    queue = context.SimpleQueue()
    port = free_port()
    processes = [
        context.Process(target=_rank_main, args=(rank, world, port, fn, tuple(args), queue, collective_timeout_s,
                                                 backend, dict(os.environ)), daemon=True)
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    results: dict[int, Any] = {}
    failures: list[str] = []
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
    try:
        while len(results) + len(failures) < world:
            if not queue.empty():
                rank, ok, payload = queue.get()
                if ok:
                    results[rank] = payload
                else:
                    failures.append(f"--- rank {rank} ---\n{payload}")
                continue
            if datetime.datetime.now() > deadline:
                failures.append(f"timed out after {timeout_s:.0f} s waiting for ranks "
                                f"{sorted(set(range(world)) - set(results))}")
                break
            dead = [p for p in processes if p.exitcode not in (None, 0)]
            if dead and queue.empty():
                failures.append(f"rank process(es) died with exit codes {[p.exitcode for p in dead]}")
                break
            processes[0].join(0.02)
    finally:
        for process in processes:
            process.join(0.0 if failures else 5.0)  # after a failure the others wait on it: no grace
            if process.is_alive():
                process.kill()
                process.join(5.0)
    if failures:
        raise RankError("local ranks failed:\n" + "\n".join(failures))
    return [results[rank] for rank in range(world)]
