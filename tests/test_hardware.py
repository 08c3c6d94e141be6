"""Hardware profiles: every shipped profile loads and is sane; every malformed field is named."""
from __future__ import annotations

import copy

import pytest
import yaml

from mist_compiler.cost.hardware import (
    CHANNELS,
    PROFILE_DIR,
    HardwareProfile,
    ProfileError,
    load_profile,
    save_profile,
    shipped_profiles,
)

SHIPPED = ["a100-40gb", "a100-80gb", "cpu", "h100-80gb", "h200", "l4", "v100-32gb"]
OP_CLASSES = ("matmul", "attention", "elementwise", "reduction", "default")


def test_all_expected_profiles_ship():
    assert set(SHIPPED) <= set(shipped_profiles())


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profile_loads_and_is_complete(name):
    profile = load_profile(name)
    assert profile.name == name
    assert all(op in profile.efficiency for op in OP_CLASSES)
    assert profile.description.strip()
    assert profile.memory_bandwidth > 0 and profile.device_memory > 1e9
    for (nodes, gpus), fit in profile.links.items():
        assert 1 <= gpus <= profile.gpus_per_node and nodes * gpus > 1
        assert fit.bandwidth > 0 and fit.latency >= 0
    assert all(a in CHANNELS and b in CHANNELS for a, b in profile.slowdown)


@pytest.mark.parametrize("name", ["a100-80gb", "h100-80gb", "h200", "v100-32gb"])
def test_profiles_without_measured_fits_say_they_are_estimates(name):
    assert "ESTIMATE" in load_profile(name).description


def test_l4_carries_the_measured_facts():
    l4 = load_profile("l4")
    assert l4.links[(2, 8)].bandwidth == pytest.approx(3.322e9) and l4.links[(4, 1)].latency == pytest.approx(1e-2)
    assert l4.slowdown[("compute", "collective")] == pytest.approx(1.17)
    assert l4.slowdown[("d2h", "collective")] == pytest.approx(2.44)
    assert l4.h2d_bandwidth == pytest.approx(5.75e9) and l4.collective_factor["all_reduce"] == pytest.approx(2.1)


def test_h100_matmul_efficiency_is_the_measured_fraction():
    h100 = load_profile("h100-80gb")
    assert h100.efficiency_of("matmul") * h100.peak_flops["bfloat16"] == pytest.approx(798e12, rel=0.01)
    assert h100.efficiency_of("no-such-class") == h100.efficiency["default"]


@pytest.mark.parametrize("name", SHIPPED)
def test_save_and_load_round_trip(tmp_path, name):
    profile = load_profile(name)
    path = tmp_path / f"{name}.yaml"
    save_profile(profile, str(path))
    assert load_profile(str(path)) == profile


def test_adam_rate_is_measured_or_the_fused_kernel_roofline(l4_data):
    from mist_compiler.cost.hardware import DEFAULT_HOST_ADAM_PARAMS_PER_S, FUSED_ADAM_BYTES_PER_PARAM

    l4 = HardwareProfile.from_dict(l4_data)
    assert l4.device_adam_params_per_s == pytest.approx(l4.memory_bandwidth / FUSED_ADAM_BYTES_PER_PARAM)
    assert l4.host_adam_params_per_s == DEFAULT_HOST_ADAM_PARAMS_PER_S
    measured = HardwareProfile.from_dict({**l4_data, "optimizer_gparams_per_s": 2.5, "host_optimizer_gparams_per_s": 0.3})
    assert measured.device_adam_params_per_s == pytest.approx(2.5e9)
    assert measured.host_adam_params_per_s == pytest.approx(0.3e9)
    assert HardwareProfile.from_dict(measured.to_dict()) == measured
    cpu = load_profile("cpu")  # measured: the backend's torch AdamW on one core
    assert cpu.device_adam_params_per_s == cpu.optimizer_params_per_s > 0


def test_unknown_profile_lists_the_shipped_ones():
    with pytest.raises(ProfileError, match="l4"):
        load_profile("no-such-gpu")


