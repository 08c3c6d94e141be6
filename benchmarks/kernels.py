"""Hand-written kernels against the torch ops they replace, on the device they target.

The runtime keeps a hand-written kernel only where this table shows it faster than torch on that
device. Today: ``scale_accumulate`` (Triton, CUDA), the gradient "pack" of a flat bucket (cast to
the fp32 reduction buffer and scale by 1/dp in one pass, where torch makes two: a cast copy, then
a scale); and the AdamW update, where the runtime uses torch's own fused kernel and this table
shows what that is worth against the chunked plain-torch update it replaced.

    python benchmarks/kernels.py [--elements 64e6] [--device cuda]

On a machine without CUDA the Triton row is skipped (Triton has no CPU backend; its interpreter is
for correctness only) and the AdamW rows run on the CPU.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mist_compiler.runtime import kernels  # noqa: E402


def best_of(fn, repeats: int, device: torch.device) -> float:
    """Seconds of the fastest of ``repeats`` calls (after one warm-up), synchronised on CUDA."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def scale_rows(n: int, device: torch.device, repeats: int) -> list[tuple[str, float, float]]:
    """(what, hand-written seconds, torch seconds) of the gradient pack for bf16 and fp16 buckets."""
    rows = []
    if not (device.type == "cuda" and kernels.HAVE_TRITON):
        return rows
    for dtype in (torch.bfloat16, torch.float16):
        src, dst = torch.randn(n, device=device).to(dtype), torch.empty(n, device=device)
        triton = best_of(lambda: kernels.scale_accumulate(dst, src, 0.5, accumulate=False), repeats, device)
        plain = best_of(lambda: kernels.scale_accumulate_torch(dst, src, 0.5, accumulate=False), repeats, device)
        rows.append((f"scale_accumulate {str(dtype).replace('torch.', '')} -> fp32", triton, plain))
    return rows


def adamw_rows(n: int, device: torch.device, repeats: int) -> list[tuple[str, float, float]]:
    """torch's fused AdamW (what the runtime runs) against the chunked plain-torch update."""
    tensors = [torch.randn(n, device=device) for _ in range(4)]
    tensors[3].abs_()
    options = dict(step=3, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    fused = best_of(lambda: kernels.adamw(*tensors, **options), repeats, device)
    chunked = best_of(lambda: kernels.adamw_torch(*tensors, **options), repeats, device)
    return [("adamw fp32 (fused vs chunked torch)", fused, chunked)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=float, default=16e6, help="elements per flat buffer (default 16e6)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    device, n = torch.device(args.device), int(args.elements)
    rows = scale_rows(n, device, args.repeats) + adamw_rows(n, device, args.repeats)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{n:,} elements on {name} (torch {torch.__version__}), best of {args.repeats}")
    print(f"{'kernel':<40} {'kept (ms)':>10} {'torch (ms)':>11} {'speed-up':>9}")
    for what, kept, plain in rows:
        print(f"{what:<40} {kept * 1e3:>10.2f} {plain * 1e3:>11.2f} {plain / kept:>8.2f}x")
    if device.type != "cuda":
        print("scale_accumulate: no CUDA device here; its Triton kernel is timed on a GPU only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
