"""Overlap (interference) model: how long a phase takes when its channels run concurrently.

A phase of a stage (one micro-batch's forward, its backward, the optimizer step...) keeps up to
four channels busy at once: ``compute``, device-device ``collective`` traffic, ``h2d`` and ``d2h``
copies. Each channel has an amount of work, given as the seconds it would take alone. While
channel B is active, channel A runs ``profile.slowdown[(A, B)]`` times slower (1 if the profile
has no entry); with several other channels active, their factors multiply (a documented choice:
the measured pairs are each a bus or SM contention, and contentions on different resources
compound). Rates are constant between events — an event is a channel finishing — so the
phase is simulated exactly in at most four steps, vectorised over candidates with numpy.

``exposed`` time of a non-compute channel is how long it runs past the end of compute: what a
profile of the phase would show as communication not hidden behind computation.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from mist_compiler.cost.hardware import CHANNELS, HardwareProfile


class OverlapError(ValueError):
    """A bad argument to the overlap model; the message names it."""


@dataclass
class OverlapResult:
    """Per-candidate results of one simulated phase (arrays of equal shape)."""

    total_s: np.ndarray  # the phase's duration: when the last channel finishes
    finish_s: dict[str, np.ndarray]  # channel -> when it finishes (0 for a channel with no work)
    exposed_s: dict[str, np.ndarray]  # non-compute channel -> time it runs past the end of compute
    compute_slowdown_s: np.ndarray  # compute's finish minus its time alone

    @property
    def exposed_total_s(self) -> np.ndarray:
        """Time the phase runs past the end of compute (= total - compute finish)."""
        return self.total_s - self.finish_s["compute"]


def slowdown_matrix(profile: HardwareProfile) -> np.ndarray:
    """``M[i, j] = log(factor by which channel i slows while channel j is active)`` over CHANNELS."""
    matrix = np.zeros((len(CHANNELS), len(CHANNELS)))
    for i, slowed in enumerate(CHANNELS):
        for j, other in enumerate(CHANNELS):
            if i != j:
                matrix[i, j] = np.log(profile.slowdown.get((slowed, other), 1.0))
    return matrix


def _slowdown_table(profile: HardwareProfile) -> np.ndarray:
    """``T[i, mask]``: how much slower channel i runs when the channels in bitmask ``mask`` are active."""
    log_slowdown = slowdown_matrix(profile)
    masks = np.arange(1 << len(CHANNELS))
    active = (masks[None, :] >> np.arange(len(CHANNELS))[:, None]) & 1  # (channel, mask)
    return np.exp(log_slowdown @ active)


def _work(value: ArrayLike, name: str) -> np.ndarray:
    array = np.asarray(value, dtype=float)
    if np.any(~np.isfinite(array)) or np.any(array < 0):
        raise OverlapError(f"{name} must be finite and >= 0 seconds, got {value!r}")
    return array


def overlap(profile: HardwareProfile, compute_s: ArrayLike, collective_s: ArrayLike = 0.0,
            h2d_s: ArrayLike = 0.0, d2h_s: ArrayLike = 0.0) -> OverlapResult:
    """Simulate channels running together; each argument is that channel's time alone (broadcast)."""
    named = {"compute": compute_s, "collective": collective_s, "h2d": h2d_s, "d2h": d2h_s}
    work = np.stack(np.broadcast_arrays(*(_work(named[c], f"{c}_s") for c in CHANNELS)))  # (4, ...)
    table = _slowdown_table(profile)
    bits = 1 << np.arange(len(CHANNELS))
    shape = work.shape[1:]
    work = work.reshape(len(CHANNELS), -1)  # (4, candidates); shapes restored at the end
    remaining = np.where(work > 0, work, np.inf)  # inf marks a channel that is done (or never ran)
    finish = np.zeros_like(work)
    now = np.zeros(work.shape[1])
    for _ in range(len(CHANNELS)):  # every step finishes at least one channel
        active = remaining < np.inf
        if not active.any():
            break
        slow = table[:, bits @ active]  # (4, candidates): product of the active others' factors
        to_finish = remaining * slow
        step = to_finish.min(axis=0)
        step[step == np.inf] = 0.0
        done = to_finish <= step * (1 + 1e-12)
        now += step
        finish = np.where(done, now, finish)
        remaining = np.where(done, np.inf, remaining - step / slow)
    work, finish = work.reshape((len(CHANNELS),) + shape), finish.reshape((len(CHANNELS),) + shape)
    total = finish.max(axis=0)
    compute_finish = finish[0]
    exposed = {c: np.maximum(0.0, finish[i] - compute_finish) for i, c in enumerate(CHANNELS) if c != "compute"}
    return OverlapResult(
        total_s=total,
        finish_s={c: finish[i] for i, c in enumerate(CHANNELS)},
        exposed_s=exposed,
        compute_slowdown_s=compute_finish - work[0],
    )


def overlapped_time(profile: HardwareProfile, compute_s: ArrayLike, collective_s: ArrayLike = 0.0,
                    h2d_s: ArrayLike = 0.0, d2h_s: ArrayLike = 0.0) -> np.ndarray:
    """Duration of a phase whose channels run concurrently (see :func:`overlap`)."""
    return overlap(profile, compute_s, collective_s, h2d_s, d2h_s).total_s


def overlap_where_busy(profile: HardwareProfile, compute, collective, h2d, d2h) -> OverlapResult:
    """The overlap model, run only where a channel besides compute has work (the rest is compute)."""
    compute, collective, h2d, d2h = np.broadcast_arrays(*(np.asarray(x, dtype=float) for x in (compute, collective, h2d, d2h)))
    busy = (collective > 0) | (h2d > 0) | (d2h > 0)
    zeros = np.zeros(compute.shape)
    total = compute.copy()
    finish = {"compute": compute.copy(), "collective": zeros.copy(), "h2d": zeros.copy(), "d2h": zeros.copy()}
    exposed = {"collective": zeros.copy(), "h2d": zeros.copy(), "d2h": zeros.copy()}
    if busy.any():
        part = overlap(profile, compute[busy], collective[busy], h2d[busy], d2h[busy])
        total[busy] = part.total_s
        for name in finish:
            finish[name][busy] = part.finish_s[name]
        for name in exposed:
            exposed[name][busy] = part.exposed_s[name]
    return OverlapResult(total, finish, exposed, finish["compute"] - compute)
