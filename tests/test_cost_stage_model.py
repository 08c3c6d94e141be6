"""The vectorised stage cost model: behaviour across knobs, speed, errors."""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from mist_compiler.cost.stage_api import StageCandidates
from mist_compiler.cost.stage_model import StageModelError, build_stage_cost_model
from mist_compiler.driver import capture
from mist_compiler.passes.cost_annotation import Sharding

SEQ = 128


@pytest.fixture(scope="module")
def program():
    return capture("gpt-tiny", seq_len=SEQ, dtype="float32")


@pytest.fixture(scope="module")
def model(program):
    return build_stage_cost_model(program, "l4", seq_len=SEQ)


def one(**overrides) -> StageCandidates:
    base = dict(num_layers=4, has_pre=True, has_post=True, nodes=1, gpus_per_node=1, micro_batch=4, dp=1, tp=1,
                zero=0, ckpt_layers=0, offload_weights=0.0, offload_grads=0.0, offload_opt=0.0, offload_acts=0.0,
                inflight=1)
    base.update(overrides)
    return StageCandidates(**base)


def test_signature_fields(model):
    estimate = model.evaluate(one())
    # the L4's 24.15 GB less the headroom for context, NCCL, workspaces and fragmentation
    assert model.num_layers == 4 and model.device_memory_bytes == pytest.approx(24.15e9 - 2.395e9)
    for name in ("compute", "exposed_comm", "exposed_copy", "params", "grads", "opt", "acts"):
        assert name in estimate.breakdown
    parts = sum(estimate.breakdown[k] for k in ("params", "grads", "opt", "buffers", "acts"))
    assert estimate.peak_memory_bytes[0] == pytest.approx(parts[0])
    assert estimate.stable_s[0] > 0 and estimate.delta_s[0] > 0


def test_micro_batch_scales_time_and_activations(model):
    small, large = model.evaluate(one(micro_batch=2)), model.evaluate(one(micro_batch=8))
    assert large.stable_s[0] > small.stable_s[0]
    assert large.breakdown["acts"][0] > 3 * small.breakdown["acts"][0]
    assert large.breakdown["params"][0] == small.breakdown["params"][0]


def test_checkpointing_trades_time_for_memory(model):
    plain, ckpt = model.evaluate(one(micro_batch=8)), model.evaluate(one(micro_batch=8, ckpt_layers=4))
    assert ckpt.breakdown["acts"][0] < plain.breakdown["acts"][0]
    assert ckpt.stable_s[0] > plain.stable_s[0]
    assert ckpt.breakdown["recompute"][0] > 0 == plain.breakdown["recompute"][0]


def test_zero_and_offload_reduce_memory(model):
    dp4 = dict(gpus_per_node=4, dp=4)
    levels = [float(model.evaluate(one(zero=z, **dp4)).peak_memory_bytes[0]) for z in range(4)]
    # one micro-batch per step: ZeRO-1 also ends with gradient shards, so ZeRO-2 saves nothing more;
    # with accumulation ZeRO-2 keeps a 1/dp accumulator where ZeRO-1 keeps a full one
    assert levels[0] > levels[1] == levels[2] > levels[3]
    accumulating = [float(model.evaluate(one(zero=z, grad_accum=4, **dp4)).peak_memory_bytes[0]) for z in range(4)]
    assert accumulating[0] > accumulating[1] > accumulating[2] > accumulating[3]
    plain = model.evaluate(one(**dp4))
    offloaded = model.evaluate(one(offload_opt=1.0, offload_weights=0.5, **dp4))
    assert offloaded.peak_memory_bytes[0] < plain.peak_memory_bytes[0]
    assert offloaded.delta_s[0] > plain.delta_s[0]  # the host steps the offloaded optimizer states


def test_tensor_parallel_splits_compute_and_adds_all_reduces(model):
    tp1 = model.evaluate(one(micro_batch=16))
    tp2 = model.evaluate(one(micro_batch=16, gpus_per_node=2, tp=2))
    assert tp2.breakdown["compute"][0] < tp1.breakdown["compute"][0]
    assert tp2.breakdown["tp_comm"][0] > 0 == tp1.breakdown["tp_comm"][0]
    assert tp2.breakdown["params"][0] < tp1.breakdown["params"][0]


def test_tensor_parallel_degree_must_divide_heads(model):
    assert model.tp_granularity == 4  # gpt-tiny: 4 heads
    estimate = model.evaluate(one(tp=np.array([2, 3, 4, 8]), gpus_per_node=8, dp=np.array([4, 2, 2, 1])))
    assert list(np.isfinite(estimate.stable_s)) == [True, False, True, False]


