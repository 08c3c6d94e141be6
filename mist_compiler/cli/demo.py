"""mistc demo: the whole compiler on a built-in default, end to end, on this machine.

Tunes MODEL (default ``gpt-tiny``) for ``--nproc`` devices of the ``cpu`` hardware profile,
prints the plan with its predicted time and memory, writes it to ``--out``, then trains it for
``--steps`` steps on that many gloo processes through torchrun and checks it against
one-process training (``--check``: first-step gradients, losses and final weights, within 10x
the rounding error of an ordinary one-process run). Exit code 0 means the plan ran and matched.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="gpt-tiny", help="model to tune and train (default gpt-tiny)")
    parser.add_argument("--hardware", default="cpu", help="hardware profile to tune for (default cpu)")
    parser.add_argument("--nproc", type=int, default=2, help="processes (devices) to tune for and run on (default 2)")
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    parser.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    parser.add_argument("--out", default="mist-demo", help="directory for the plan and its frontiers (default ./mist-demo)")


def run(args: argparse.Namespace) -> int:
    from .. import driver
    from ..ir.files import check_output_dir
    from ..ir.plan import save_plan
    from ..tuner.api import _stderr_progress
    from ..tuner.report import format_result, save_frontiers
    from . import run as run_command

    for name in ("nproc", "global_batch", "seq", "steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    check_output_dir(args.out, "--out")
    print(f"[1/2] tuning {args.model} for {args.nproc} x {args.hardware}, global batch {args.global_batch}, "
          f"sequence {args.seq}", file=sys.stderr)
    result = driver.tune_model(args.model, args.hardware, nodes=1, gpus_per_node=args.nproc,
                               global_batch=args.global_batch, seq_len=args.seq, dtype="float32",
                               progress=_stderr_progress)
    result.plan = dataclasses.replace(result.plan, model=args.model)
    plan_path = os.path.join(args.out, "plan.json")
    save_plan(result.plan, plan_path)
    save_frontiers(result, plan_path)
    print(format_result(result, result.model_config, result.peak_flops))
    print(f"plan written to {plan_path}")

    print(f"[2/2] training {args.steps} steps on {args.nproc} gloo processes and checking against one process",
          file=sys.stderr)
    run_args = argparse.Namespace(
        model=args.model, plan=plan_path, steps=args.steps, check=True, lr=None, timeout=300.0,
        nproc_per_node=args.nproc, nnodes=1, node_rank=0, master_addr="127.0.0.1", master_port=None,
        debug=getattr(args, "debug", False),
    )
    return run_command.run(run_args)
