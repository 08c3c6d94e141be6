"""What a gloo rank blocked in a receive, or exchanging tensors, costs the ranks that compute, on a
machine with fewer cores than ranks (issue 29's four-rank rows: four gloo ranks on this machine's
two cores).

    python benchmarks/gloo_wait_cost.py [--seconds 4] [--repeats 3] [--modes sleep,recv,p2p] [--mb 0.75]

Four processes, one intra-op thread each. Ranks 0 and 1 multiply 256 x 256 matrices for a fixed
time; ranks 2 and 3 meanwhile either sleep, block in ``dist.recv`` from them (the send comes after
the timed part), or (``p2p``) pass a ``--mb`` MB tensor back and forth between themselves, as
pipeline stages pass activations and their gradients. Prints, per run, the compute ranks' matmuls
per second and the CPU seconds each other rank used; ``p2p`` also the bytes each direction carried
(GB/s) and the CPU seconds per GB moved. If a blocked receive polled, the compute ranks would slow
down with it and the waiting ranks' CPU seconds would be close to the wall time; a model that
shares the cores among the ranks that compute is right only if neither happens. What an exchange
costs in CPU is taken from the cores the computing ranks share.
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


def _ping_pong(rank: int, nbytes: int, seconds: float) -> tuple[int, float]:
    """Ranks 2 and 3 pass one tensor back and forth until ``seconds`` have passed on rank 2; returns
    (tensors this rank received, wall seconds)."""
    tensor = torch.ones(max(nbytes // 4, 1))
    flag = torch.zeros(1)
    received, started = 0, time.perf_counter()
    while True:
        if rank == 2:
            flag.fill_(float(time.perf_counter() - started < seconds))
            dist.send(flag, dst=3)
            if flag.item() == 0:
                break
            dist.send(tensor, dst=3)
            dist.recv(tensor, src=3)
        else:
            dist.recv(flag, src=2)
            if flag.item() == 0:
                break
            dist.recv(tensor, src=2)
            dist.send(tensor, dst=2)
        received += 1
    return received, time.perf_counter() - started


def _rank(rank: int, mode: str, seconds: float, port: int, results, nbytes: int = 0) -> None:
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
            if mode != "sleep":
                dist.send(torch.ones(1), dst=rank + 2)
        else:
            cpu, moved = time.process_time(), (0, seconds)
            if mode == "sleep":
                time.sleep(seconds)
            elif mode == "p2p":
                moved = _ping_pong(rank, nbytes, seconds)
            if mode != "sleep":  # (p2p: the compute ranks' sends still come)
                dist.recv(torch.zeros(1), src=rank - 2)
            results.put((rank, (time.process_time() - cpu, moved)))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(mode: str, seconds: float, nbytes: int = 0) -> tuple[float, list[tuple[float, tuple[int, float]]]]:
    """(compute ranks' matmuls per second together, per other rank (CPU seconds, (tensors received,
    wall seconds of the exchange)))."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    processes = [context.Process(target=_rank, args=(rank, mode, seconds, port, results, nbytes))
                 for rank in range(4)]
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
    parser.add_argument("--modes", default="sleep,recv,p2p", help="comma-separated: sleep, recv, p2p")
    parser.add_argument("--mb", type=float, default=0.75,
                        help="p2p: MB per tensor (0.75: a gpt-small micro-batch's activations, 256 x 768 fp32)")
    args = parser.parse_args()
    nbytes = int(args.mb * 2 ** 20)
    print(f"{'other ranks':12s} {'matmuls/s':>10s}  {'their CPU s (of ' + format(args.seconds, 'g') + ' s)':>24s}"
          f"  {'p2p GB/s each way':>18s}  {'CPU s per GB moved':>18s}")
    for _ in range(args.repeats):
        for mode in args.modes.split(","):
            rate, others = run(mode, args.seconds, nbytes)
            cpu = [value[0] for value in others]
            line = f"{mode:12s} {rate:10.0f}  {cpu[0]:11.2f}, {cpu[1]:.2f}"
            if mode == "p2p":
                count, wall = others[0][1]
                gigabytes = count * nbytes / 1e9  # each direction carried this much
                line += f"  {gigabytes / wall:18.2f}  {sum(cpu) / (2 * gigabytes):18.2f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
