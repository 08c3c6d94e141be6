"""Stopping a training run on SIGTERM or SIGINT without losing the step in flight.

A scheduler preempts a job by sending SIGTERM (to the launcher, or to every process of the job)
and a grace period later SIGKILL; a user presses Ctrl-C. Either way each rank only *records* the
request (:class:`StopRequest`); the trainer finishes the step it is in, every rank agrees on the
request through the step's gradient-norm all-reduce (no extra collective, so ranks that were
signalled at different moments stop after the same step), writes a checkpoint synchronously and
raises :class:`Preempted`. The launched rank then exits with ``exit_codes.PREEMPTED`` (75).

Repeated SIGTERMs (the scheduler's and the launcher's forwarded one) count once. A second SIGINT
stops the process at once (exit 130), as Ctrl-C twice does elsewhere.
"""
from __future__ import annotations

import os
import signal
import threading
from types import FrameType

from ..launch.exit_codes import INTERRUPTED


class Preempted(Exception):
    """Training stopped on a signal after step ``step``; ``checkpoint`` holds it (None: nothing saved)."""

    def __init__(self, step: int, signal_name: str, checkpoint: str | None) -> None:
        self.step, self.signal_name, self.checkpoint = step, signal_name, checkpoint
        where = f"saved {checkpoint}" if checkpoint else "nothing saved (no --save-dir)"
        super().__init__(f"preempted by {signal_name} after step {step}: {where}")


class StopRequest:
    """Records SIGTERM/SIGINT for the trainer; ``install`` on the main thread, ``restore`` after."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def install(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
        elif signum == signal.SIGINT:
            os._exit(INTERRUPTED)  # Ctrl-C twice: now
