"""torchrun for mist ranks: ``python -m mist_compiler.launch.agent ARGS`` runs
``torch.distributed.run`` with ``ARGS``, except for what happens on SIGTERM and SIGINT.

torchrun answers either signal by raising in its monitoring loop: it signals the workers, gives
them ``--shutdown-timeout`` seconds, kills them, and a second signal during that wait abandons
them at once. A preempted training run needs the opposite: its ranks finish the step, save and
exit on their own (:mod:`mist_compiler.training.preemption`), however many SIGTERMs arrive (a
scheduler signals every process of the job, the launcher forwards its own). So this agent keeps
torchrun's handlers off those two signals (``--signals-to-handle=SIGHUP,SIGQUIT``), forwards the
first one it receives to every worker, ignores repeats, and lets torchrun go on monitoring until
the workers exit. Killing the agent (SIGKILL) still takes the workers down (they follow their
parent, :func:`mist_compiler.launch.worker.follow_parent`).
"""
from __future__ import annotations

import os
import signal
import sys
from types import FrameType

HANDLED_BY_TORCHRUN = "SIGHUP,SIGQUIT"


def worker_pids(parent: int) -> list[int]:
    """The live child processes of ``parent`` (Linux ``/proc``)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent and fields[0] != "Z":
            found.append(int(entry))
    return found


class _Forwarder:
    def __init__(self) -> None:
        self.received: str | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            return  # the workers have been told; they stop on their own
        self.received = signal.Signals(signum).name
        for pid in worker_pids(os.getpid()):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if os.path.isdir("/proc"):
        forward = _Forwarder()
        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, forward)
        argv = [f"--signals-to-handle={HANDLED_BY_TORCHRUN}", *argv]
    from torch.distributed.run import main as torchrun

    torchrun(argv)


if __name__ == "__main__":
    main()
