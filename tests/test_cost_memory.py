"""Closed-form stage memory terms and the op-time roofline."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mist_compiler.cost.hardware import load_profile
from mist_compiler.cost.memory import (ACCUMULATOR_BYTES, ADAMW_CHUNK_ELEMENTS, BlockActivationTerms, StageConfig,
                                      StageLayout, greedy_offload, stage_memory, state_bytes_per_param)
from mist_compiler.cost.op_time import class_efficiency, op_class_time

PRE, LAYER, POST, N = 300_000.0, 100_000.0, 300_000.0, 4
P = PRE + N * LAYER + POST


def acts(saved=0.0, inp=0.0, fwd=0.0, bwd=0.0, output=0.0, fwd_free=0.0, bwd_free=0.0) -> BlockActivationTerms:
    one = lambda value: np.array([value], float)  # noqa: E731
    return BlockActivationTerms(one(saved), one(inp), one(fwd), one(bwd), one(fwd_free), one(bwd_free), one(output))


def memory(dtype="float16", zero=0, dp=4, accum=1, inflight=1, ckpt=0, w=0.0, g=0.0, o=0.0, a=0.0, copies=0.0,
           pre=None, layer=None, post=None, has_pre=True, has_post=True, offloaded=None):
    layout = StageLayout(np.array([PRE]), np.array([LAYER]), np.array([POST]), np.array([float(N)]),
                         np.array([has_pre]), np.array([has_post]))
    config = StageConfig(dtype, np.array([zero]), np.array([dp]), np.array([accum]), np.array([inflight]),
                         np.array([ckpt]), np.array([w]), np.array([g]), np.array([o]), np.array([a]), copies)
    return stage_memory(layout, config, pre or acts(), layer or acts(), post or acts(),
                        None if offloaded is None else np.array([offloaded]))


def adam_temporary(elements: float) -> float:
    """One fp32 chunk of the chunked torch AdamW (low-precision gradients; fp32 ones take the fused kernel)."""
    return min(elements, ADAMW_CHUNK_ELEMENTS) * ACCUMULATOR_BYTES


def test_bytes_per_parameter_by_dtype():
    assert state_bytes_per_param("float16") == (2, 2, 12)  # fp16 weight, fp16 grad, fp32 master + 2 Adam moments
    assert state_bytes_per_param("bfloat16") == (2, 2, 12)
    assert state_bytes_per_param("float32") == (4, 4, 8)
    with pytest.raises(ValueError, match="dtype"):
        state_bytes_per_param("int8")


@pytest.mark.parametrize("zero, weights, opt", [
    (0, 2 * P, 12 * P),
    (1, 2 * P, 12 * P / 4),
    (2, 2 * P, 12 * P / 4),
    (3, 2 * P / 4, 12 * P / 4),
])
def test_static_states_by_zero_level(zero, weights, opt):
    result = memory(zero=zero)
    assert float(result.weights[0]) == pytest.approx(weights)
    assert float(result.opt[0]) == pytest.approx(opt)


def test_fp32_weights_are_the_master_unless_they_move():
    assert float(memory("float32").opt[0]) == pytest.approx(8 * P)  # moments only
    # weights offloaded: the compute copy is transient, so the fp32 master is a buffer of its own
    assert float(memory("float32", w=0.5).opt[0]) == pytest.approx(12 * P)
    assert float(memory("float32", w=0.5).weights[0]) == pytest.approx(0.5 * 4 * P)


def test_without_accumulation_gradients_exist_only_from_the_backward_on():
    # no activations: the optimizer step holds every block's fp32 reduced gradient (ZeRO-0) and torch's fused
    # AdamW adds no temporary, so the peak is the last reduction: the pre block's fp16 gradient beside them all
    result = memory(zero=0)
    assert float(result.peak[0]) == pytest.approx(2 * P + 12 * P + 4 * P + 2 * PRE)
    assert float(result.peak[0]) == pytest.approx(float(result.peak_forward_backward[0]))
    # a big forward activation peak carries no gradient at all
    big = 50 * P
    result = memory(zero=0, layer=acts(saved=1.0, fwd=big))
    assert float(result.peak[0]) == pytest.approx(2 * P + 12 * P + 3 * 1.0 + big)
    assert float(result.grads[0]) == 0.0


def test_accumulators_live_between_micro_batches():
    big = 50 * P
    # four micro-batches, one in flight: forwards after a backward run next to every fp32 accumulator
    with_accumulation = memory(zero=0, accum=4, layer=acts(saved=1.0, fwd=big))
    assert float(with_accumulation.grads[0]) == pytest.approx(4 * P)
    # ZeRO-2 keeps only the 1/dp shard of it; gradient offload moves a fraction to the host
    assert float(memory(zero=2, accum=4, layer=acts(saved=1.0, fwd=big)).grads[0]) == pytest.approx(4 * P / 4)
    assert float(memory(zero=2, accum=4, g=0.5, layer=acts(saved=1.0, fwd=big)).grads[0]) == pytest.approx(2 * P / 4)


def test_one_f_one_b_first_and_later_backward():
    saved = 100_000.0
    layer = acts(saved=saved, bwd=saved)
    middle = dict(zero=0, layer=layer, has_post=False, has_pre=False)
    static = 2 * N * LAYER + 12 * N * LAYER
    per_microbatch = N * saved
    # the last layer's reduction: the layers before it keep their activations, its own are released; its fp16
    # gradient buffer and the fp32 copy it is cast into (then added into the accumulator, or all-reduced)
    accumulators = ACCUMULATOR_BYTES * N * LAYER
    at_reduction = (N - 1) * saved + (2 + ACCUMULATOR_BYTES) * LAYER
    assert at_reduction > N * saved + 2 * LAYER  # more than its backward (all saved + the fp16 buffer)
    # three micro-batches in flight, eight per iteration: a later backward holds min(3, 8 - 1) - 1 = 2
    # others, like the first, but also every block's fp32 accumulator
    result = memory(accum=8, inflight=3, **middle)
    assert float(result.peak[0]) == pytest.approx(static + 2 * per_microbatch + at_reduction + accumulators)
    # two per iteration: the first backward holds one other and no accumulator, the later one none
    two = memory(accum=2, inflight=2, **middle)
    first = per_microbatch + at_reduction
    later = at_reduction + accumulators
    assert first != later
    assert float(two.peak[0]) == pytest.approx(static + max(first, later))


def test_pipeline_boundary_holds_the_output_of_each_micro_batch():
    layer = acts(saved=1000.0, fwd=1e7, inp=10.0, output=10.0)
    middle = memory(zero=0, inflight=3, accum=3, layer=layer, has_pre=False, has_post=False)
    last = memory(zero=0, inflight=3, accum=3, layer=layer, has_pre=False, has_post=True)
    # during a forward a middle stage also keeps the two held micro-batches' outputs
    assert float(middle.acts[0]) - float(last.acts[0]) == pytest.approx(2 * 10.0)


def test_zero3_gathers_blocks_and_reductions_make_room():
    gathered = memory(zero=3, layer=acts(saved=1.0, fwd=50 * P))
    assert float(gathered.buffers[0]) == pytest.approx(2 * LAYER * 2)  # a layer in use and the next prefetched
    assert float(memory(zero=2, layer=acts(saved=1.0, fwd=50 * P)).buffers[0]) == 0.0
    # no activations: the largest point is pre's reduce-scatter at the end of the backward: every other
    # block's fp32 shard (the last layer's reduce-scatter finished before pre's is launched), and pre's fp16
    # buffer with its fp32 copy, or, the buffer freed, the copy, the fresh shard and the library's copy
    static = 2 * P + 12 * P / 4
    others = ACCUMULATOR_BYTES * (P - PRE) / 4
    cast = (2 + ACCUMULATOR_BYTES) * PRE
    for copies in (1.0, 0.0):
        scattered = (ACCUMULATOR_BYTES + ACCUMULATOR_BYTES / 4 + copies * ACCUMULATOR_BYTES) * PRE
        assert float(memory(zero=2, copies=copies).peak[0]) == pytest.approx(static + others + max(cast, scattered))


def test_greedy_offload_follows_the_runtime_rule():
    sizes = [np.array([10.0]), np.array([10.0]), np.array([40.0]), np.array([40.0])]
    # half: the first tensor stays (10 > 5), the second goes (10 <= 10), the third stays (50 > 30),
    # the fourth goes (50 <= 50)
    assert float(greedy_offload(sizes, [True] * 4, np.array([0.5]))[0]) == 50.0
    assert float(greedy_offload(sizes, [True, False, True, True], np.array([0.5]))[0]) == 40.0
    assert float(greedy_offload(sizes, [True] * 4, np.array([1.0]))[0]) == 100.0
    assert float(greedy_offload(sizes, [True] * 4, np.array([0.0]))[0]) == 0.0


def test_activation_offload_keeps_the_rest_of_each_layer():
    layer = acts(saved=100.0, fwd=150.0, bwd=150.0)
    full = memory(zero=0, inflight=3, accum=3, layer=layer)
    half = memory(zero=0, inflight=3, accum=3, layer=layer, a=0.5, offloaded=50.0)
    assert float(half.acts[0]) < float(full.acts[0])
    # two held micro-batches keep half of every layer; the running one half of the layers before it
    assert float(full.acts[0]) - float(half.acts[0]) == pytest.approx(2 * N * 50.0 + (N - 1) * 50.0 - 50.0, abs=100.0)


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


def low_memory(**kwargs):
    """``memory`` with the plan's grad_dtype = its (fp16) dtype."""
    layout = StageLayout(np.array([PRE]), np.array([LAYER]), np.array([POST]), np.array([float(N)]),
                         np.array([kwargs.pop("has_pre", True)]), np.array([kwargs.pop("has_post", True)]))
    layer = kwargs.pop("layer", None) or acts()
    zero, dp, accum = kwargs.pop("zero"), kwargs.pop("dp", 4), kwargs.pop("accum", 1)
    config = StageConfig("float16", np.array([zero]), np.array([dp]), np.array([accum]), np.array([1]), np.array([0]),
                         np.array([0.0]), np.array([0.0]), np.array([0.0]), np.array([0.0]), kwargs.pop("copies", 0.0),
                         low_precision_grads=np.array([True]))
    assert not kwargs
    return stage_memory(layout, config, acts(), layer, acts())


