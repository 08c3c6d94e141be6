"""torch.compile with a plan: the user's loop unchanged gives one-process AdamW training."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mist_compiler.ir.plan import Plan

LR = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-6, "weight_decay": 0.1}


def _backend(gm, example_inputs, **kwargs):
    from mist_compiler.backends.dynamo_runtime import compile_with_plan

    return compile_with_plan(gm, example_inputs, dict(kwargs.get("options") or {}))


def _register():
    from torch._dynamo.backends.registry import _COMPILER_FNS

    if "mist_plan_test" not in _COMPILER_FNS:
        torch._dynamo.register_backend(name="mist_plan_test")(_backend)


def _plan(world, **stage):
    return Plan.from_dict({"model": "gpt-tiny", "seq_len": 16, "global_batch": 4, "dtype": "float32", "grad_accum": 2,
                           "stages": [{"layers": [0, 4], "nodes": 1, "gpus_per_node": world, "micro_batch": 2 // world,
                                       "dp": world, "tp": 1, **stage}]})


def _user_loop(plan, steps=3):
    """The unchanged user loop; returns losses and the engine's final weights."""
    from mist_compiler.backends.dynamo_runtime import last_engine
    from mist_compiler.backends.worker import synthetic_batch
    from mist_compiler.models import build_model

    _register()
    torch._dynamo.reset()
    model = build_model("gpt-tiny")
    compiled = torch.compile(model, backend="mist_plan_test", options={"plan": plan, "optimizer": LR, "timeout_s": 60})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        loss = compiled(**synthetic_batch(512, plan.global_batch, plan.seq_len, step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    engine = last_engine()
    return losses, engine.gather_full_state(), engine


def test_torch_compile_with_a_plan_trains_like_one_process():
    from mist_compiler.backends.worker import compare, reference_training
    from mist_compiler.models import build_model

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        plan = _plan(1, zero=0)
        losses, state, engine = _user_loop(plan)
        engine.close()
        ref_losses, ref_state = reference_training(build_model("gpt-tiny"), plan, 3, LR)
        worst, where = compare(losses, state, ref_losses, ref_state)
        assert worst <= 1e-5, (worst, where)
    finally:
        dist.destroy_process_group()


def test_unknown_option_is_rejected():
    from mist_compiler.backends.dynamo_runtime import DynamoRuntimeError, _options

    with pytest.raises(DynamoRuntimeError, match="unknown option"):
        _options({"plan": _plan(1), "zero_level": 3})
    with pytest.raises(DynamoRuntimeError, match="'plan'"):
        _options({"timeout_s": 3})


def _compiled_loop_on_rank(rank, world, plan_data):
    from mist_compiler.backends.worker import compare, reference_training
    from mist_compiler.models import build_model

    plan = Plan.from_dict(plan_data)
    losses, state, engine = _user_loop(plan)
    engine.close()
    if rank != 0:
        return None
    ref_losses, ref_state = reference_training(build_model("gpt-tiny"), plan, 3, LR)
    return compare(losses, state, ref_losses, ref_state)


@pytest.mark.distributed
def test_torch_compile_with_a_pipeline_plan_on_two_ranks():
    from tests.dist_utils import run_ranks

    plan = Plan.from_dict({"model": "gpt-tiny", "seq_len": 16, "global_batch": 4, "dtype": "float32", "grad_accum": 2,
                           "stages": [{"layers": [0, 2], "nodes": 1, "gpus_per_node": 1, "micro_batch": 2, "dp": 1, "tp": 1},
                                      {"layers": [2, 4], "nodes": 1, "gpus_per_node": 1, "micro_batch": 2, "dp": 1, "tp": 1,
                                       "zero": 0, "ckpt_layers": 1}]})
    worst, where = run_ranks(_compiled_loop_on_rank, world=2, args=(plan.to_dict(),), timeout_s=180)[0]
    assert worst <= 1e-5, (worst, where)
