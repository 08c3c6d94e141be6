"""The failure monitor's cost per rank does not grow with the world, and it still names who failed."""
from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from mist_compiler.runtime import failure
from mist_compiler.runtime.failure import FailureMonitor

BEAT = 0.05


class CountingStore:
    """A HashStore that counts the requests it serves."""

    def __init__(self) -> None:
        self.inner = dist.HashStore()
        self.requests = 0
        self.lock = threading.Lock()

    def __getattr__(self, name):
        method = getattr(self.inner, name)

        def counted(*args, **kwargs):
            with self.lock:
                self.requests += 1
            return method(*args, **kwargs)
        return counted


def _monitors(world: int, store, heartbeats: bool, seen: list) -> list[FailureMonitor]:
    return [FailureMonitor(rank, world, 60.0, on_peer_failure=seen.append, heartbeats=heartbeats, store=store)
            for rank in range(world)]


@pytest.mark.parametrize("heartbeats, per_beat", [(True, 2), (False, 1)])
def test_store_requests_per_rank_do_not_grow_with_the_world(monkeypatch, heartbeats, per_beat):
    monkeypatch.setattr(failure, "HEARTBEAT_S", BEAT)
    rates = {}
    for world in (4, 32):
        store = CountingStore()
        monitors = _monitors(world, store, heartbeats, [])
        start_requests, start = store.requests, time.time()
        time.sleep(12 * BEAT)
        rates[world] = (store.requests - start_requests) / (time.time() - start) * BEAT / world
        for monitor in monitors:
            monitor.stop()
    for world, rate in rates.items():
        assert rate <= per_beat * 1.25, f"{rate:.2f} store requests per rank per heartbeat at world {world}"


def test_a_reported_failure_reaches_every_rank_naming_it(monkeypatch):
    monkeypatch.setattr(failure, "HEARTBEAT_S", BEAT)
    seen: list[str] = []
    monitors = _monitors(8, dist.HashStore(), True, seen)
    monitors[5].report_failure("RuntimeError: out of memory")
    monitors[2].report_failure("a later report does not replace the first")
    deadline = time.time() + 40 * BEAT
    while len(seen) < 7 and time.time() < deadline:
        time.sleep(BEAT)
    for monitor in monitors:
        monitor.stop()
    assert len(seen) == 7, seen
    assert all("because rank 5 failed: RuntimeError: out of memory" in message for message in seen)


def test_a_silent_rank_is_found_by_its_stale_heartbeat(monkeypatch):
    monkeypatch.setattr(failure, "HEARTBEAT_S", BEAT)
    monkeypatch.setattr(failure, "STALE_AFTER_S", 4 * BEAT)
    store = dist.HashStore()
    monitors = _monitors(4, store, True, [])
    time.sleep(3 * BEAT)
    monitors[3].stop()  # rank 3 stops beating (as if its process died)
    found = monitors[0].find_failed_rank(patience_s=40 * BEAT)
    for monitor in monitors:
        monitor.stop()
    assert found is not None and found[0] == 3 and "stopped responding" in found[1]
