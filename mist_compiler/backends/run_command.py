"""Train a model with a plan on several processes through torchrun.

MODEL is a zoo name (gpt-tiny, gpt2-7b ...), hf:path/to/config.json or package.module:function;
the plan's ``model`` must name the same model (it is compared, never loaded). Before any process
starts, the model is captured and the plan checked against it (layers, positions, every
tensor-parallel split proven on the model). Each rank trains --steps steps on synthetic data
(seeded, the same on every rank); a line per step shows the loss and the step time. With
--check, the run is compared with one-process training (see ``mist_compiler/backends/check.py``)
and the exit code is non-zero when it differs by more than rounding.

Failures end in one line naming the rank and the reason; whichever process of the run dies or is
signalled, all of them exit within seconds. ``mistc --debug run ...`` shows full tracebacks.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections import deque
from typing import Callable

WORKER_MODULE = "mist_compiler.backends.worker"
STOP_GRACE_S = 10.0


class RunArgumentError(ValueError):
    """Bad ``mistc run`` arguments, named."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="zoo name, hf:path/to/config.json or package.module:function")
    parser.add_argument("--plan", required=True, help="plan file (JSON or YAML)")
    parser.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    parser.add_argument("--check", action="store_true", help="compare with one-process training (rank 0)")
    parser.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default 1e-3)")
    add_launch_arguments(parser)


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of every sub-command that launches ranks through torchrun."""
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds any rank waits for another (default 300)")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="processes on this node")
    parser.add_argument("--nnodes", type=int, default=1, help="number of nodes")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's index")
    parser.add_argument("--master-addr", default="127.0.0.1", help="rendezvous host (node 0)")
    parser.add_argument("--master-port", type=int, default=None, help="rendezvous port (default: a free one)")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def validate(args: argparse.Namespace):
    """Everything that can be checked before a process starts; returns the loaded plan."""
    from mist_compiler.ir.plan import load_plan

    validate_launch(args)
    if args.lr is not None and not args.lr >= 0:
        raise RunArgumentError(f"--lr must be >= 0, got {args.lr}")
    plan = load_plan(args.plan)
    check_plan_fits(args, plan)
    return plan


def validate_launch(args: argparse.Namespace) -> None:
    """The launch flags every launching sub-command shares (steps, processes, nodes, port, timeout)."""
    for name in ("steps", "nproc_per_node", "nnodes"):
        if getattr(args, name) < 1:
            raise RunArgumentError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.timeout > 0:
        raise RunArgumentError(f"--timeout must be > 0, got {args.timeout}")
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


def torchrun_prefix(args: argparse.Namespace, port: int, module: str) -> list[str]:
    """``python -m torch.distributed.run ... -m MODULE`` for the launch flags."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc-per-node={args.nproc_per_node}", f"--nnodes={args.nnodes}", f"--node-rank={args.node_rank}",
        f"--master-addr={args.master_addr}", f"--master-port={port}", "-m", module,
    ]


def torchrun_command(args: argparse.Namespace, port: int) -> list[str]:
    command = torchrun_prefix(args, port, WORKER_MODULE) + [
        args.model, "--plan", os.path.abspath(args.plan), "--steps", str(args.steps),
        "--timeout", str(args.timeout),
    ]
    command += ["--check"] if args.check else []
    command += ["--debug"] if getattr(args, "debug", False) else []
    command += ["--lr", str(args.lr)] if args.lr is not None else []
    return command


def _die_with_parent() -> None:
    """In the child: receive SIGTERM when this launcher dies (Linux), so torchrun never outlives it."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


class Launch:
    """A running torchrun: stdout forwarded live, stderr kept (shown with --debug or on failure)."""

    def __init__(self, command: list[str], env: dict, debug: bool) -> None:
        self.debug = debug
        self.errors: deque[str] = deque(maxlen=200)
        self.reported: list[str] = []
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        bufsize=1, preexec_fn=_die_with_parent, start_new_session=True)
        self.readers = [threading.Thread(target=self._pump, args=(self.process.stdout, True), daemon=True),
                        threading.Thread(target=self._pump, args=(self.process.stderr, False), daemon=True)]
        for reader in self.readers:
            reader.start()

    def _pump(self, stream, is_stdout: bool) -> None:
        for line in stream:
            line = line.rstrip("\n")
            if is_stdout:
                if "error:" in line or "stops because" in line or "check:" in line:
                    self.reported.append(line)
                print(line, flush=True)
            else:
                self.errors.append(line)
                if self.debug:
                    print(line, file=sys.stderr, flush=True)

    def wait(self) -> int:
        code = self.process.wait()
        for reader in self.readers:
            reader.join(timeout=5)
        return code

    def stop(self) -> None:
        """Stop torchrun and every rank (its whole session)."""
        if self.process.poll() is not None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(timeout=STOP_GRACE_S)
                return
            except subprocess.TimeoutExpired:
                continue

    def failure(self, code: int) -> str:
        """One line saying which process failed and why."""
        if self.reported:
            origin = next((line for line in self.reported if "error:" in line), self.reported[0])
            return origin.replace("mist: ", "", 1)
        text = "\n".join(self.errors)
        rank = re.search(r"rank\s*:\s*(\d+)", text)
        exitcode = re.search(r"exitcode\s*:\s*(-?\d+)", text)
        if rank and exitcode:
            value = int(exitcode.group(1))
            why = f"was killed by signal {-value}" if value < 0 else f"exited with code {value}"
            return f"rank {rank.group(1)} {why}"
        if code < 0:
            return f"torchrun was killed by signal {-code}"
        last = next((line for line in reversed(self.errors) if line.strip()), "")
        return f"torchrun exited with code {code}" + (f": {last.strip()}" if last else "")


def run(args: argparse.Namespace) -> int:
    validate(args)
    return launch(args, lambda port: torchrun_command(args, port), "run")


def launch(args: argparse.Namespace, command: Callable[[int], list[str]], name: str) -> int:
    """Run torchrun (``command(port)``, a free port unless --master-port) with the package importable,
    forward its stdout, and turn a failure into one line ``mistc NAME: error: ...`` (exit code 1).
    Shared by every sub-command that launches ranks (``run``, ``train``); call after validating."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    port = args.master_port or free_port()
    launch = Launch(command(port), env, getattr(args, "debug", False))
    received: list[str] = []

    def terminated(signum, frame):
        received.append(signal.Signals(signum).name)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        code = launch.wait()
    except KeyboardInterrupt:
        launch.stop()
        print(f"mistc {name}: interrupted ({received[0] if received else 'SIGINT'}); every rank stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    if code != 0:
        check_failed = any(line.startswith("mist: check: FAIL") for line in launch.reported) and \
            not any("error:" in line for line in launch.reported)
        if check_failed:
            return 1
        print(f"mistc {name}: error: {launch.failure(code)}", file=sys.stderr)
        return 1
    return 0
