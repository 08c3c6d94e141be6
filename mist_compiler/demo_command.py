"""mistc demo: the whole compiler on a built-in default, end to end, on this machine.

Tunes MODEL (default ``gpt-tiny``) for ``--nproc`` devices of the ``cpu`` hardware profile,
prints the plan with its predicted time and memory, writes it to ``--out``, then trains it for
``--steps`` steps on that many gloo processes through torchrun and checks losses and final
weights against single-process training (fp32, relative tolerance 1e-5). Exit code 0 means
the plan ran and matched.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="gpt-tiny", help="model to tune and train (default gpt-tiny)")
    parser.add_argument("--hardware", default="cpu", help="hardware profile to tune for (default cpu)")
    parser.add_argument("--nproc", type=int, default=2, help="processes (devices) to tune for and run on (default 2)")
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    parser.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    parser.add_argument("--out", default="mist-demo", help="directory for the plan and its frontiers (default ./mist-demo)")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run(args: argparse.Namespace) -> int:
    from .backends import run_command
    from .ir.plan import save_plan
    from .tuner.api import _stderr_progress, tune
    from .tuner.report import format_result, save_frontiers

    if args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    print(f"[1/2] tuning {args.model} for {args.nproc} x {args.hardware}, global batch {args.global_batch}, "
          f"sequence {args.seq}", file=sys.stderr)
    result = tune(args.model, args.hardware, nodes=1, gpus_per_node=args.nproc, global_batch=args.global_batch,
                  seq_len=args.seq, dtype="float32", progress=_stderr_progress)
    os.makedirs(args.out, exist_ok=True)
    plan_path = os.path.join(args.out, "plan.json")
    save_plan(result.plan, plan_path)
    save_frontiers(result, plan_path)
    print(format_result(result, result.model_config, result.peak_flops))
    print(f"plan written to {plan_path}")

    print(f"[2/2] training {args.steps} steps on {args.nproc} gloo processes and checking against one process",
          file=sys.stderr)
    run_args = argparse.Namespace(
        model=args.model, plan=plan_path, steps=args.steps, check=True, tolerance=1e-5, timeout=300.0,
        nproc_per_node=args.nproc, nnodes=1, node_rank=0, master_addr="127.0.0.1", master_port=_free_port(),
    )
    return run_command.run(run_args)
