"""Plan.fused_loss: the loss_kernel lowering pass runs the plain head + loss, priced and chosen by the tuner."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from mist_compiler.cost.hardware import load_profile, with_memory_limit
from mist_compiler.cost.stage_api import LOSS_CHOOSE, LOSS_FUSED, LOSS_PLAIN, StageCandidates
from mist_compiler.cost.stage_model import build_stage_cost_model
from mist_compiler.ir.plan import Plan, PlanError
from mist_compiler.ir.topology import RankCoord
from mist_compiler.lowering.lower import lower
from mist_compiler.lowering.materialize import ModuleTensors
from mist_compiler.models import build_model
from mist_compiler.verify.check import synthetic_batch

FUSED = torch.ops.mist.linear_cross_entropy.default
SEQ, BATCH = 32, 4


def _plan(model: str, fused_loss: bool | None) -> Plan:
    data = {"model": model, "seq_len": SEQ, "global_batch": BATCH, "dtype": "float32", "grad_accum": 1,
            "stages": [{"layers": [0, 4], "nodes": 1, "gpus_per_node": 1, "micro_batch": BATCH, "dp": 1, "tp": 1}]}
    if fused_loss is not None:
        data["fused_loss"] = fused_loss
    return Plan.from_dict(data)


def test_plan_knob_defaults_to_the_fused_loss_and_round_trips():
    assert _plan("gpt-tiny", None).fused_loss is True
    assert "fused_loss" not in _plan("gpt-tiny", None).to_dict()  # plans of the default keep their schema
    plain = _plan("gpt-tiny", False)
    assert Plan.from_dict(plain.to_dict()) == plain and plain.to_dict()["fused_loss"] is False
    with pytest.raises(PlanError, match="plan field fused_loss: expected true or false"):
        Plan.from_dict({**plain.to_dict(), "fused_loss": "no"})


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_plain_loss_trains_like_the_fused_one(name, gpt_tiny_program, llama_tiny_program):
    program = {"gpt-tiny": gpt_tiny_program, "llama-tiny": llama_tiny_program}[name]
    torch.manual_seed(0)
    model = build_model(name, seq_len=SEQ)
    batch = synthetic_batch(512, BATCH, SEQ, 0)
    results = {}
    for fused in (True, False):
        stage = lower(program, _plan(name, fused), RankCoord(0, 0, 0), ModuleTensors(model), device=torch.device("cpu"))
        stage.materialize_all()  # (the runtime would give each unit its values as it lays them out)
        graphs = [module.graph for _, module in stage.units] + [stage.module.graph]
        assert any(n.target is FUSED for g in graphs for n in g.nodes) == fused
        loss = stage.module(**batch)
        loss.backward()
        results[fused] = (loss.detach(), {name: p.grad for name, p in stage.module.named_parameters()})
    (fused_loss, fused_grads), (plain_loss, plain_grads) = results[True], results[False]
    torch.testing.assert_close(plain_loss, fused_loss, rtol=1e-5, atol=1e-6)
    assert fused_grads.keys() == plain_grads.keys()
    for key in fused_grads:
        torch.testing.assert_close(plain_grads[key], fused_grads[key], rtol=1e-4, atol=1e-6)


def _one(**overrides) -> StageCandidates:
    base = dict(num_layers=4, has_pre=True, has_post=True, nodes=1, gpus_per_node=1, micro_batch=8, dp=1, tp=1,
                zero=0, ckpt_layers=0, offload_weights=0.0, offload_grads=0.0, offload_opt=0.0, offload_acts=0.0,
                inflight=1)
    base.update(overrides)
    return StageCandidates(**base)


def test_the_plain_loss_is_priced_faster_and_larger_and_chosen_where_it_fits():
    import mist_compiler

    program = mist_compiler.capture("llama-small", dtype="float32", seq_len=256)
    model = build_stage_cost_model(program, "cpu", seq_len=256, dtype="float32")
    fused, plain = (model.evaluate(_one(fused_loss=choice)) for choice in (LOSS_FUSED, LOSS_PLAIN))
    assert plain.stable_s[0] < fused.stable_s[0]  # the backward's recompute GEMM is gone
    logits = 8 * 256 * 8192  # N x V of a micro-batch
    saved = plain.breakdown["acts_per_microbatch"][0] - fused.breakdown["acts_per_microbatch"][0]
    assert saved == pytest.approx(4 * logits, rel=0.01)  # the fp32 log-probabilities
    assert plain.peak_memory_bytes[0] > fused.peak_memory_bytes[0] + 4 * logits
    # a stage without the head is not affected
    middle = _one(has_post=False, fused_loss=LOSS_CHOOSE)
    assert model.evaluate(middle).breakdown["fused_loss"][0] == 1.0
    assert model.evaluate(_one(fused_loss=LOSS_CHOOSE)).breakdown["fused_loss"][0] == 0.0
    # where the plain loss does not fit, the fused one is kept
    limit = (fused.peak_memory_bytes[0] + plain.peak_memory_bytes[0]) / 2
    short = dataclasses.replace(model, hardware=with_memory_limit(load_profile("cpu"), limit))
    chosen = short.evaluate(_one(fused_loss=LOSS_CHOOSE))
    assert chosen.breakdown["fused_loss"][0] == 1.0 and chosen.stable_s[0] == pytest.approx(fused.stable_s[0])
    both = model.evaluate(_one(fused_loss=np.array([LOSS_FUSED, LOSS_CHOOSE]), micro_batch=np.array([8, 8])))
    assert list(both.breakdown["fused_loss"]) == [1.0, 0.0]


def test_the_tuner_writes_its_choice_into_the_plan():
    import mist_compiler

    result = mist_compiler.tune("gpt-tiny", "cpu", nodes=1, gpus_per_node=1, global_batch=8, seq_len=64,
                                dtype="float32")
    assert result.plan.fused_loss is False  # tiny logits: the plain loss fits and is faster
    assert mist_compiler.analyze("gpt-tiny", result.plan, "cpu").iteration_time_s == pytest.approx(
        result.predicted_time_s, rel=1e-6)
