"""Collective, p2p and copy times against closed forms computed from FACTS.md's L4 and A100 fits."""
from __future__ import annotations

import numpy as np
import pytest

from mist_compiler.cost.comm import (CommError, collective_seconds, collective_time, copy_time, group_link, group_links,
                                    p2p_time)
from mist_compiler.cost.hardware import HardwareProfile

# FACTS.md "Collective bandwidth fitted on the paper's clusters", L4 column.
L4_FITS = {"1x2": (2.964, 1e-4), "1x4": (4.164, 4e-4), "1x8": (4.683, 3e-4), "2x1": (0.490, 4.5e-3),
           "2x8": (3.322, 1.3e-3), "4x1": (0.461, 1.0e-2), "4x8": (2.966, 3.0e-3)}


def make_profile(fits: dict[str, tuple[float, float]] = L4_FITS) -> HardwareProfile:
    return HardwareProfile.from_dict({
        "name": "test-l4", "device_memory_gb": 24.0, "gpus_per_node": 8,
        "peak_tflops": {"bfloat16": 121}, "efficiency": {"default": 0.5},
        "memory_bandwidth_gbps": 300, "h2d_gbps": 5.75, "d2h_gbps": 6.13,
        "collectives": {shape: {"bandwidth_gbps": bw, "latency_s": lat} for shape, (bw, lat) in fits.items()},
    })


@pytest.fixture(scope="module")
def l4() -> HardwareProfile:
    return make_profile()


@pytest.mark.parametrize("kind, factor", [("all_gather", 1.0), ("reduce_scatter", 1.1), ("all_reduce", 2.1),
                                          ("broadcast", 1.0), ("all_to_all", 1.0)])
@pytest.mark.parametrize("shape", sorted(L4_FITS))
def test_exact_shapes_match_closed_form(l4, kind, factor, shape):
    nodes, gpus = map(int, shape.split("x"))
    bw, lat = L4_FITS[shape]
    n = nodes * gpus
    nbytes = 256e6
    expected = nbytes / (bw * 1e9) * (n - 1) / n * factor + lat
    assert collective_time(l4, kind, nbytes, nodes, gpus) == pytest.approx(expected, rel=1e-12)


def test_all_reduce_of_one_gigabyte_on_eight_l4(l4):
    # 1e9 B / 4.683e9 B/s * 7/8 * 2.1 + 3e-4 s
    assert float(collective_time(l4, "all_reduce", 1e9, 1, 8)) == pytest.approx(0.392679, rel=1e-5)


def test_single_device_and_zero_bytes_cost_nothing(l4):
    times = collective_time(l4, "all_reduce", [1e9, 0.0, 1e9], [1, 2, 2], [1, 8, 8])
    assert times[0] == 0.0 and times[1] == 0.0 and times[2] > 0.0
    bandwidth, latency = group_link(l4, 1, 1)
    assert np.isinf(bandwidth) and latency == 0.0


def test_vectorised_equals_scalar_calls(l4):
    nodes = np.array([1, 1, 1, 2, 4, 3, 8, 1])
    gpus = np.array([2, 3, 8, 8, 1, 4, 8, 16])
    nbytes = np.linspace(1e6, 1e9, len(nodes))
    together = collective_time(l4, "reduce_scatter", nbytes, nodes, gpus)
    one_by_one = [float(collective_time(l4, "reduce_scatter", b, n, g)) for b, n, g in zip(nbytes, nodes, gpus)]
    assert together.shape == nodes.shape
    np.testing.assert_allclose(together, one_by_one, rtol=1e-12)


def test_links_looked_up_once_give_collective_time_exactly(l4):
    # the stage model looks a stage's group links up once for its gathers, reductions and all-reduces
    nodes = np.array([1, 1, 1, 2, 4, 3, 8, 1])
    gpus = np.array([1, 3, 8, 8, 1, 4, 8, 16])
    nbytes = np.array([5e8, 0.0, 1e6, 1e9, 3e7, 2e8, 1e9, 4e5])
    links = group_links(l4, nodes, gpus)
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        np.testing.assert_array_equal(collective_seconds(l4, kind, nbytes, links),
                                      collective_time(l4, kind, nbytes, nodes, gpus))
    with pytest.raises(CommError, match="p2p"):
        collective_seconds(l4, "p2p", nbytes, links)


def test_intra_node_interpolates_in_log2_gpus(l4):
    # 1x3 lies at log2(3) between 1x2 and 1x4
    weight = np.log2(3) - 1
    bandwidth, latency = group_link(l4, 1, 3)
    assert bandwidth == pytest.approx(((1 - weight) * 2.964 + weight * 4.164) * 1e9)
    assert latency == pytest.approx((1 - weight) * 1e-4 + weight * 4e-4)


