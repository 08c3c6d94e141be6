"""GEMM rates by shape: the closed form, its fit from timings, and its use by the stage model."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mist_compiler.cost.hardware import HardwareProfile, MatmulShapeModel, ProfileError, load_profile
from mist_compiler.cost.matmul_shapes import GPU_SHAPES, fit_shape_model, predicted_seconds
from mist_compiler.cost.op_time import gemm_intensity, matmul_time, op_class_time


def test_h100_shape_model_gives_back_the_measured_large_gemm_rate():
    """FACTS.md: 798 TFLOP/s for 8192^3 bf16 on H100; smaller and skinnier GEMMs run slower per FLOP."""
    held = load_profile("h100-80gb")
    h100 = dataclasses.replace(held, sustained_compute=1.0)  # the short benchmark's rates
    rates = {}
    for m, n, k in ((8192, 8192, 8192), (2048, 2048, 2048), (512, 512, 512), (8192, 128, 16384)):
        flops = 2.0 * m * n * k
        rates[(m, n, k)] = flops / float(matmul_time(h100, "bfloat16", flops, 2.0 * (m * k + k * n + m * n)))
    assert rates[(8192, 8192, 8192)] == pytest.approx(798e12, rel=0.01)
    flops = 2.0 * 8192 ** 3  # through a training step, the rate the GPU holds at its power limit
    assert flops / float(matmul_time(held, "bfloat16", flops, 6.0 * 8192 ** 2)) == pytest.approx(
        798e12 * held.sustained_compute, rel=0.01)
    assert rates[(8192, 8192, 8192)] > rates[(2048, 2048, 2048)] > rates[(512, 512, 512)]
    skinny_bytes = 2.0 * (8192 * 16384 + 16384 * 128 + 8192 * 128)
    assert rates[(8192, 128, 16384)] == pytest.approx(2.0 * 8192 * 128 * 16384 / (skinny_bytes / h100.memory_bandwidth
                                                                                   + h100.matmul_model.tail_s))


def test_closed_form_twin_matches_the_op_time_model():
    h100 = dataclasses.replace(load_profile("h100-80gb"), sustained_compute=1.0)  # the twin prices benchmark rates
    m, n, k = np.array([8192, 1024, 4096, 300]), np.array([8192, 128, 11008, 77]), np.array([4096, 8192, 4096, 5000])
    flops, nbytes = 2.0 * m * n * k, 2.0 * (m * k + k * n + m * n)
    assert np.allclose(gemm_intensity(flops, nbytes, 2.0), m * n * k / (m * k + k * n + m * n))
    twin = predicted_seconds(h100.matmul_model, m, n, k, h100.peak_flops["bfloat16"], h100.memory_bandwidth, 2.0)
    assert np.allclose(matmul_time(h100, "bfloat16", flops, nbytes), twin, rtol=1e-12)


def test_fit_recovers_a_shape_model_from_its_own_timings():
    truth = MatmulShapeModel(0.7, 90.0, 1.2e-5)
    peak, bandwidth = 989e12, 3.0e12
    m, n, k = (np.array([s[i] for s in GPU_SHAPES]) for i in range(3))
    seconds = predicted_seconds(truth, m, n, k, peak, bandwidth, 2.0)
    points = [(int(a), int(b), int(c), float(2.0 * a * b * c / t / peak)) for a, b, c, t in zip(m, n, k, seconds)]
    fitted = fit_shape_model(points, peak, bandwidth, 2.0)
    again = predicted_seconds(fitted, m, n, k, peak, bandwidth, 2.0)
    assert np.allclose(again, seconds, rtol=0.05)
    assert fitted.peak_efficiency == pytest.approx(0.7, rel=0.05)


def test_without_a_shape_model_gemms_run_at_the_class_efficiency():
    l4 = load_profile("l4")
    assert l4.matmul_model is None
    assert float(matmul_time(l4, "float16", 1e12, 1e9)) == float(op_class_time(l4, "float16", "matmul", 1e12, 1e9))


def test_stage_model_prices_each_gemm_by_its_shape():
    """A flat shape model (no intensity penalty, no tail) reproduces the class-level price; the H100
    model makes the same stage slower (GEMMs of a tiny model are small and pay their tails)."""
    from mist_compiler.cost.stage_api import StageCandidates
    from mist_compiler.cost.stage_model import build_stage_cost_model
    from mist_compiler.driver import capture

    h100 = load_profile("h100-80gb")
    plain = dataclasses.replace(h100, matmul_model=None)
    flat = dataclasses.replace(h100, matmul_model=MatmulShapeModel(h100.efficiency["matmul"], 0.0, 0.0))
    stage = StageCandidates(num_layers=4, has_pre=True, has_post=True, nodes=1, gpus_per_node=1, micro_batch=2, dp=1,
                            tp=1, zero=0, ckpt_layers=0, offload_weights=0.0, offload_grads=0.0, offload_opt=0.0,
                            offload_acts=0.0, inflight=1)
    times = {}
    program = capture("gpt-tiny", seq_len=128, dtype="bfloat16")
    for name, profile in (("plain", plain), ("flat", flat), ("shaped", h100)):
        model = build_stage_cost_model(program, profile, seq_len=128)
        times[name] = float(model.evaluate(stage).breakdown["compute"][0])
    assert times["flat"] == pytest.approx(times["plain"], rel=1e-9)
    assert times["shaped"] > times["plain"]


@pytest.mark.parametrize("field,value,named", [
    ({"peak_efficiency": 1.5, "half_intensity": 1.0, "tail_s": 0.0}, None, "matmul_shape_model.peak_efficiency"),
    ({"peak_efficiency": 0.5, "half_intensity": -1.0, "tail_s": 0.0}, None, "matmul_shape_model.half_intensity"),
    ({"peak_efficiency": 0.5, "half_intensity": 1.0}, None, "matmul_shape_model"),
])
def test_bad_shape_model_fields_are_named(field, value, named):
    data = load_profile("h100-80gb").to_dict()
    data["matmul_shape_model"] = field
    with pytest.raises(ProfileError, match=named.replace(".", r"\.")):
        HardwareProfile.from_dict(data)


def test_bad_mfu_ceiling_and_shape_points_are_named():
    data = load_profile("h100-80gb").to_dict()
    with pytest.raises(ProfileError, match="mfu_ceiling"):
        HardwareProfile.from_dict({**data, "mfu_ceiling": 1.5})
    with pytest.raises(ProfileError, match=r"matmul_shapes\[0\]"):
        HardwareProfile.from_dict({**data, "matmul_shapes": [[1, 2, 0, 0.5]]})


def test_predicted_mfu_above_the_hardware_ceiling_is_flagged():
    """A profile claiming that published runs reach only 0.001% MFU makes any plan suspicious."""
    from mist_compiler import tune
    from mist_compiler.tuner.report import format_result

    doubtful = dataclasses.replace(load_profile("h100-80gb"), mfu_ceiling=1e-5)
    result = tune("gpt-tiny", doubtful, nodes=1, gpus_per_node=2, global_batch=8, seq_len=128, dtype="bfloat16")
    assert result.mfu > 1e-5 and "is above 0%, the best published training runs" in result.stats["mfu_flag"]
    assert "WARNING" in format_result(result, result.model_config, result.peak_flops)
    plausible = tune("gpt-tiny", load_profile("h100-80gb"), nodes=1, gpus_per_node=2, global_batch=8, seq_len=128,
                     dtype="bfloat16")
    assert "mfu_flag" not in plausible.stats