def test_math_attention_costs_time_and_memory(model):
    math = build_stage_cost_model(capture("gpt-tiny", seq_len=SEQ, dtype="float32", attention="math"), "l4",
                                  seq_len=SEQ, attention="math")
    flash_estimate, math_estimate = model.evaluate(one()), math.evaluate(one())
    assert math_estimate.stable_s[0] > flash_estimate.stable_s[0]
    assert math_estimate.breakdown["acts"][0] > flash_estimate.breakdown["acts"][0]


def test_inflight_micro_batches_hold_activations(model):
    one_mb, three = model.evaluate(one(inflight=1)), model.evaluate(one(inflight=3))
    held = three.breakdown["acts"][0] - one_mb.breakdown["acts"][0]
    assert held == pytest.approx(2 * one_mb.breakdown["acts_per_microbatch"][0])


def test_unrecognised_structure_forbids_tensor_parallelism(model):
    layer = model.blocks["layer"]
    broken = dataclasses.replace(layer, costs=dataclasses.replace(layer.costs, sharding=Sharding(supported=False, message="x")))
    other = type(model)({**model.blocks, "layer": broken}, model.hardware, SEQ, "float32")
    estimate = other.evaluate(one(tp=np.array([1, 2]), gpus_per_node=2, dp=np.array([2, 1])))
    assert np.isfinite(estimate.stable_s[0]) and np.isinf(estimate.stable_s[1])
    assert not other.tp_supported and "layer: x" in other.tp_message


@pytest.mark.exclusive  # times the evaluation
def test_hundred_thousand_candidates_under_a_second(model):
    rng = np.random.default_rng(0)
    n = 100_000
    candidates = StageCandidates(
        num_layers=rng.integers(1, 5, n), has_pre=rng.random(n) < 0.5, has_post=rng.random(n) < 0.5,
        nodes=np.ones(n, int), gpus_per_node=np.full(n, 8), micro_batch=rng.choice([1, 2, 4, 8, 16], n),
        dp=np.full(n, 2), tp=np.full(n, 4), zero=rng.integers(0, 4, n), ckpt_layers=np.zeros(n, int),
        offload_weights=np.zeros(n), offload_grads=np.zeros(n), offload_opt=np.where(rng.random(n) < 0.2, 0.5, 0.0),
        offload_acts=np.zeros(n), inflight=rng.integers(1, 4, n))
    start = time.perf_counter()
    estimate = model.evaluate(candidates)
    elapsed = time.perf_counter() - start
    print(f"benchmark: 100,000 stage candidates evaluated in {elapsed:.3f} s")
    assert len(estimate.stable_s) == n and np.isfinite(estimate.stable_s).all()
    assert elapsed < 3.0  # generous: the machine is shared; about 0.5 s when idle


def _stage_params(model) -> float:
    return sum(block.params * (model.num_layers if kind == "layer" else 1) for kind, block in model.blocks.items())


def test_optimizer_step_runs_at_the_profiles_adam_rate(model):
    """The step's device part is parameters / the profile's AdamW rate (measured by ``mistc profile``)."""
    rate = 1e9
    measured = dataclasses.replace(model, hardware=dataclasses.replace(model.hardware, optimizer_params_per_s=rate))
    halved = dataclasses.replace(model, hardware=dataclasses.replace(model.hardware, optimizer_params_per_s=rate / 2))
    extra = halved.evaluate(one()).delta_s[0] - measured.evaluate(one()).delta_s[0]
    assert extra * rate == pytest.approx(_stage_params(model), rel=1e-6)


def test_gradient_buffer_passes_are_priced(model):
    """Every micro-batch zeroes its gradient buffer and, with data parallelism, scales it in place;
    accumulating micro-batches add into an fp32 accumulator (a 1/dp shard from ZeRO-2 on)."""
    from mist_compiler.cost.op_time import op_class_time

    grad_bytes = 4.0 * _stage_params(model)
    elementwise = lambda nbytes: float(op_class_time(model.hardware, "float32", "elementwise", 0.0, nbytes))
    alone, dp2 = model.evaluate(one()), model.evaluate(one(gpus_per_node=2, dp=2))
    assert dp2.breakdown["compute"][0] - alone.breakdown["compute"][0] == pytest.approx(elementwise(2 * grad_bytes))
    dp4 = dict(gpus_per_node=4, dp=4)
    growth = {zero: model.evaluate(one(zero=zero, grad_accum=4, **dp4)).delta_s[0]
              - model.evaluate(one(zero=zero, grad_accum=1, **dp4)).delta_s[0] for zero in (0, 2)}
    assert growth[0] == pytest.approx(elementwise(3 * 3 * grad_bytes))
    assert growth[2] == pytest.approx(growth[0] / 4)