def test_low_precision_gradients_accumulate_in_the_param_dtype():
    big = 50 * P
    # between micro-batches: every block's fp16 buffer (ZeRO 0 and 1), not an fp32 accumulator
    for zero in (0, 1):
        assert float(low_memory(zero=zero, accum=4, layer=acts(saved=1.0, fwd=big)).grads[0]) == pytest.approx(2 * P)
    # ZeRO-2 keeps its fp32 shard either way
    assert float(low_memory(zero=2, accum=4, layer=acts(saved=1.0, fwd=big)).grads[0]) == pytest.approx(4 * P / 4)


def test_low_precision_zero1_reduces_the_last_micro_batch_in_fp32():
    # no activations: every block's fp16 buffer; the post block's reduction casts it into an fp32 copy, then
    # trades it for a 1/dp fp32 shard (4/dp = 1 byte per parameter); that reduction is finished (the copy
    # freed) before the next unit's is launched, so the last layer's reduction, with its own fp32 copy, does
    # not stack on it and the post block's (the largest unit) is the largest point
    static = 2 * P + 12 * P / 4
    post_reduction = 2 * P + ACCUMULATOR_BYTES * POST
    layer_reduction = 2 * P + POST * (ACCUMULATOR_BYTES / 4 - 2) + ACCUMULATOR_BYTES * LAYER
    assert post_reduction > layer_reduction
    assert float(low_memory(zero=1, accum=4).peak[0]) == pytest.approx(static + post_reduction)


