"""What a gloo rank blocked in a receive costs the ranks that compute, on a machine with fewer cores
than ranks (issue 29's four-rank rows: four gloo ranks on this machine's two cores).

    python benchmarks/gloo_wait_cost.py [--seconds 4] [--repeats 3]

Four processes, one intra-op thread each. Ranks 0 and 1 multiply 256 x 256 matrices for a fixed
time; ranks 2 and 3 meanwhile either sleep or block in ``dist.recv`` from them (the send comes after
the timed part). Prints, per run, the compute ranks' matmuls per second and the CPU seconds each
waiting rank used. If a blocked receive polled, the compute ranks would slow down with it and the
waiting ranks' CPU seconds would be close to the wall time; a model that shares the cores among
the ranks that compute is right only if neither happens.
"""
from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZE = 256


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _rank(rank: int, mode: str, seconds: float, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=4)
    try:
        dist.barrier()
        if rank < 2:
            matrix, count, started = torch.randn(SIZE, SIZE), 0, time.perf_counter()
            while time.perf_counter() - started < seconds:
                matrix = (matrix @ matrix).clamp_(-1, 1)
                count += 1
            results.put((rank, count / (time.perf_counter() - started)))
            if mode == "recv":
                dist.send(torch.ones(1), dst=rank + 2)
        else:
            cpu = time.process_time()
            if mode == "sleep":
                time.sleep(seconds)
            else:
                dist.recv(torch.zeros(1), src=rank - 2)
            results.put((rank, time.process_time() - cpu))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(mode: str, seconds: float) -> tuple[float, list[float]]:
    """(compute ranks' matmuls per second together, waiting ranks' CPU seconds)."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    processes = [context.Process(target=_rank, args=(rank, mode, seconds, port, results)) for rank in range(4)]
    for process in processes:
        process.start()
    values = dict(results.get(timeout=120 + 2 * seconds) for _ in processes)
    for process in processes:
        process.join(timeout=60)
    return values[0] + values[1], [values[2], values[3]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{'waiting ranks':14s} {'matmuls/s':>10s}  waiting ranks' CPU s (of {args.seconds:g} s)")
    for _ in range(args.repeats):
        for mode in ("sleep", "recv"):
            rate, cpu = run(mode, args.seconds)
            print(f"{mode:14s} {rate:10.0f}  {cpu[0]:.2f}, {cpu[1]:.2f}", flush=True)


if __name__ == "__main__":
    main()
