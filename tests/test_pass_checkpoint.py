"""Activation checkpointing pass: the first k blocks recompute, results unchanged."""
from __future__ import annotations

import pytest
import torch

from mist_compiler.ir.plan import Plan
from mist_compiler.models import build_model
from mist_compiler.passes.checkpoint import ActivationCheckpoint, CheckpointError, checkpoint_block
from mist_compiler.passes.partition import Partition, trace_model


def _stage(name="gpt-tiny"):
    plan = Plan.from_dict({"model": name, "seq_len": 8, "global_batch": 2, "dtype": "float32", "grad_accum": 1,
                           "stages": [{"layers": [0, 4], "nodes": 1, "gpus_per_node": 1, "micro_batch": 2, "dp": 1, "tp": 1}]})
    model = build_model(name)
    return model, Partition(plan, 0)(trace_model(model)).program


def test_first_blocks_are_wrapped_and_gradients_unchanged():
    model, stage = _stage()
    result = ActivationCheckpoint(2)(stage)
    wrapped = [n for n in result.program.graph.nodes if n.op == "call_function" and n.target is checkpoint_block]
    assert [n.args[0].target for n in wrapped] == ["blocks.0", "blocks.1"]
    assert result.program.meta["mist_checkpointed"] == ["blocks.0", "blocks.1"]
    batch = {"input_ids": torch.randint(0, 512, (2, 8)), "labels": torch.randint(0, 512, (2, 8))}
    stage(**batch).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    calls = []
    handle = model.blocks[0].register_forward_pre_hook(lambda m, a: calls.append(1))
    result.program(**batch).backward()
    handle.remove()
    assert len(calls) == 2  # forward, then the recomputation in backward
    for name, param in model.named_parameters():
        assert torch.allclose(param.grad, expected[name], atol=1e-7), name


def test_zero_layers_leaves_the_program_alone_and_too_many_is_an_error():
    _, stage = _stage()
    assert ActivationCheckpoint(0)(stage).program is stage
    with pytest.raises(CheckpointError, match="ckpt_layers=5 but the stage has 4"):
        ActivationCheckpoint(5)(stage)
