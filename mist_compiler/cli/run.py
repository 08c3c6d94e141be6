"""Train a model with a plan on several processes through torchrun.

MODEL is a zoo name (gpt-tiny, gpt2-7b ...), hf:DIR (pretrained), hf:path/to/config.json or
package.module:function; the plan's ``model`` must name the same model (it is compared, never
loaded). Before any process starts, the model is captured and the plan checked against it (layers,
positions, every tensor-parallel split proven on the model). Each rank trains --steps steps on
synthetic data (seeded, the same on every rank); a line per step shows the loss and the step time.
With --check, the run is compared with one-process training (see ``mist_compiler/verify/check.py``)
and the exit code is non-zero when it differs by more than rounding.

Failures end in one line naming the rank and the reason; whichever process of the run dies or is
signalled, all of them exit within seconds. ``mistc --debug run ...`` shows full tracebacks.
"""
from __future__ import annotations

import argparse
import os

from ..launch.torchrun import launch, torchrun_prefix

WORKER_MODULE = "mist_compiler.launch.worker"


class RunArgumentError(ValueError):
    """Bad ``mistc run`` arguments, named."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="zoo name, hf:DIR, hf:path/to/config.json or package.module:function")
    parser.add_argument("--plan", required=True, help="plan file (JSON or YAML)")
    parser.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    parser.add_argument("--check", action="store_true", help="compare with one-process training (rank 0)")
    parser.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default 1e-3)")
    add_launch_arguments(parser)


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of every sub-command that launches ranks through torchrun."""
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds any rank waits for another; a rank silent that long is reported (default 120)")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="processes on this node")
    parser.add_argument("--nnodes", type=int, default=1, help="number of nodes")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's index")
    parser.add_argument("--master-addr", default="127.0.0.1", help="rendezvous host (node 0)")
    parser.add_argument("--master-port", type=int, default=None, help="rendezvous port (default: a free one)")
    parser.add_argument("--no-compile", action="store_true",
                        help="run the stage programs eagerly (debugging) instead of inductor-compiled")


def validate(args: argparse.Namespace):
    """Everything that can be checked before a process starts; returns the loaded plan."""
    from mist_compiler.ir.plan import load_plan

    validate_launch(args)
    if args.lr is not None and not 0 <= args.lr < float("inf"):
        raise RunArgumentError(f"--lr must be a finite number >= 0, got {args.lr}")
    plan = load_plan(args.plan)
    check_plan_fits(args, plan)
    return plan


def validate_launch(args: argparse.Namespace) -> None:
    """The launch flags every launching sub-command shares (steps, processes, nodes, port, timeout)."""
    from ..ir.plan import MAX_INT

    for name in ("steps", "nproc_per_node", "nnodes"):
        if not 1 <= getattr(args, name) <= MAX_INT:
            raise RunArgumentError(f"--{name.replace('_', '-')} must be in 1..{MAX_INT}, got {getattr(args, name)}")
    if not 0 < args.timeout < float("inf"):
        raise RunArgumentError(f"--timeout must be a finite number of seconds > 0, got {args.timeout}")
    if not 0 <= args.node_rank < args.nnodes:
        raise RunArgumentError(f"--node-rank must be in [0, {args.nnodes}), got {args.node_rank}")
    if args.master_port is not None and not 1 <= args.master_port <= 65535:
        raise RunArgumentError(f"--master-port must be in 1..65535, got {args.master_port}")


def check_plan_fits(args: argparse.Namespace, plan) -> None:
    """The plan needs exactly the launched ranks, and the model captures and accepts it."""
    world = args.nproc_per_node * args.nnodes
    if plan.world_size != world:
        raise RunArgumentError(
            f"the plan needs {plan.world_size} ranks but --nnodes {args.nnodes} x --nproc-per-node "
            f"{args.nproc_per_node} launches {world}")
    from mist_compiler import driver

    return driver.compile_model(args.model, plan=plan, model_name=args.model, until="plan")


def torchrun_command(args: argparse.Namespace, port: int) -> list[str]:
    command = torchrun_prefix(args, port, WORKER_MODULE) + [
        args.model, "--plan", os.path.abspath(args.plan), "--steps", str(args.steps),
        "--timeout", str(args.timeout),
    ]
    command += ["--check"] if args.check else []
    command += ["--no-compile"] if getattr(args, "no_compile", False) else []
    command += ["--debug"] if getattr(args, "debug", False) else []
    command += ["--lr", str(args.lr)] if args.lr is not None else []
    return command


def run(args: argparse.Namespace) -> int:
    validate(args)
    return launch(args, lambda port: torchrun_command(args, port), "run")
