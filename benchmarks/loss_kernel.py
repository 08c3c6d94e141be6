"""The fused LM-head loss against the plain head + cross-entropy: time and peak memory of forward + backward.

``mist::linear_cross_entropy`` (``mist_compiler.ops``) computes ``cross_entropy(hidden @ W.T, labels)``
by vocabulary slices of ``H`` entries and never holds the ``N x V`` logits; the plain loss holds them
(and their fp32 log-probabilities and gradient). The tuner picks the plain one where it fits and is
faster (``cost.schedule.choose_fused_loss``), so what matters is what the fused one costs in time for
the memory it saves. Rows: the shapes of gpt-small's head (this machine's accuracy runs) and a
scaled-down Llama-3 head (vocabulary 128K over hidden 1024).

    python benchmarks/loss_kernel.py [--device cuda] [--repeats 5]

Time is the fastest of ``repeats`` calls (CPU: one thread, its CPU clock; CUDA: synchronised wall
clock); peak is ``DevicePeakMemory`` above the inputs.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mist_compiler.ops import linear_cross_entropy  # noqa: E402
from mist_compiler.profiling.live_memory import DevicePeakMemory  # noqa: E402

SHAPES = [("gpt-small head", 512, 384, 8192), ("gpt-small head, batch 8", 2048, 384, 8192),
          ("llama-3 head / 4", 1024, 1024, 128256)]


def plain_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy((hidden @ weight.t()).float(), labels)


def measure(loss_fn, n: int, h: int, v: int, device: torch.device, repeats: int) -> tuple[float, float]:
    """(best seconds, peak bytes above the inputs) of one forward + backward."""
    torch.manual_seed(0)
    hidden = torch.randn(n, h, device=device, requires_grad=True)
    weight = (0.02 * torch.randn(v, h, device=device)).requires_grad_()
    labels = torch.randint(0, v, (n,), device=device)

    def step() -> None:
        hidden.grad = weight.grad = None
        loss_fn(hidden, weight, labels).backward()

    clock = time.process_time if device.type == "cpu" else time.perf_counter
    step()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = clock()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, clock() - start)
    hidden.grad = weight.grad = None
    with DevicePeakMemory(device) as probe:
        probe.track(hidden, weight, labels)
        probe.reset_peak()
        base = probe.current_bytes
        step()
        peak = probe.peak_bytes - base
    return best, peak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    print(f"{'shape':26s} {'N':>6s} {'H':>5s} {'V':>7s} {'fused ms':>9s} {'plain ms':>9s} {'fused/plain':>11s} "
          f"{'fused MB':>9s} {'plain MB':>9s}")
    for name, n, h, v in SHAPES:
        fused_s, fused_peak = measure(linear_cross_entropy, n, h, v, device, args.repeats)
        plain_s, plain_peak = measure(plain_loss, n, h, v, device, args.repeats)
        print(f"{name:26s} {n:6d} {h:5d} {v:7d} {fused_s * 1e3:9.1f} {plain_s * 1e3:9.1f} {fused_s / plain_s:11.2f} "
              f"{fused_peak / 1e6:9.1f} {plain_peak / 1e6:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
