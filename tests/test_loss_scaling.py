"""fp16 dynamic loss scaling: GradScaler's rule, overflowing steps skipped on every rank together."""
from __future__ import annotations

import math

import pytest
import torch

from mist_compiler.ir.plan import Plan
from mist_compiler.runtime.loss_scaling import DynamicLossScaler, LossScaleConfig, loss_scaler_for
from tests.dist_utils import run_ranks
from tests.test_backend_engine import plan_dict, stage


def test_scale_follows_torch_grad_scaler():
    flags = [True, False, False, False, True, False, False, False, False, False, False, True]
    ours = DynamicLossScaler(LossScaleConfig(init_scale=1024.0, growth_interval=3))
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.1)
    reference = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    for flag in flags:
        reference.scale(torch.ones(()))
        param.grad = torch.tensor([math.inf if flag else 1.0])
        reference.step(optimizer)
        reference.update()
        skipped = ours.update(flag)
        assert skipped == flag
        assert ours.scale == reference.get_scale()
    assert ours.skipped_steps == 3


def test_nonfinite_check_stays_on_the_device_and_sees_inf_and_nan():
    scaler = DynamicLossScaler()
    device = torch.device("cpu")
    clean = [torch.ones(10), torch.zeros(0)]
    assert float(scaler.found_nonfinite(clean, device)) == 0.0
    assert float(scaler.found_nonfinite(clean + [torch.tensor([1.0, math.inf])], device)) == 1.0
    assert float(scaler.found_nonfinite([torch.tensor([math.nan])], device)) == 1.0


def test_only_float16_is_scaled():
    assert loss_scaler_for("bfloat16") is None and loss_scaler_for("float32") is None
    assert isinstance(loss_scaler_for("float16"), DynamicLossScaler)


def _fp16_pipeline_skips_together(rank, world, data):
    from mist_compiler.models import build_model
    from mist_compiler import compile as compile_plan
    from mist_compiler.verify.check import synthetic_batch

    plan = Plan.from_dict(data)
    engine = compile_plan(build_model(plan.model, seq_len=plan.seq_len), plan, timeout_s=60)
    engine.loss_scaler.scale = 2.0 ** 40  # the fp16 gradients overflow on the last stage
    before = {k: v.clone() for k, v in engine.named_full_parameters().items()}
    first = engine.step(synthetic_batch(512, plan.global_batch, plan.seq_len, 0))
    after_skip = engine.named_full_parameters()
    skipped_unchanged = all(torch.equal(before[k], after_skip[k]) for k in before)
    scale_after_skip = engine.loss_scaler.scale
    engine.loss_scaler.scale = 256.0
    second = engine.step(synthetic_batch(512, plan.global_batch, plan.seq_len, 1))
    after_step = engine.named_full_parameters()
    moved = any(not torch.equal(after_skip[k], after_step[k]) for k in before)
    engine.close()
    return {"skipped_unchanged": skipped_unchanged, "scale_after_skip": scale_after_skip, "moved": moved,
            "losses": (first, second), "skipped": engine.loss_scaler.skipped_steps}


@pytest.mark.distributed
def test_fp16_overflow_skips_the_step_on_every_stage():
    data = plan_dict("gpt-tiny", 4, 2, [stage((0, 2)), stage((2, 4))])
    data["dtype"] = "float16"
    results = run_ranks(_fp16_pipeline_skips_together, world=2, args=(data,), timeout_s=180)
    for result in results:
        assert result["skipped_unchanged"], "a skipped step changed weights"
        assert result["scale_after_skip"] == 2.0 ** 39
        assert result["moved"], "the clean step did not update the weights"
        assert result["skipped"] == 1
        assert all(math.isfinite(loss) for loss in result["losses"])
    assert results[0]["losses"] == results[1]["losses"]


def test_cost_model_prices_the_overflow_check():
    from mist_compiler.cost.op_time import op_class_time
    from mist_compiler.cost.stage_api import StageCandidates
    from mist_compiler.driver import price

    _, fp16 = price("gpt-tiny", "l4", seq_len=128, dtype="float16")
    _, bf16 = price("gpt-tiny", "l4", seq_len=128, dtype="bfloat16")
    candidate = StageCandidates(num_layers=4, has_pre=True, has_post=True, nodes=1, gpus_per_node=2, micro_batch=4,
                                dp=2, tp=1, zero=1, ckpt_layers=0, offload_weights=0.0, offload_grads=0.0,
                                offload_opt=0.0, offload_acts=0.0, inflight=1)
    a, b = fp16.evaluate(candidate), bf16.evaluate(candidate)
    shard = float(a.breakdown["params"][0]) / 2 / 2  # fp16 weights: 2 bytes per parameter; ZeRO-1 over dp 2
    expected = float(op_class_time(fp16.hardware, "float16", "reduction", 0.0, 4.0 * shard))
    assert a.stable_s[0] == pytest.approx(b.stable_s[0])
    assert a.delta_s[0] - b.delta_s[0] == pytest.approx(expected, rel=1e-6)
    assert expected > 0
