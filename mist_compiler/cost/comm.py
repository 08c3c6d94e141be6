"""Collective, point-to-point and host<->device copy times from a hardware profile (vectorised).

Every function takes scalars or numpy arrays (broadcast against each other) and returns float
arrays, so the cost model evaluates all tuner candidates in one call.

Alpha-beta model (FACTS.md): for a group of ``n = nodes * gpus_per_node`` devices,
``time = nbytes / bandwidth * (n-1)/n * factor[kind] + latency``, and 0 when ``n == 1`` or
``nbytes == 0`` (no collective happens). ``nbytes`` is the size of the full, unsharded buffer:
the output of an all-gather, the input of a reduce-scatter, the buffer of an all-reduce.

Group shapes the profile does not list are derived from the ones it does (:func:`group_link`):

* ``nodes == 1`` (intra-node): interpolate bandwidth and latency linearly in ``log2(gpus)``
  between the profile's ``1xG`` fits. Below the smallest measured shape, take its values;
  above the largest, keep its bandwidth and scale its latency by ``gpus / G_max`` (a ring's
  latency grows with its number of steps).
* ``nodes > 1`` (inter-node): for each measured gpus-per-node ``g`` with ``NxG`` fits,
  interpolate in ``log2(nodes)`` as above (latency scales by ``nodes / N_max`` past the largest
  node count), then interpolate those per-``g`` values in ``log2(gpus_per_node)`` (clamped).
* If the profile has no fit of that kind at all (e.g. a single-node profile asked about two
  nodes), the fits of the other kind stand in, keyed by the total device count.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from mist_compiler.cost.hardware import COLLECTIVES, HardwareProfile

COPY_DIRECTIONS = ("h2d", "d2h")


class CommError(ValueError):
    """A bad argument to the communication model; the message names it."""


@dataclass(frozen=True)
class _Curve:
    """Fits along one axis: sorted log2 positions with bandwidth (bytes/s) and latency (s)."""

    log2_size: np.ndarray
    bandwidth: np.ndarray
    latency: np.ndarray

    def at(self, size: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = np.log2(np.maximum(size, 1.0))
        bandwidth = np.interp(x, self.log2_size, self.bandwidth)
        latency = np.interp(x, self.log2_size, self.latency)
        largest = 2.0 ** self.log2_size[-1]
        latency = np.where(size > largest, latency * size / largest, latency)
        return bandwidth, latency


def _curve(points: list[tuple[int, float, float]]) -> _Curve:
    points = sorted(points)
    return _Curve(
        log2_size=np.log2(np.array([p[0] for p in points], dtype=float)),
        bandwidth=np.array([p[1] for p in points], dtype=float),
        latency=np.array([p[2] for p in points], dtype=float),
    )


def _intra_curve(profile: HardwareProfile) -> _Curve | None:
    points = [(g, fit.bandwidth, fit.latency) for (n, g), fit in profile.links.items() if n == 1 and g > 1]
    return _curve(points) if points else None


def _inter_curves(profile: HardwareProfile) -> dict[int, _Curve]:
    by_gpus: dict[int, list[tuple[int, float, float]]] = {}
    for (n, g), fit in profile.links.items():
        if n > 1:
            by_gpus.setdefault(g, []).append((n, fit.bandwidth, fit.latency))
    return {g: _curve(points) for g, points in sorted(by_gpus.items())}


def _as_sizes(value: ArrayLike, name: str) -> np.ndarray:
    array = np.asarray(value, dtype=float)
    if np.any(~np.isfinite(array)) or np.any(array < 1) or np.any(array != np.round(array)):
        raise CommError(f"{name} must be positive integers, got {value!r}")
    return array


def _nbytes(value: ArrayLike) -> np.ndarray:
    array = np.asarray(value, dtype=float)
    if np.any(~np.isfinite(array)) or np.any(array < 0):
        raise CommError(f"nbytes must be finite and >= 0, got {value!r}")
    return array


def _inter_link(curves: dict[int, _Curve], nodes: np.ndarray, gpus: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Interpolate each measured gpus-per-node curve at ``nodes``, then across gpus-per-node."""
    measured_gpus = np.array(sorted(curves), dtype=float)
    per_g = [curves[int(g)].at(nodes) for g in measured_gpus]
    bandwidth_rows = np.stack([np.broadcast_to(b, nodes.shape) for b, _ in per_g])  # (G, ...)
    latency_rows = np.stack([np.broadcast_to(l, nodes.shape) for _, l in per_g])
    if len(measured_gpus) == 1:
        return bandwidth_rows[0], latency_rows[0]
    x = np.clip(np.log2(gpus), np.log2(measured_gpus[0]), np.log2(measured_gpus[-1]))
    upper = np.clip(np.searchsorted(np.log2(measured_gpus), x, side="right"), 1, len(measured_gpus) - 1)
    lower = upper - 1
    x_lo, x_hi = np.log2(measured_gpus)[lower], np.log2(measured_gpus)[upper]
    weight = (x - x_lo) / (x_hi - x_lo)
    pick = lambda rows, index: np.take_along_axis(rows, index[None, ...], axis=0)[0]  # noqa: E731
    bandwidth = (1 - weight) * pick(bandwidth_rows, lower) + weight * pick(bandwidth_rows, upper)
    latency = (1 - weight) * pick(latency_rows, lower) + weight * pick(latency_rows, upper)
    return bandwidth, latency


