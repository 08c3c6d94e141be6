"""Launching ranks through torchrun from the process the user started.

:func:`launch` runs torchrun (``python -m mist_compiler.launch.agent ... -m MODULE``: torchrun with
mist's handling of SIGTERM/SIGINT, :mod:`.agent`; a free port unless one is given) with the package
importable, forwards the ranks' stdout, keeps their stderr, and turns a failure into one line
naming the rank and the reason, said once (the ranks' own error lines are collected, not echoed).
Whichever process dies or is signalled, all of them exit: torchrun runs in its own session and
follows this process through Linux's parent-death signal.

On SIGINT/SIGTERM: ``mistc run`` stops every process at once (exit 130). ``mistc train``
(``graceful=True``) asks the ranks to finish the step, save a checkpoint and exit
(``exit_codes.PREEMPTED``, 75, once a rank has said it saved); a second signal stops at once.
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

from .exit_codes import FAILED, INTERRUPTED, OK, PREEMPTED

STOP_GRACE_S = 10.0
REPORT_AFTER_S = 1.0  # a failure is said this long after its first line (the origin's own line may follow)
TEARDOWN_AFTER_S = 5.0  # then the ranks get this long to exit before they are killed (a frozen one never does)
AGENT_MODULE = "mist_compiler.launch.agent"
# lines of the ranks that the launcher reports itself, once, at the end (never echoed as they come)
_COLLECTED = ("error:", "stops because", "mist: preempted", "mist: stopped")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun_prefix(args: argparse.Namespace, port: int, module: str) -> list[str]:
    """``python -m mist_compiler.launch.agent ... -m MODULE`` (torchrun, :mod:`.agent`) for the launch flags."""
    return [
        sys.executable, "-m", AGENT_MODULE,
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
    """A running torchrun: stdout forwarded live, stderr kept (shown with --debug or on failure). The
    first rank failure is said at once (``mistc NAME: error: ...``) and the job torn down soon after."""

    def __init__(self, command: list[str], env: dict, debug: bool, name: str = "run") -> None:
        self.debug = debug
        self.name = name
        self.errors: deque[str] = deque(maxlen=200)
        self.reported: list[str] = []
        self.said: str | None = None  # the failure line already printed
        self._failing: threading.Timer | None = None
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
                collected = any(marker in line for marker in _COLLECTED)
                if collected or "check:" in line:
                    self.reported.append(line)
                if not collected or self.debug:
                    print(line, flush=True)
                if ("error:" in line or "stops because" in line) and self._failing is None:
                    self._failing = threading.Timer(REPORT_AFTER_S, self._fail_fast)
                    self._failing.daemon = True
                    self._failing.start()
            else:
                self.errors.append(line)
                if self.debug:
                    print(line, file=sys.stderr, flush=True)

    def _fail_fast(self) -> None:
        """Say the failure now, then stop whatever has not exited by itself (a frozen rank never does)."""
        self.said = f"mistc {self.name}: error: {self.failure(1)}"
        print(self.said, file=sys.stderr, flush=True)
        try:
            self.process.wait(timeout=TEARDOWN_AFTER_S)
        except subprocess.TimeoutExpired:
            self.kill()

    def wait(self) -> int:
        while True:
            try:
                code = self.process.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                self._end_if_only_torchrun_is_left()
        if self._failing is not None:
            self._failing.join()
        for reader in self.readers:
            reader.join(timeout=5)
        return code

    def _end_if_only_torchrun_is_left(self) -> None:
        """Once a rank has said it stopped after saving and every rank has exited, torchrun only has its
        report left to write (seconds of teardown a preempted job does not have): end it."""
        if self.stopped() is None or not os.path.isdir("/proc"):
            return
        from .agent import worker_pids

        if not worker_pids(self.process.pid):
            try:
                self.process.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                self.kill()

    def request_stop(self, sig: int = signal.SIGTERM) -> None:
        """Ask the ranks to finish the step, save and exit (torchrun forwards ``sig``, :mod:`.agent`)."""
        try:
            os.kill(self.process.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """Stop now: SIGKILL the ranks (each in its own session: torchrun starts them so) and torchrun's session."""
        from .agent import worker_pids

        pids = worker_pids(self.process.pid) if os.path.isdir("/proc") else []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()

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

    def stopped(self) -> tuple[str, bool] | None:
        """A rank's line saying it stopped on a signal, and whether it saved first (``mist: preempted ...``)
        or had nowhere to save (``mist: stopped ...``); None if no rank said so."""
        for line in self.reported:
            if line.startswith(("mist: preempted", "mist: stopped")):
                return line.replace("mist: ", "", 1), line.startswith("mist: preempted")
        return None

    def failure(self, code: int) -> str:
        """One line saying which process failed and why."""
        if self.reported:
            origin = next((line for line in self.reported if "error:" in line), self.reported[0])
            return origin.replace("mist: ", "", 1).replace(": error: ", ": ", 1)
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


def launch(args: argparse.Namespace, command: Callable[[int], list[str]], name: str, graceful: bool = False,
           on_preempted: Callable[[str], str] | None = None) -> int:
    """Run torchrun (``command(port)``, a free port unless --master-port) with the package importable,
    forward its stdout, and turn a failure into one line ``mistc NAME: error: ...`` (exit code 1).
    Shared by every sub-command that launches ranks (``run``, ``train``); call after validating.
    ``graceful``: SIGTERM/SIGINT ask the ranks to save and stop (see the module docstring);
    ``on_preempted(line)`` turns a rank's preemption line into the one the user reads."""
    env = dict(os.environ)
    # the node's cores shared by its ranks (torchrun's default is 1 thread each: half of a 2-core machine
    # idle under a one-process run); the user's OMP_NUM_THREADS wins
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, args.nproc_per_node))))
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    port = args.master_port or free_port()
    launch = Launch(command(port), env, getattr(args, "debug", False), name)
    received: list[str] = []

    def signalled(signum, frame):
        received.append(signal.Signals(signum).name)
        if graceful and len(received) == 1:
            print(f"mistc {name}: {received[0]}: finishing the current step and saving a checkpoint "
                  f"(signal again to stop at once)", file=sys.stderr, flush=True)
            launch.request_stop(signum)
            return
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, signalled) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = launch.wait()
    except KeyboardInterrupt:
        launch.kill() if graceful else launch.stop()
        print(f"mistc {name}: interrupted ({received[-1] if received else 'SIGINT'}); every rank stopped",
              file=sys.stderr)
        return INTERRUPTED
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    stopped = launch.stopped()
    if stopped is not None and not any("error:" in line for line in launch.reported):
        line, saved = stopped
        print(f"mistc {name}: {on_preempted(line) if on_preempted and saved else line}", file=sys.stderr)
        return PREEMPTED if saved else INTERRUPTED
    if code != 0:
        check_failed = any(line.startswith("mist: check: FAIL") for line in launch.reported) and \
            not any("error:" in line for line in launch.reported)
        if check_failed:
            return FAILED
        if received and not launch.reported:
            print(f"mistc {name}: interrupted ({received[0]}) before a checkpoint could be written; every rank "
                  f"stopped", file=sys.stderr)
            return INTERRUPTED
        if launch.said is None:
            print(f"mistc {name}: error: {launch.failure(code)}", file=sys.stderr)
        return FAILED
    return OK