def test_invalid_yaml_is_reported(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("name: [unclosed\n")
    with pytest.raises(ProfileError, match="not valid YAML"):
        load_profile(str(path))


def _set(data: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        data = data[key]
    if value is _DELETE:
        del data[last]
    else:
        data[last] = value


_DELETE = object()
# (path to change, new value, text the error must contain)
MALFORMED = [
    ("name", "", "name"),
    ("name", 7, "name"),
    ("description", ["x"], "description"),
    ("device_memory_gb", -1, "device_memory_gb"),
    ("device_memory_gb", "24", "device_memory_gb"),
    ("device_memory_gb", _DELETE, "device_memory_gb"),
    ("memory_headroom_gb", -1.0, "memory_headroom_gb"),
    ("memory_headroom_gb", 1000.0, "memory_headroom_gb"),
    ("memory_headroom_gb", "2", "memory_headroom_gb"),
    ("gpus_per_node", 0, "gpus_per_node"),
    ("gpus_per_node", 2.5, "gpus_per_node"),
    ("gpus_per_node", True, "gpus_per_node"),
    ("peak_tflops", {}, "peak_tflops"),
    ("peak_tflops", {"int8": 100}, "peak_tflops"),
    ("peak_tflops.bfloat16", 0, "peak_tflops.bfloat16"),
    ("peak_tflops.float32", None, "peak_tflops.float32"),
    ("efficiency", {}, "efficiency"),
    ("efficiency.matmul", 1.5, "efficiency.matmul"),
    ("efficiency.matmul", 0, "efficiency.matmul"),
    ("efficiency.matmul", True, "efficiency.matmul"),
    ("memory_bandwidth_gbps", 0, "memory_bandwidth_gbps"),
    ("memory_bandwidth_gbps", float("inf"), "memory_bandwidth_gbps"),
    ("collectives", {}, "collectives"),
    ("collectives.2x8.bandwidth_gbps", -3, "collectives.2x8.bandwidth_gbps"),
    ("collectives.2x8.latency_s", -1e-3, "collectives.2x8.latency_s"),
    ("collectives.2x8.latency_s", "fast", "collectives.2x8.latency_s"),
    ("collectives.2x8.latency_s", _DELETE, "collectives.2x8"),
    ("collectives.2x8.extra", 1, "collectives.2x8"),
    ("collectives.8", {"bandwidth_gbps": 1, "latency_s": 0}, "collectives.8"),
    ("collectives.0x2", {"bandwidth_gbps": 1, "latency_s": 0}, "collectives.0x2"),
    ("collectives.1x1", {"bandwidth_gbps": 1, "latency_s": 0}, "collectives.1x1"),
    ("collectives.1x16", {"bandwidth_gbps": 1, "latency_s": 0}, "collectives.1x16"),
    ("collectives.1X2", {"bandwidth_gbps": 1, "latency_s": 0}, "collectives.1X2"),
    ("collective_factor", [2.1], "collective_factor"),
    ("collective_factor.all_sum", 2.0, "collective_factor.all_sum"),
    ("collective_factor.all_reduce", 0, "collective_factor.all_reduce"),
    ("h2d_gbps", 0, "h2d_gbps"),
    ("d2h_gbps", None, "d2h_gbps"),
    ("d2h_gbps", _DELETE, "d2h_gbps"),
    ("slowdown", "fast", "slowdown"),
    ("slowdown.compute|collective", 0.9, "slowdown.compute|collective"),
    ("slowdown.compute|collective", False, "slowdown.compute|collective"),
    ("slowdown.compute|network", 1.1, "slowdown.compute|network"),
    ("slowdown.compute", 1.1, "slowdown.compute"),
    ("slowdown.compute|compute", 1.1, "slowdown.compute|compute"),
    ("op_overhead_s", -1e-6, "op_overhead_s"),
    ("op_overhead_s", "5us", "op_overhead_s"),
    ("reduce_scatter_copies", -1, "reduce_scatter_copies"),
    ("reduce_scatter_copies", "one", "reduce_scatter_copies"),
    ("optimizer_gparams_per_s", 0, "optimizer_gparams_per_s"),
    ("host_optimizer_gparams_per_s", "fast", "host_optimizer_gparams_per_s"),
    ("unknown_field", 1, "unknown_field"),
]


@pytest.fixture(scope="module")
def l4_data() -> dict:
    with open(f"{PROFILE_DIR}/l4.yaml") as handle:
        return yaml.safe_load(handle)


@pytest.mark.parametrize("field, value, named", MALFORMED,
                         ids=[f"{f}=<deleted>" if v is _DELETE else f"{f}={v!r}" for f, v, _ in MALFORMED])
def test_malformed_field_is_named(l4_data, field, value, named):
    data = copy.deepcopy(l4_data)
    _set(data, field, value)
    with pytest.raises(ProfileError, match=named.replace("|", r"\|")):
        HardwareProfile.from_dict(data)


@pytest.mark.parametrize("document", [None, [], "l4"])
def test_top_level_must_be_a_mapping(document):
    with pytest.raises(ProfileError, match="mapping"):
        HardwareProfile.from_dict(document, source="x.yaml")


def test_shipped_gpu_profiles_keep_the_default_headroom_free():
    from mist_compiler.cost.hardware import default_memory_headroom

    for name in ("l4", "a100-40gb", "a100-80gb", "h100-80gb", "h200", "v100-32gb"):
        profile = load_profile(name)
        assert profile.memory_headroom == pytest.approx(default_memory_headroom(profile.device_memory), abs=1e6), name
        assert profile.usable_memory == profile.device_memory - profile.memory_headroom
    assert load_profile("cpu").memory_headroom == 0.0
    # closed form: 1.25 GB fixed + 5% of the rest; on an 85 GB H100 that leaves 79.56 GB
    assert load_profile("h100-80gb").usable_memory == pytest.approx(85e9 - (1.25e9 + 0.05 * 83.75e9), rel=1e-4)


def test_memory_limit_parsing_and_override():
    from mist_compiler.cost.hardware import ProfileError, parse_memory, with_memory_limit

    assert parse_memory("70") == parse_memory("70GB") == 70e9
    assert parse_memory("64GiB") == 64 * 2 ** 30 and parse_memory("1500 MB") == 1.5e9
    for bad in ("", "-3GB", "lots", "0"):
        with pytest.raises(ProfileError, match="memory limit"):
            parse_memory(bad)
    h100 = load_profile("h100-80gb")
    limited = with_memory_limit(h100, "40GB")
    assert limited.usable_memory == 40e9 and with_memory_limit(h100, None) is h100
    assert HardwareProfile.from_dict(h100.to_dict()).memory_headroom == h100.memory_headroom


def test_tune_command_defaults_to_bf16_and_applies_the_memory_limit():
    import argparse

    from mist_compiler.cli.tune import add_arguments, hardware_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["gpt-tiny", "--hardware", "l4", "--nodes", "1", "--gpus-per-node", "2", "--global-batch", "8"]
    args = parser.parse_args(base + ["--memory-limit", "10GB"])
    assert args.dtype == "bfloat16"
    assert hardware_from_args(args).usable_memory == 10e9
    assert hardware_from_args(parser.parse_args(base)) == "l4"


def test_compiled_pointwise_rates_round_trip_and_bad_ones_are_named(tmp_path):
    import dataclasses

    from mist_compiler.cost.hardware import HardwareProfile, ProfileError, load_profile, save_profile

    profile = dataclasses.replace(load_profile("cpu"), compiled_pointwise_ns={"gelu": 0.29, "silu_backward": 0.04})
    path = tmp_path / "p.yaml"
    save_profile(profile, str(path))
    assert load_profile(str(path)).compiled_pointwise_ns == {"gelu": 0.29, "silu_backward": 0.04}
    data = {**profile.to_dict(), "compiled_pointwise_ns": {"gelu": -1}}
    with pytest.raises(ProfileError, match="compiled_pointwise_ns"):
        HardwareProfile.from_dict(data)