def group_link(profile: HardwareProfile, nodes: ArrayLike, gpus_per_node: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """(bandwidth bytes/s, latency s) of a collective group of shape ``nodes x gpus_per_node``.

    Exact fits come from ``profile.links``; other shapes follow the rules in the module docstring.
    A group of one device gets infinite bandwidth and zero latency.
    """
    nodes_a, gpus_a = np.broadcast_arrays(_as_sizes(nodes, "nodes"), _as_sizes(gpus_per_node, "gpus_per_node"))
    # Candidates share few distinct shapes: solve each shape once, then scatter back.
    width = float(gpus_a.max(initial=1.0)) + 1.0
    keys, inverse = np.unique(nodes_a * width + gpus_a, return_inverse=True)
    nodes_u, gpus_u = np.floor(keys / width), np.mod(keys, width)
    known = profile.derived.setdefault("group_links", {})  # per (nodes, gpus): a profile's links never change
    missing = [i for i, pair in enumerate(zip(nodes_u, gpus_u)) if pair not in known]
    if missing:
        fresh = _link_of_shapes(profile, nodes_u[missing], gpus_u[missing])
        for j, i in enumerate(missing):
            known[(nodes_u[i], gpus_u[i])] = (fresh[0][j], fresh[1][j])
    bandwidth = np.array([known[pair][0] for pair in zip(nodes_u, gpus_u)], dtype=float)
    latency = np.array([known[pair][1] for pair in zip(nodes_u, gpus_u)], dtype=float)
    inverse = inverse.reshape(nodes_a.shape)
    return bandwidth[inverse], latency[inverse]


def _link_of_shapes(profile: HardwareProfile, nodes_a: np.ndarray, gpus_a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    intra, inter = _intra_curve(profile), _inter_curves(profile)
    total = nodes_a * gpus_a
    bandwidth = np.full(nodes_a.shape, np.inf)
    latency = np.zeros(nodes_a.shape)

    single_node = (nodes_a == 1) & (total > 1)
    if single_node.any():
        if intra is not None:
            b, l = intra.at(gpus_a)
        else:  # only inter-node fits: use the one-gpu-per-node curve keyed by device count
            b, l = _inter_link(inter, total, np.ones_like(total))
        bandwidth = np.where(single_node, b, bandwidth)
        latency = np.where(single_node, l, latency)
    multi_node = nodes_a > 1
    if multi_node.any():
        if inter:
            b, l = _inter_link(inter, nodes_a, gpus_a)
        else:  # only intra-node fits: treat the group as that many devices in one node
            b, l = intra.at(total)
        bandwidth = np.where(multi_node, b, bandwidth)
        latency = np.where(multi_node, l, latency)

    for (n, g), fit in profile.links.items():  # exact fits win over interpolation
        exact = (nodes_a == n) & (gpus_a == g)
        bandwidth = np.where(exact, fit.bandwidth, bandwidth)
        latency = np.where(exact, fit.latency, latency)
    return bandwidth, latency


@dataclass(frozen=True)
class GroupLinks:
    """The links of a set of collective groups, looked up once (:func:`group_links`) for several
    collectives over the same groups (a stage prices its gathers, reductions and all-reduces)."""

    devices: np.ndarray  # nodes * gpus_per_node of each group
    bandwidth: np.ndarray
    latency: np.ndarray


def group_links(profile: HardwareProfile, nodes: ArrayLike, gpus_per_node: ArrayLike) -> GroupLinks:
    """:func:`group_link` of ``nodes x gpus_per_node`` groups, with their sizes, for :func:`collective_seconds`."""
    nodes_a, gpus_a = np.broadcast_arrays(_as_sizes(nodes, "nodes"), _as_sizes(gpus_per_node, "gpus_per_node"))
    return GroupLinks(nodes_a * gpus_a, *group_link(profile, nodes_a, gpus_a))


def _collective_kind(kind: str) -> None:
    if kind not in COLLECTIVES or kind == "p2p":
        raise CommError(f"collective kind {kind!r} unknown; use one of {[k for k in COLLECTIVES if k != 'p2p']} (p2p_time for p2p)")


def collective_seconds(profile: HardwareProfile, kind: str, nbytes: ArrayLike, links: GroupLinks) -> np.ndarray:
    """:func:`collective_time` over groups whose links were looked up already."""
    _collective_kind(kind)
    size = _nbytes(nbytes)
    n = links.devices
    time = size / links.bandwidth * (n - 1) / n * profile.collective_factor[kind] + links.latency
    return np.where((n > 1) & (size > 0), time, 0.0)


def collective_time(profile: HardwareProfile, kind: str, nbytes: ArrayLike, nodes: ArrayLike,
                    gpus_per_node: ArrayLike) -> np.ndarray:
    """Seconds for collective ``kind`` over ``nbytes`` (full buffer) in a ``nodes x gpus_per_node`` group."""
    _collective_kind(kind)
    return collective_seconds(profile, kind, nbytes, group_links(profile, nodes, gpus_per_node))


def p2p_time(profile: HardwareProfile, nbytes: ArrayLike, inter_node: ArrayLike) -> np.ndarray:
    """Seconds to send ``nbytes`` from one device to another (pipeline activations).

    Uses the two-device link (``1x2`` intra-node, ``2x1`` across nodes): a pair's alpha-beta
    bandwidth is the per-link rate, so the time is ``nbytes / bandwidth * factor['p2p'] + latency``.
    """
    size, inter = np.broadcast_arrays(_nbytes(nbytes), np.asarray(inter_node, dtype=bool))
    nodes = np.where(inter, 2, 1)
    gpus = np.where(inter, 1, 2)
    bandwidth, latency = group_link(profile, nodes, gpus)
    time = size / bandwidth * profile.collective_factor["p2p"] + latency
    return np.where(size > 0, time, 0.0)


def copy_time(profile: HardwareProfile, nbytes: ArrayLike, direction: str) -> np.ndarray:
    """Seconds to copy ``nbytes`` between pinned host memory and the device ("h2d" or "d2h")."""
    if direction not in COPY_DIRECTIONS:
        raise CommError(f"copy direction {direction!r} unknown; use one of {list(COPY_DIRECTIONS)}")
    bandwidth = profile.h2d_bandwidth if direction == "h2d" else profile.d2h_bandwidth
    return _nbytes(nbytes) / bandwidth


def group_shapes(tp: np.ndarray, dp: np.ndarray, nodes: np.ndarray, gpus_per_node: np.ndarray):
    """(tp group nodes, gpus per node), (dp group nodes, gpus per node): TP packed inside nodes."""
    tp_in_node = tp <= gpus_per_node
    tp_nodes = np.where(tp_in_node, 1, np.maximum(tp // np.maximum(gpus_per_node, 1), 1))
    tp_gpus = np.where(tp_in_node, tp, gpus_per_node)
    dp_nodes = np.where(tp_in_node, nodes, dp)
    dp_gpus = np.where(tp_in_node, np.maximum(gpus_per_node // np.maximum(tp, 1), 1), 1)
    dp_nodes = np.where(tp_in_node, np.maximum(dp // dp_gpus, 1), dp_nodes)
    return (tp_nodes, tp_gpus), (dp_nodes, dp_gpus)
