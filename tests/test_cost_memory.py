"""Closed-form stage memory terms and the op-time roofline."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mist_compiler.cost.hardware import load_profile
from mist_compiler.cost.memory import BlockActivationTerms, activation_peak, model_state_memory, state_bytes_per_param
from mist_compiler.cost.op_time import class_efficiency, op_class_time

P, LAYER = 1_000_000.0, 100_000.0


def states(dtype="float16", zero=0, dp=4, w=0.0, g=0.0, o=0.0):
    return model_state_memory(P, LAYER, dtype, zero, dp, w, g, o)


def test_bytes_per_parameter_by_dtype():
    assert state_bytes_per_param("float16") == (2, 2, 12)  # fp16 weight, fp16 grad, fp32 master + 2 Adam moments
    assert state_bytes_per_param("bfloat16") == (2, 2, 12)
    assert state_bytes_per_param("float32") == (4, 4, 8)
    with pytest.raises(ValueError, match="dtype"):
        state_bytes_per_param("int8")


@pytest.mark.parametrize("zero, expected", [
    (0, 16 * P),
    (1, 4 * P + 12 * P / 4),
    (2, 2 * P + 14 * P / 4 + 2 * LAYER),  # + one layer of full gradients before its reduce-scatter
    (3, 16 * P / 4 + 2 * 2 * LAYER + 2 * LAYER),  # + two layers' gathered weights (use + prefetch)
])
def test_zero_levels(zero, expected):
    assert float(states(zero=zero).total) == pytest.approx(expected)


def test_zero_without_data_parallelism_shards_nothing():
    assert float(states(zero=3, dp=1).total) == pytest.approx(16 * P)


def test_offload_ratios_move_state_to_host():
    full = states()
    half = states(w=0.5, g=0.25, o=1.0)
    assert float(half.weights) == pytest.approx(0.5 * float(full.weights))
    assert float(half.grads) == pytest.approx(0.75 * float(full.grads))
    assert float(half.opt) == 0.0
    # two layers' offloaded weights prefetched back, one layer's offloaded gradients staged out
    assert float(half.buffers) == pytest.approx(2 * LAYER * 2 * 0.5 + LAYER * 2 * 0.25)


def terms(saved, inp, fwd, bwd):
    return BlockActivationTerms(np.array([saved], float), np.array([inp], float), np.array([fwd], float), np.array([bwd], float))


def test_activation_peak_inflight_and_checkpointing():
    layer = terms(saved=100, inp=10, fwd=120, bwd=150)
    pre = terms(saved=5, inp=0, fwd=20, bwd=25)
    post = terms(saved=50, inp=10, fwd=70, bwd=90)
    per_mb, peak = activation_peak(layer, pre, post, 4, 0, True, True, 1, 0.0)
    assert per_mb[0] == 5 + 4 * 100 + 50
    # backward of the post block first: all layers' activations alive + its backward peak
    assert peak[0] == 5 + 4 * 100 + 90
    _, peak3 = activation_peak(layer, pre, post, 4, 0, True, True, 3, 0.0)
    assert peak3[0] == 2 * per_mb[0] + peak[0]  # 1F1B: two more micro-batches held
    per_mb_ckpt, peak_ckpt = activation_peak(layer, pre, post, 4, 4, True, True, 1, 0.0)
    assert per_mb_ckpt[0] == 5 + 4 * 10 + 50  # checkpointed layers keep only their input
    # the last checkpointed layer recomputed: inputs of the others + its full backward peak
    assert peak_ckpt[0] == max(5 + 4 * 10 + 90, 5 + 3 * 10 + 150)
    _, peak_offload = activation_peak(layer, pre, post, 4, 0, True, True, 3, 0.5)
    assert peak_offload[0] == pytest.approx(0.5 * 2 * per_mb[0] + peak[0])


def test_roofline_per_op_class():
    profile = load_profile("l4")
    peak = profile.peak_flops["float16"]
    matmul = op_class_time(profile, "float16", "matmul", 1e12, 1e6)
    assert matmul == pytest.approx(1e12 / (peak * class_efficiency(profile, "matmul")))
    memory_bound = op_class_time(profile, "float16", "elementwise", 1e6, 1e9)
    assert memory_bound == pytest.approx(1e9 / (profile.memory_bandwidth * class_efficiency(profile, "elementwise")))
    assert class_efficiency(profile, "norm") == profile.efficiency["reduction"]  # family fallback
    assert op_class_time(profile, "float16", "view", 1e9, 1e9) == 0
    fp32_only = dataclasses.replace(profile, peak_flops={"float32": 1e12})
    with pytest.raises(ValueError, match="peak_tflops"):
        op_class_time(fp32_only, "float16", "matmul", 1.0, 1.0)