def test_whole_buffer_passes_run_at_the_profiles_streaming_rate(model):
    """``stream_gbps`` (one pass over buffers no cache holds, measured by ``mistc profile``) prices the
    gradient buffer's zeroing and the accumulator's passes; autograd adding a gradient it has just made
    keeps the elementwise rate. Without it, both run at the elementwise rate (the test above)."""
    grad_bytes = 4.0 * _stage_params(model)
    stream = 1e9
    streaming = dataclasses.replace(model, hardware=dataclasses.replace(model.hardware, stream_bandwidth=stream))
    elementwise_rate = model.hardware.memory_bandwidth * model.hardware.efficiency_of("elementwise")
    extra = streaming.evaluate(one()).breakdown["compute"][0] - model.evaluate(one()).breakdown["compute"][0]
    assert extra == pytest.approx(grad_bytes / stream - grad_bytes / elementwise_rate)
    growth = streaming.evaluate(one(grad_accum=4)).delta_s[0] - streaming.evaluate(one(grad_accum=1)).delta_s[0]
    assert growth == pytest.approx(3 * 3 * grad_bytes / stream)


def test_bad_arguments_name_the_field(program):
    with pytest.raises(StageModelError, match="attention"):
        build_stage_cost_model(program, "l4", seq_len=SEQ, attention="paged")
    with pytest.raises(StageModelError, match="seq_len"):
        build_stage_cost_model(program, "l4", seq_len=0)
    with pytest.raises(ValueError, match="dtype"):
        build_stage_cost_model(program, "l4", seq_len=SEQ, dtype="int8")
    with pytest.raises(ValueError, match="unknown hardware"):
        build_stage_cost_model(program, "no-such-gpu", seq_len=SEQ)
    with pytest.raises(StageModelError, match="captured program"):
        build_stage_cost_model("gpt-tiny", "l4", seq_len=SEQ)


def test_memory_knobs_are_monotone(model):
    """More checkpointing or offloading never saves time and never costs memory (the tuner prunes on
    it), weights offload excepted for memory (as the tuner knows)."""
    rng = np.random.default_rng(1)
    n = 500
    layers = rng.integers(1, 5, n)
    tp, dp = rng.choice([1, 2], n), rng.choice([1, 2], n)
    base = StageCandidates(
        num_layers=layers, has_pre=rng.random(n) < 0.5, has_post=rng.random(n) < 0.5, nodes=1, gpus_per_node=tp * dp,
        micro_batch=rng.choice([1, 2, 4], n), dp=dp, tp=tp, zero=rng.integers(0, 4, n),
        ckpt_layers=rng.integers(0, layers + 1), offload_weights=rng.choice([0.0, 0.5], n),
        offload_grads=rng.choice([0.0, 0.5], n), offload_opt=rng.choice([0.0, 0.5], n),
        offload_acts=np.zeros(n), inflight=rng.integers(1, 4, n))
    before = model.evaluate(base)
    for knob in ("ckpt_layers", "offload_weights", "offload_grads", "offload_opt", "offload_acts"):
        if knob == "ckpt_layers":
            changed = dataclasses.replace(base, ckpt_layers=np.minimum(base.ckpt_layers + 1, layers))
        else:
            changed = dataclasses.replace(base, **{knob: getattr(base, knob) + 0.5})
        after = model.evaluate(changed)
        assert (after.stable_s >= before.stable_s * (1 - 1e-9)).all(), knob
        assert (after.delta_s >= before.delta_s * (1 - 1e-9)).all(), knob
        if knob != "offload_weights":  # moved weights need transient full copies (and an fp32 master of their own)
            assert (after.peak_memory_bytes <= before.peak_memory_bytes * (1 + 1e-9)).all(), knob


