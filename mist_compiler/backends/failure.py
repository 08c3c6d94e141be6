"""Failure detection through the rendezvous store: who failed, and stopping everyone in time.

Moved out of ``engine.py`` unchanged; see :class:`FailureMonitor`.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Callable

HEARTBEAT_S = 1.0


class FailureMonitor:
    """Fail fast, and say who failed, through the rendezvous store.

    Every rank writes a heartbeat each second. A rank whose step fails for a reason of its own
    (not a broken transfer) writes ``mist/failed/<rank>``; every other rank's monitor sees that key
    within a heartbeat, prints the reason and exits non-zero (``on_peer_failure``): nobody waits
    for a collective that can never complete. A rank whose step fails because a peer vanished
    (transfer error or timeout) looks for a rank whose heartbeat went stale and reports it on
    that rank's behalf, so the survivors all name the dead rank.
    """

    def __init__(self, rank: int, world: int, timeout_s: float,
                 on_peer_failure: Callable[[str], None] | None = None) -> None:
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.on_peer_failure = on_peer_failure or (lambda message: _exit_on_peer_failure(message, rank))
        self.store = _default_store()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.store is not None and world > 1:
            self._beat()
            self._thread = threading.Thread(target=self._run, name="mist-heartbeat", daemon=True)
            self._thread.start()

    def _key(self, kind: str, rank: int) -> str:
        return f"mist/{kind}/{rank}"

    def _beat(self) -> None:
        self.store.set(self._key("heartbeat", self.rank), repr(time.time()))

    def _run(self) -> None:
        others = [r for r in range(self.world) if r != self.rank]
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._beat()
                for rank in others:
                    if self.store.check([self._key("failed", rank)]):
                        reason = self.store.get(self._key("failed", rank)).decode(errors="replace")
                        if not self._stop.is_set():
                            self.on_peer_failure(f"mist: rank {self.rank} stops because rank {rank} failed: {reason}")
                        return
            except Exception:  # the store itself is gone: the main thread's timeouts take over
                return

    def report_failure(self, message: str, rank: int | None = None) -> None:
        if self.store is None:
            return
        try:
            self.store.set(self._key("failed", self.rank if rank is None else rank), message[:2000])
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
        now = time.time()
        for rank in range(self.world):
            if rank == self.rank:
                continue
            if self.store.check([self._key("failed", rank)]):
                return rank, self.store.get(self._key("failed", rank)).decode(errors="replace")
            if not self.store.check([self._key("heartbeat", rank)]):
                return rank, "never started"
            if now - float(self.store.get(self._key("heartbeat", rank)).decode()) > 4 * HEARTBEAT_S:
                return rank, "stopped responding (process died or hung)"
        return None

    def stop(self) -> None:
        self._stop.set()


def _exit_on_peer_failure(message: str, rank: int) -> None:
    print(message, file=sys.stderr, flush=True)
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


def _default_store() -> Any:
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:
        return None