def test_low_precision_zero0_keeps_the_buffer_until_the_step():
    static = 2 * P + 12 * P
    # one rank: nothing to reduce; the optimizer reads the fp16 buffer (its torch fallback upcasts a chunk)
    assert float(low_memory(zero=0, dp=1, accum=2).peak[0]) == pytest.approx(static + 2 * P + 2 * adam_temporary(PRE))
    # 4 ranks: the all-reduce runs on an fp32 copy of the unit; the mean goes back into the buffer
    assert float(low_memory(zero=0, dp=4, accum=2).peak[0]) == pytest.approx(
        static + max(2 * P + ACCUMULATOR_BYTES * PRE, 2 * P + 2 * adam_temporary(PRE)))


def test_micro_batches_between_the_first_and_the_last_keep_full_accumulators():
    # fp32 ZeRO-1 first stage (no post block), no activations: the second of three backwards reduces pre
    # (its fp16 buffer cast into an fp32 copy) next to every full fp32 accumulator; the last one has traded
    # the layers' for shards as it went
    p = PRE + N * LAYER
    static = 2 * p + 12 * p / 4
    cast_pre = (2 + ACCUMULATOR_BYTES) * PRE
    middle = ACCUMULATOR_BYTES * p + cast_pre
    # last: layer 0's reduce-scatter finished (its accumulator traded for a shard) before pre is cast
    last = ACCUMULATOR_BYTES * p + N * LAYER * (ACCUMULATOR_BYTES / 4 - ACCUMULATOR_BYTES) + cast_pre
    assert middle > last
    assert float(memory(zero=1, accum=3, has_post=False).peak[0]) == pytest.approx(static + middle)
    assert float(memory(zero=1, accum=2, has_post=False).peak[0]) == pytest.approx(static + last)
