"""Hugging Face models are first-class: every plan kind trains like one process, and the tuner plans them.

Each architecture trains two plans on four gloo ranks (one process group for both): a 2-stage
pipeline whose first stage is data parallel under ZeRO-3 with a checkpointed layer and offloaded
weights, optimizer state and activations, and whose second stage is tensor parallel; and a
3-stage pipeline. ``--check``'s comparison judges each against one-process training.
"""
from __future__ import annotations

import pytest

from tests.hf_configs import ARCHITECTURES, write_config
from tests.plan_runs import assert_all_pass, plan_dict, run_plans, stage

pytest.importorskip("transformers")

OFFLOAD = {"weights": 0.5, "grads": 0.0, "opt": 0.5, "acts": 0.5}


def plans_for(model: str) -> list[dict]:
    return [
        plan_dict(model, 8, 2, [stage((0, 1), dp=2, zero=3, ckpt_layers=1, offload=OFFLOAD),
                                stage((1, 3), tp=2, zero=1)]),
        plan_dict(model, 8, 4, [stage((0, 1), dp=2, zero=2), stage((1, 2)), stage((2, 3), ckpt_layers=1)]),
    ]


@pytest.mark.distributed
@pytest.mark.parametrize("kind", sorted(ARCHITECTURES))
def test_every_plan_kind_trains_like_one_process(kind, tmp_path):
    model = write_config(kind, str(tmp_path / kind))
    assert_all_pass(run_plans(4, plans_for(model), timeout_s=600))


@pytest.mark.parametrize("kind", sorted(ARCHITECTURES))
def test_the_tuner_plans_them_with_every_knob(kind, tmp_path):
    from mist_compiler import driver

    model = write_config(kind, str(tmp_path / kind))
    compiled = driver.compile_model(model, hardware="cpu", nodes=2, gpus_per_node=2, global_batch=8, seq_len=16,
                                    dtype="float32", until="plan")
    plan = compiled.plan
    assert plan.num_layers == 3 and plan.world_size == 4
    program = compiled.program
    assert program.model_graph.tp.supported, program.model_graph.tp.reason  # TP is on offer for all of them
    assert compiled.cost_model.tp_granularity >= 2
