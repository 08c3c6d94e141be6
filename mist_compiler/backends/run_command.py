"""Train a model with a plan on several processes through torchrun.

MODEL is a zoo name (gpt-tiny, gpt2-7b ...), hf:path/to/config.json or package.module:function.
Each rank trains --steps steps on synthetic data (seeded, the same on every rank). With --check,
rank 0 then trains the same model in one process (torch.optim.AdamW on the whole global batch)
and compares losses and final weights, printing the largest relative difference; the exit code
is non-zero past the tolerance. The plan is checked against the launched world and the model
before anything runs; every rank gives up within --timeout seconds when another one fails.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

WORKER_MODULE = "mist_compiler.backends.worker"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="zoo name, hf:path/to/config.json or package.module:function")
    parser.add_argument("--plan", required=True, help="plan file (JSON or YAML)")
    parser.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    parser.add_argument("--check", action="store_true", help="compare with single-process training (rank 0)")
    parser.add_argument("--tolerance", type=float, default=1e-5, help="largest relative difference --check accepts")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds any rank waits for another (default 300)")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="processes on this node")
    parser.add_argument("--nnodes", type=int, default=1, help="number of nodes")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's index")
    parser.add_argument("--master-addr", default="127.0.0.1", help="rendezvous host (node 0)")
    parser.add_argument("--master-port", type=int, default=29500, help="rendezvous port")


class RunArgumentError(ValueError):
    """Bad ``mistc run`` arguments, named."""


def _validate(args: argparse.Namespace) -> None:
    from mist_compiler.ir.plan import load_plan

    for name in ("steps", "nproc_per_node", "nnodes"):
        if getattr(args, name) < 1:
            raise RunArgumentError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.timeout > 0:
        raise RunArgumentError(f"--timeout must be > 0, got {args.timeout}")
    if not 0 <= args.node_rank < args.nnodes:
        raise RunArgumentError(f"--node-rank must be in [0, {args.nnodes}), got {args.node_rank}")
    plan = load_plan(args.plan)
    world = args.nproc_per_node * args.nnodes
    if plan.world_size != world:
        raise RunArgumentError(
            f"the plan needs {plan.world_size} ranks but --nnodes {args.nnodes} x --nproc-per-node "
            f"{args.nproc_per_node} launches {world}")
    from mist_compiler.models import resolve_model

    resolve_model(args.model)  # unknown names fail here, before any process starts


def torchrun_command(args: argparse.Namespace) -> list[str]:
    command = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc-per-node={args.nproc_per_node}", f"--nnodes={args.nnodes}", f"--node-rank={args.node_rank}",
        f"--master-addr={args.master_addr}", f"--master-port={args.master_port}",
        "-m", WORKER_MODULE, args.model, "--plan", os.path.abspath(args.plan), "--steps", str(args.steps),
        "--timeout", str(args.timeout), "--tolerance", str(args.tolerance),
    ]
    if args.check:
        command.append("--check")
    return command


def run(args: argparse.Namespace) -> int:
    _validate(args)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    # torchrun itself must not outlive a failed job: its own monitor kills the other workers.
    process = subprocess.Popen(torchrun_command(args), env=env)
    try:
        return process.wait()
    except KeyboardInterrupt:
        process.terminate()
        process.wait(timeout=30)
        raise
