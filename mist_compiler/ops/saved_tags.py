"""Markers that tell the runtime which node of a unit's program is running (per-tensor activation policy).

The ``activation_policy`` lowering pass puts ``saved_tags.enter("<node>")`` before and
``saved_tags.leave("<node>", value)`` after every call of a layer's program, so that the runtime's
saved-tensor hooks (``runtime.saved_activations``) know, for each tensor autograd saves, which node
made it: its decision (keep, recompute, offload) is that node's. Without a listener (a unit without a
policy, the tensor-parallel proof) the markers do nothing but a thread-local read.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Protocol


class Listener(Protocol):
    def enter(self, tag: str) -> None: ...

    def leave(self, tag: str, value: Any) -> None: ...


_local = threading.local()


def enter(tag: str) -> None:
    listener = getattr(_local, "listener", None)
    if listener is not None:
        listener.enter(tag)


def leave(tag: str, value: Any) -> None:
    listener = getattr(_local, "listener", None)
    if listener is not None:
        listener.leave(tag, value)


@contextlib.contextmanager
def listening(listener: Listener | None) -> Iterator[None]:
    """Route this thread's markers to ``listener`` inside the block."""
    previous = getattr(_local, "listener", None)
    _local.listener = listener
    try:
        yield
    finally:
        _local.listener = previous


def active_listener() -> Listener | None:
    return getattr(_local, "listener", None)


__all__ = ["Listener", "active_listener", "enter", "leave", "listening"]
