"""Launching ranks through torchrun from the process the user started.

:func:`launch` runs ``python -m torch.distributed.run ... -m MODULE`` (a free port unless one is
given) with the package importable, forwards the ranks' stdout, keeps their stderr, and turns a
failure into one line naming the rank and the reason. Whichever process dies or is signalled,
all of them exit: torchrun runs in its own session, follows this process through Linux's
parent-death signal, and is stopped with its whole session on SIGINT/SIGTERM.
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

STOP_GRACE_S = 10.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun_prefix(args: argparse.Namespace, port: int, module: str) -> list[str]:
    """``python -m torch.distributed.run ... -m MODULE`` for the launch flags."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc-per-node={args.nproc_per_node}", f"--nnodes={args.nnodes}", f"--node-rank={args.node_rank}",
        f"--master-addr={args.master_addr}", f"--master-port={port}", "-m", module,
    ]


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


def launch(args: argparse.Namespace, command: Callable[[int], list[str]], name: str) -> int:
    """Run torchrun (``command(port)``, a free port unless --master-port) with the package importable,
    forward its stdout, and turn a failure into one line ``mistc NAME: error: ...`` (exit code 1).
    Shared by every sub-command that launches ranks (``run``, ``train``); call after validating."""
    env = dict(os.environ)
    # the node's cores shared by its ranks (torchrun's default is 1 thread each: half of a 2-core machine
    # idle under a one-process run); the user's OMP_NUM_THREADS wins
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, args.nproc_per_node))))
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
