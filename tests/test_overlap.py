"""Overlap model: channels running together, slowed by the profile's pairwise factors."""
from __future__ import annotations

import numpy as np
import pytest

from mist_compiler.cost.hardware import HardwareProfile
from mist_compiler.cost.overlap import OverlapError, overlap, overlapped_time

# FACTS.md: concurrency slowdowns measured on L4.
L4_SLOWDOWN = {"compute|collective": 1.17, "collective|compute": 1.00, "compute|h2d": 1.015,
               "h2d|compute": 1.0005, "compute|d2h": 1.018, "d2h|compute": 1.002,
               "collective|h2d": 1.00, "h2d|collective": 2.14, "collective|d2h": 1.08,
               "d2h|collective": 2.44, "h2d|d2h": 2.43, "d2h|h2d": 1.10}


def make_profile(slowdown: dict[str, float]) -> HardwareProfile:
    return HardwareProfile.from_dict({
        "name": "test", "device_memory_gb": 24.0, "gpus_per_node": 8,
        "peak_tflops": {"bfloat16": 121}, "efficiency": {"default": 0.5},
        "memory_bandwidth_gbps": 300, "h2d_gbps": 5.75, "d2h_gbps": 6.13,
        "collectives": {"1x2": {"bandwidth_gbps": 2.964, "latency_s": 1e-4}},
        "slowdown": slowdown,
    })


@pytest.fixture(scope="module")
def l4() -> HardwareProfile:
    return make_profile(L4_SLOWDOWN)


@pytest.fixture(scope="module")
def no_interference() -> HardwareProfile:
    return make_profile({})


@pytest.mark.parametrize("channel", ["compute_s", "collective_s", "h2d_s", "d2h_s"])
def test_single_channel_takes_its_own_time(l4, channel):
    kwargs = {"compute_s": 0.0, channel: 0.37}
    assert float(overlapped_time(l4, **kwargs)) == pytest.approx(0.37)


def test_without_interference_the_phase_lasts_as_long_as_the_longest_channel(no_interference):
    result = overlap(no_interference, [1.0, 0.2], [0.5, 0.9], [0.25, 0.0], [2.0, 0.1])
    np.testing.assert_allclose(result.total_s, [2.0, 0.9])
    np.testing.assert_allclose(result.exposed_s["d2h"], [1.0, 0.0])
    np.testing.assert_allclose(result.exposed_s["collective"], [0.0, 0.7])
    np.testing.assert_allclose(result.compute_slowdown_s, [0.0, 0.0])


def test_compute_with_collective_hand_computed(l4):
    # Both run for 1 s of work: collective (not slowed) ends at t=1 having let compute do 1/1.17;
    # compute then finishes its remaining 1 - 1/1.17 alone.
    result = overlap(l4, 1.0, 1.0)
    expected = 1.0 + (1.0 - 1.0 / 1.17)
    assert float(result.total_s) == pytest.approx(expected)
    assert float(result.finish_s["collective"]) == pytest.approx(1.0)
    assert float(result.compute_slowdown_s) == pytest.approx(expected - 1.0)
    assert float(result.exposed_total_s) == 0.0


def test_three_channels_multiply_factors_hand_computed(l4):
    # collective 0.1, h2d 0.1, compute 1.0. While all three run: collective slowed by
    # compute(1.00)*h2d(1.00) = 1 -> ends at t=0.1; h2d slowed by 1.0005*2.14 has done
    # 0.1/(1.0005*2.14). Then h2d with compute: slowed by 1.0005.
    # Compute: slowed by 1.17*1.015 until 0.1, then 1.015 until h2d ends, then alone.
    s_h2d_3 = 1.0005 * 2.14
    h2d_left = 0.1 - 0.1 / s_h2d_3
    t_h2d = 0.1 + h2d_left * 1.0005
    compute_done = 0.1 / (1.17 * 1.015) + (t_h2d - 0.1) / 1.015
    expected_total = t_h2d + (1.0 - compute_done)
    result = overlap(l4, 1.0, 0.1, 0.1, 0.0)
    assert float(result.finish_s["collective"]) == pytest.approx(0.1)
    assert float(result.finish_s["h2d"]) == pytest.approx(t_h2d)
    assert float(result.total_s) == pytest.approx(expected_total)


def test_exposed_copy_past_compute(l4):
    # d2h (2 s) outlasts compute (0.5 s): compute slowed by 1.018 ends at 0.509; d2h meanwhile
    # slowed by 1.002 has done 0.509/1.002, the rest runs alone.
    result = overlap(l4, 0.5, 0.0, 0.0, 2.0)
    t_compute = 0.5 * 1.018
    total = t_compute + (2.0 - t_compute / 1.002)
    assert float(result.total_s) == pytest.approx(total)
    assert float(result.exposed_s["d2h"]) == pytest.approx(total - t_compute)


def test_bounds_and_monotonicity(l4):
    rng = np.random.default_rng(0)
    work = rng.uniform(0.0, 1.0, size=(4, 500))
    total = overlapped_time(l4, *work)
    assert np.all(total >= work.max(axis=0) - 1e-12)
    max_factor = np.prod([max(L4_SLOWDOWN.values())] * 3)
    assert np.all(total <= work.sum(axis=0) * max_factor + 1e-12)
    for channel in range(4):
        more = work.copy()
        more[channel] += rng.uniform(0.0, 0.5, size=500)
        assert np.all(overlapped_time(l4, *more) >= total - 1e-12)


def test_vectorised_matches_scalar(l4):
    rng = np.random.default_rng(1)
    work = rng.uniform(0.0, 1.0, size=(4, 20))
    work[1, :5] = 0.0
    together = overlapped_time(l4, *work)
    one_by_one = [float(overlapped_time(l4, *work[:, i])) for i in range(20)]
    np.testing.assert_allclose(together, one_by_one, rtol=1e-12)


def test_broadcasts_scalars_against_arrays(l4):
    total = overlapped_time(l4, np.array([1.0, 2.0, 3.0]), 0.5)
    assert total.shape == (3,)


@pytest.mark.parametrize("field", ["compute_s", "collective_s", "h2d_s", "d2h_s"])
def test_negative_or_nan_work_names_the_channel(l4, field):
    for bad in (-1.0, np.nan):
        with pytest.raises(OverlapError, match=field):
            overlapped_time(l4, **{"compute_s": 1.0, field: bad})


def test_two_dimensional_grids_broadcast(l4):
    compute = np.array([[1.0], [2.0]])
    collective = np.array([[0.0, 1.0, 3.0]])
    total = overlapped_time(l4, compute, collective)
    assert total.shape == (2, 3)
    assert total[0, 0] == pytest.approx(1.0) and total[0, 1] == pytest.approx(2.0 - 1.0 / 1.17)