def test_beyond_largest_shape_keeps_bandwidth_and_scales_latency(l4):
    bandwidth, latency = group_link(l4, 1, 16)
    assert bandwidth == pytest.approx(4.683e9) and latency == pytest.approx(3e-4 * 2)
    bandwidth, latency = group_link(l4, 16, 8)
    assert bandwidth == pytest.approx(2.966e9) and latency == pytest.approx(3.0e-3 * 4)


def test_inter_node_interpolates_nodes_then_gpus(l4):
    # 2x4: between 2x1 and 2x8 at log2(4)/log2(8) = 2/3 of the way
    bandwidth, latency = group_link(l4, 2, 4)
    assert bandwidth == pytest.approx((0.490 + 2 / 3 * (3.322 - 0.490)) * 1e9)
    assert latency == pytest.approx(4.5e-3 + 2 / 3 * (1.3e-3 - 4.5e-3))
    # 3x8: halfway between 2x8 and 4x8 in log2(nodes)? log2(3) - 1 of the way
    weight = np.log2(3) - 1
    bandwidth, _ = group_link(l4, 3, 8)
    assert bandwidth == pytest.approx(((1 - weight) * 3.322 + weight * 2.966) * 1e9)


def test_more_devices_never_cost_less_latency_in_measured_range(l4):
    _, latency = group_link(l4, np.array([2, 3, 4, 8]), 1)
    assert np.all(np.diff(latency) >= 0)


def test_profile_with_only_intra_node_fits_answers_inter_node_groups():
    profile = make_profile({"1x2": (10.0, 1e-5), "1x4": (20.0, 2e-5)})
    bandwidth, latency = group_link(profile, 2, 2)  # four devices -> the 1x4 fit
    assert bandwidth == pytest.approx(20e9) and latency == pytest.approx(2e-5)


def test_p2p_uses_pair_links(l4):
    times = p2p_time(l4, np.array([1e8, 1e8, 0.0]), np.array([False, True, True]))
    np.testing.assert_allclose(times, [1e8 / 2.964e9 + 1e-4, 1e8 / 0.490e9 + 4.5e-3, 0.0])


def test_copy_time_uses_pinned_rates(l4):
    np.testing.assert_allclose(copy_time(l4, [5.75e9, 0.0], "h2d"), [1.0, 0.0])
    assert float(copy_time(l4, 6.13e9, "d2h")) == pytest.approx(1.0)


@pytest.mark.parametrize("call, field", [
    (lambda p: collective_time(p, "all_sum", 1e6, 1, 2), "all_sum"),
    (lambda p: collective_time(p, "p2p", 1e6, 1, 2), "p2p"),
    (lambda p: collective_time(p, "all_gather", -1.0, 1, 2), "nbytes"),
    (lambda p: collective_time(p, "all_gather", 1e6, 0, 2), "nodes"),
    (lambda p: collective_time(p, "all_gather", 1e6, 1, 1.5), "gpus_per_node"),
    (lambda p: copy_time(p, 1e6, "h2h"), "h2h"),
    (lambda p: p2p_time(p, np.nan, False), "nbytes"),
])
def test_bad_arguments_are_named(l4, call, field):
    with pytest.raises(CommError, match=field):
        call(l4)


def test_grids_keep_their_shape(l4):
    times = collective_time(l4, "all_gather", np.array([[1e6], [1e8]]), np.array([[1, 2, 4]]), 8)
    assert times.shape == (2, 3)
    assert times[1, 1] == pytest.approx(1e8 / 3.322e9 * 15 / 16 + 1.3e-3)


@pytest.mark.parametrize("name", ["l4", "a100-40gb", "a100-80gb", "h100-80gb", "h200", "v100-32gb", "cpu"])
def test_every_shipped_profile_gives_finite_monotone_times(name):
    from mist_compiler.cost.hardware import load_profile

    profile = load_profile(name)
    nodes, gpus = np.meshgrid([1, 2, 3, 4, 8, 16, 64], [1, 2, 4, 8])
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all"):
        small = collective_time(profile, kind, 1e6, nodes, gpus)
        large = collective_time(profile, kind, 1e9, nodes, gpus)
        assert np.all(np.isfinite(large)) and np.all(large >= small) and np.all(large[nodes * gpus > 1] > 0)
    assert np.all(np.diff(p2p_time(profile, [0.0, 1e6, 1e9], True)) > 0)