def test_peak_memory_alone_is_the_full_evaluations_peak(program):
    """The tuner's questions (``totals``; ``peak_memory``, with and without optimizer-offload ratios)
    give exactly ``evaluate``'s times and peaks, the plain-or-fused loss choice included: the limit is set
    between the two losses' peaks, so the choice goes both ways."""
    from mist_compiler.cost.hardware import load_profile, with_memory_limit
    from mist_compiler.cost.stage_api import LOSS_CHOOSE, LOSS_PLAIN

    rng = np.random.default_rng(1)
    n = 4000
    candidates = StageCandidates(
        num_layers=rng.integers(1, 5, n), has_pre=rng.random(n) < 0.5, has_post=rng.random(n) < 0.7,
        nodes=np.ones(n, int), gpus_per_node=np.full(n, 8), micro_batch=rng.choice([1, 2, 4, 8, 16, 64], n),
        dp=rng.choice([1, 2, 4], n), tp=rng.choice([1, 2], n), zero=rng.integers(0, 4, n),
        ckpt_layers=rng.integers(0, 2, n), offload_weights=rng.choice([0.0, 0.5], n),
        offload_grads=rng.choice([0.0, 0.5], n), offload_opt=rng.choice([0.0, 0.25, 1.0], n),
        offload_acts=rng.choice([0.0, 0.5, 1.0], n), inflight=rng.integers(1, 4, n), grad_accum=rng.integers(1, 5, n),
        fused_loss=np.where(rng.random(n) < 0.9, LOSS_CHOOSE, LOSS_PLAIN), low_precision_grads=rng.random(n) < 0.3)
    probe = build_stage_cost_model(program, "l4", seq_len=SEQ)
    limit = float(np.median(probe.evaluate(candidates).peak_memory_bytes))
    model = build_stage_cost_model(program, with_memory_limit(load_profile("l4"), limit), seq_len=SEQ)
    full = model.evaluate(candidates)
    assert 0.0 < float(full.breakdown["fused_loss"][np.asarray(candidates.has_post)].mean()) < 1.0
    assert np.array_equal(model.peak_memory(candidates), full.peak_memory_bytes)
    totals = model.totals(candidates)  # the tuner's evaluation: the same numbers, no breakdown
    assert set(totals.breakdown) == {"fused_loss"}  # the loss choice alone
    for name in ("stable_s", "delta_s", "peak_memory_bytes"):
        assert np.array_equal(getattr(totals, name), getattr(full, name)), name
    ratios = (0.0, 0.5, 1.0)
    by_ratio = model.peak_memory(candidates, ratios)
    for i, ratio in enumerate(ratios):
        moved = dataclasses.replace(candidates, offload_opt=np.full(n, ratio))
        assert np.array_equal(by_ratio[i], model.evaluate(moved).peak_memory_bytes), ratio


def test_a_model_replaced_with_another_profile_prices_with_it(program, model):
    """The stage model caches block terms per model; ``dataclasses.replace`` with a slower device must
    price with it, as a model built for that device does, not read the first model's cached times."""
    candidate = one(micro_batch=64)
    fast = model.evaluate(candidate).stable_s[0]
    slower = dataclasses.replace(model.hardware, peak_flops={k: v / 2 for k, v in model.hardware.peak_flops.items()})
    replaced = dataclasses.replace(model, hardware=slower).evaluate(candidate).stable_s[0]
    assert replaced > fast
    assert replaced == build_stage_cost_model(program, slower, seq_len=SEQ).evaluate(candidate).stable_s[0]


def test_zero_traffic_that_no_compute_hides_is_priced_every_micro_batch(model):
    """The runtime prefetches one unit ahead and finishes one reduction before it launches the next,
    so the first unit's gather, the head's, the backward's first gather and the last reductions wait
    every micro-batch however long it computes (a two-rank ZeRO-3 trace showed them): ZeRO-3 keeps
    that exposed time at any micro-batch, a stage without the embedding and head less of it, ZeRO-2
    (reductions only) less too."""
    dp4 = dict(gpus_per_node=4, dp=4)

    def exposed(**overrides) -> float:
        parts = model.evaluate(one(**dp4, **overrides)).breakdown
        return float(parts["exposed_comm"][0] - parts["p2p"][0])

    edges = [exposed(zero=3, micro_batch=mb) for mb in (16, 64)]
    assert edges[0] > 0 and edges[1] == pytest.approx(edges[0], rel=1e-6)
    assert 0 < exposed(zero=3, micro_batch=64, has_pre=False, has_post=False) < edges[1]
    assert 0 < exposed(zero=2, micro_batch=64) < edges[1]
    assert exposed(zero=1, micro_batch=64) == 0  # levels 0-1 reduce once per step (delta)
