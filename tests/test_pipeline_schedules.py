"""Every pipeline schedule trains exactly (``--check``'s comparison with one-process training) on
gloo with every point-to-point tag forced equal (gloo then matches a pair's messages in posting
order, as NCCL does): interleaved 1F1B, ZB-H1 and ZB-V, on 2 to 4 stages, with stages that differ
in dp, tp and micro-batch, checkpointing and offload."""
from __future__ import annotations

import pytest

from tests.plan_runs import plan_dict, stage
from tests.test_pipeline_transfers import run_cases


def deep_llama():
    """llama-tiny with 8 layers (8 virtual stages: 4 stages of 2 chunks)."""
    from dataclasses import replace

    import torch

    from mist_compiler.models import TransformerLM, zoo_config

    torch.manual_seed(0)
    return TransformerLM(replace(zoo_config("llama-tiny"), layers=8))


def scheduled(schedule: str, model: str, grad_accum: int, stages: list, virtual: int = 1, batch: int = 8) -> dict:
    data = plan_dict(model, batch, grad_accum, stages)
    data["schedule"] = schedule
    if virtual > 1:
        data["virtual_stages"] = virtual
    return data


def one_layer_stages(count: int, **layout) -> list:
    return [stage((i, i + 1), **layout) for i in range(count)]


@pytest.mark.distributed
def test_every_schedule_on_two_stages_with_equal_tags():
    run_cases(2, [
        (scheduled("interleaved", "gpt-tiny", 4, one_layer_stages(4), virtual=2), "interleaved"),
        (scheduled("zb-h1", "gpt-tiny", 4, [stage((0, 2)), stage((2, 4))]), "zb-h1"),
        (scheduled("zbv", "llama-tiny", 4, one_layer_stages(4), virtual=2), "zbv"),
    ])


@pytest.mark.distributed
def test_three_stages_with_checkpointing_and_offload_with_equal_tags():
    run_cases(3, [
        # three stages of two chunks each over the 8-layer model: every cut between two ranks
        (scheduled("interleaved", "tests.test_pipeline_schedules:deep_llama", 3,
                   [stage((0, 1), ckpt_layers=1), stage((1, 3)), stage((3, 4)), stage((4, 5)),
                    stage((5, 7), offload={"weights": 0.5, "grads": 0.0, "opt": 0.5, "acts": 0.5}), stage((7, 8))],
                   virtual=2, batch=6), "interleaved"),
        (scheduled("zb-h1", "gpt-tiny", 4,
                   [stage((0, 1), ckpt_layers=1), stage((1, 3), offload={"weights": 0.0, "grads": 0.5, "opt": 0.0,
                                                                          "acts": 0.5}), stage((3, 4))]), "zb-h1"),
        (scheduled("zbv", "tests.test_pipeline_schedules:deep_llama", 6,
                   [stage((0, 1), ckpt_layers=1), stage((1, 3)), stage((3, 4)), stage((4, 6), ckpt_layers=2),
                    stage((6, 7)), stage((7, 8), offload={"weights": 0.0, "grads": 0.0, "opt": 0.0, "acts": 1.0})],
                   virtual=2, batch=6), "zbv"),
    ])


@pytest.mark.distributed
def test_four_ranks_stages_differing_in_dp_tp_and_micro_batch_with_equal_tags():
    """Stages of 2 data-parallel ranks next to stages of 2 tensor-parallel ranks (the tensor-parallel
    units keep their backward whole: zero-bubble schedules still split the others), ZeRO-3 included."""
    run_cases(4, [
        (scheduled("interleaved", "llama-tiny", 2, [stage((0, 1), dp=2), stage((1, 2), tp=2),
                                                    stage((2, 3), dp=2), stage((3, 4), tp=2)], virtual=2), "interleaved"),
        (scheduled("zb-h1", "llama-tiny", 2, [stage((0, 2), dp=2, zero=3), stage((2, 3)), stage((3, 4))]), "zb-h1"),
        (scheduled("zbv", "llama-tiny", 2, [stage((0, 1), tp=2), stage((1, 2), dp=2, zero=1),
                                            stage((2, 3), dp=2, zero=1), stage((3, 4), tp=2)], virtual=2), "zbv"),
        (scheduled("zb-h1", "tests.test_pipeline_schedules:deep_llama", 4,
                   [stage((0, 2)), stage((2, 4)), stage((4, 6)), stage((6, 8))]), "zb-h1"),
    ])
