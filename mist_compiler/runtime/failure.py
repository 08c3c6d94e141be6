"""Failure detection through the rendezvous store: who failed, and stopping everyone in time.

:class:`FailureMonitor` costs each rank two store requests per heartbeat, whatever the world size
(the store sees ``2 * world`` requests per second, not ``world ** 2``):

- one shared key, ``mist/failed``, holds ``"<rank>\\n<reason>"`` of the first rank that reports a
  failure; every rank's monitor thread checks that one key each heartbeat and, when it appears,
  prints the reason and exits non-zero (``on_peer_failure``): nobody waits for a collective that can
  never complete;
- on gloo every rank also writes its own heartbeat key, so that a rank whose transfer broke or
  timed out can find the rank that died (stale heartbeat) and report it on that rank's behalf; the
  survivors then all name the dead rank. That scan reads every heartbeat once, in one
  ``multi_get``, and happens only after a failure.
- a stalled rank (stopped with SIGSTOP, or its process frozen) fails nothing itself, so each rank
  also watches one other, the next rank in a ring (one more read every ``WATCH_EVERY`` heartbeats):
  a heartbeat that has not changed for ``stall_after_s`` (half the timeout, at least 10 beats) by
  the watcher's own clock (no clock is compared across hosts) is reported as a failure of that
  rank, so the job stops, naming it, within the timeout of the rank's last sign of life.

On NCCL the monitor stays quiet: no heartbeats (NCCL's watchdog already times out and tears down
a job whose collectives hang, naming the collective), only the one-key check that lets a rank
failing for a reason of its own stop the others at once.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable

HEARTBEAT_S = 1.0
FAILED_KEY = "mist/failed"
STALE_AFTER_S = 4 * HEARTBEAT_S
WATCH_EVERY = 4
STALL_FLOOR_BEATS = 10  # a heartbeat thread starved for a few seconds (a loaded host) is not a stall


class FailureMonitor:
    """Fail fast, and say who failed, through the rendezvous store (see the module docstring)."""

    def __init__(self, rank: int, world: int, timeout_s: float,
                 on_peer_failure: Callable[[str], None] | None = None, heartbeats: bool | None = None,
                 store: Any = None, stall_after_s: float | None = None) -> None:
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.stall_after_s = max(timeout_s / 2, STALL_FLOOR_BEATS * HEARTBEAT_S) if stall_after_s is None else stall_after_s
        self._watched = (rank + 1) % world if world > 1 else None
        self._watched_value: bytes | None = None
        self._watched_since = 0.0
        self.on_peer_failure = on_peer_failure or (lambda message: _exit_on_peer_failure(message, rank))
        self.store = store if store is not None else _default_store(own_connection=True)
        self.heartbeats = _backend_has_no_watchdog() if heartbeats is None else heartbeats
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.store is not None and world > 1:
            self._beat()
            self._thread = threading.Thread(target=self._run, name="mist-failure-monitor", daemon=True)
            self._thread.start()

    def _heartbeat_key(self, rank: int) -> str:
        return f"mist/heartbeat/{rank}"

    def _beat(self) -> None:
        if self.heartbeats:
            self.store.set(self._heartbeat_key(self.rank), repr(time.time()))

    def _reported(self) -> tuple[int, str] | None:
        if not self.store.check([FAILED_KEY]):
            return None
        rank, _, reason = self.store.get(FAILED_KEY).decode(errors="replace").partition("\n")
        return int(rank), reason

    def _run(self) -> None:
        beats = 0
        while not self._stop.wait(HEARTBEAT_S):
            beats += 1
            try:
                self._beat()
                found = self._reported()
                if found is None and self.heartbeats and beats % WATCH_EVERY == 0:
                    found = self._watch()
            except Exception:  # the store itself is gone: the main thread's timeouts take over
                return
            if found is not None and found[0] != self.rank:
                if not self._stop.is_set():
                    self.on_peer_failure(f"mist: rank {self.rank} stops because rank {found[0]} failed: {found[1]}")
                return

    def _watch(self) -> tuple[int, str] | None:
        """The watched rank and why, when its heartbeat has not moved for ``stall_after_s`` (reported)."""
        key = self._heartbeat_key(self._watched)
        if not self.store.check([key]):
            return None  # not started yet: a rank that never starts is found by the collective's timeout
        value, now = self.store.get(key), time.monotonic()
        if value != self._watched_value:
            self._watched_value, self._watched_since = value, now
            return None
        silent = now - self._watched_since
        if silent <= self.stall_after_s:
            return None
        reason = (f"stalled: no heartbeat for {silent:.0f} s (its process is stopped or frozen; "
                  f"--timeout {self.timeout_s:g} s)")
        self.report_failure(reason, rank=self._watched)
        return self._reported() or (self._watched, reason)

    def report_failure(self, message: str, rank: int | None = None) -> None:
        """Publish that ``rank`` (default: this one) failed; the first report stands."""
        if self.store is None:
            return
        try:
            value = f"{self.rank if rank is None else rank}\n{message[:2000]}"
            self.store.compare_set(FAILED_KEY, "", value)  # only if nobody reported before
        except Exception:
            pass

    def find_failed_rank(self, patience_s: float = 6 * HEARTBEAT_S) -> tuple[int, str] | None:
        """A rank that reported a failure or whose heartbeat went stale (waits up to ``patience_s``)."""
        if self.store is None:
            return None
        deadline = time.time() + min(patience_s, self.timeout_s)
        while True:
            try:
                found = self._scan()
            except Exception:
                return None
            if found is not None or time.time() > deadline:
                return found
            time.sleep(HEARTBEAT_S / 2)

    def _scan(self) -> tuple[int, str] | None:
        reported = self._reported()
        if reported is not None or not self.heartbeats:
            return reported
        others = [r for r in range(self.world) if r != self.rank]
        keys = [self._heartbeat_key(r) for r in others]
        if not self.store.check(keys):
            for rank, key in zip(others, keys):
                if not self.store.check([key]):
                    return rank, "never sent a heartbeat (stalled or killed during start-up)"
        now = time.time()
        for rank, beat in zip(others, self.store.multi_get(keys)):
            if now - float(beat.decode()) > STALE_AFTER_S:
                return rank, "stopped responding (process died or hung)"
        return None

    def stop(self) -> None:
        """Stop beating; wait for the thread to leave its store call (a daemon thread still inside the
        store's C++ client when the interpreter exits aborts the process: "terminate called without
        an active exception", seen under torchrun with the torch.compile backend)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            thread.join(timeout=2 * HEARTBEAT_S + 1.0)


def blame(error: BaseException, rank: int, world: int, timeout_s: float) -> str:
    """The line for ``error`` on ``rank``: when it is a failure to reach a peer (a timeout during set-up,
    say), the rank that reported a failure or stopped beating is named first."""
    what = f"{type(error).__name__}: {error}"
    if world < 2 or not is_transfer_error(error):
        return what
    monitor = FailureMonitor(rank, world, timeout_s, on_peer_failure=lambda message: None, heartbeats=True)
    try:
        found = monitor.find_failed_rank()
    finally:
        monitor.stop()
    return what if found is None or found[0] == rank else f"stops because rank {found[0]} failed: {found[1]} (here: {what})"


def report_failure(message: str, rank: int, store: Any = None) -> None:
    """Publish that ``rank`` failed (the first report stands), without a monitor: what a rank does when
    it fails outside a step (set-up, a checkpoint), so the others stop at their next heartbeat."""
    store = store if store is not None else _default_store()
    if store is None:
        return
    try:
        store.compare_set(FAILED_KEY, "", f"{rank}\n{message[:2000]}")
    except Exception:
        pass


def _backend_has_no_watchdog() -> bool:
    """gloo (and single-process groups) need heartbeats; NCCL has its own watchdog."""
    try:
        import torch.distributed as dist

        return dist.get_backend() != "nccl"
    except Exception:
        return True


def _exit_on_peer_failure(message: str, rank: int) -> None:
    print(message, flush=True)  # stdout: what the launcher shows the user
    if rank == 0:
        # rank 0 often hosts the rendezvous store: keep it up a moment for the others to read
        time.sleep(3 * HEARTBEAT_S)
    os._exit(1)


def is_transfer_error(error: BaseException) -> bool:
    """A failure to talk to a peer (timeout, closed connection), as opposed to a failure of our own."""
    text = f"{type(error).__name__}: {error}".lower()
    markers = ("timed out", "timeout", "connection", "closed by peer", "collectiveerror", "pipelinetimeout",
               "distbackenderror", "broken pipe", "gloo")
    return any(marker in text for marker in markers)


def _default_store(own_connection: bool = False) -> Any:
    """The rendezvous store; ``own_connection``: a clone for the monitor thread, so it is never queued
    behind the main thread's own store requests (gloo's connection set-up waits on the store for up to
    the timeout, and a store client serves one request at a time)."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        store = _get_default_store()
    except Exception:
        return None
    if own_connection:
        try:
            return store.clone()
        except Exception:
            pass
    return store
