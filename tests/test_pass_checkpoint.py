"""Activation checkpointing pass: the first k layers recompute, gradients unchanged."""
from __future__ import annotations

import pytest
import torch

from mist_compiler.ir.plan import Plan
from mist_compiler.lowering.materialize import ModuleTensors, build_stage
from mist_compiler.models import build_model
from mist_compiler.passes.checkpoint import ActivationCheckpoint, CheckpointError, checkpoint_block
from mist_compiler.passes.partition import Partition

PLAN = Plan.from_dict({"model": "gpt-tiny", "seq_len": 8, "global_batch": 2, "dtype": "float32", "grad_accum": 1,
                       "stages": [{"layers": [0, 4], "nodes": 1, "gpus_per_node": 1, "micro_batch": 2, "dp": 1,
                                   "tp": 1}]})


def _stage(program):
    return Partition(PLAN, 0)(program.model_graph).program


def test_first_layers_are_wrapped_and_gradients_unchanged(gpt_tiny_program):
    model = build_model("gpt-tiny")
    stage = _stage(gpt_tiny_program)
    result = ActivationCheckpoint(2)(stage)
    wrapped = [n for n in result.program.graph.nodes if n.op == "call_function" and n.target is checkpoint_block]
    assert [n.args[0].target for n in wrapped] == ["blocks.0", "blocks.1"]
    assert [u.checkpointed for u in result.program.layer_units] == [True, True, False, False]
    batch = {"input_ids": torch.randint(0, 512, (2, 8)), "labels": torch.randint(0, 512, (2, 8))}
    plain = build_stage(stage, gpt_tiny_program.model_graph, ModuleTensors(model), device=torch.device("cpu"))
    plain.module(**batch).backward()
    expected = {name: p.grad.clone() for unit, module in plain.units for name, p in module.named_parameters(prefix=unit)}
    built = build_stage(result.program, gpt_tiny_program.model_graph, ModuleTensors(model), device=torch.device("cpu"))
    calls = []
    handle = dict(built.units)["blocks.0"].register_forward_pre_hook(lambda m, a: calls.append(1))
    built.module(**batch).backward()
    handle.remove()
    assert len(calls) == 2  # forward, then the recomputation in backward
    for unit, module in built.units:
        for name, param in module.named_parameters(prefix=unit):
            assert torch.allclose(param.grad, expected[name], atol=1e-7), name


def test_zero_layers_leaves_the_program_alone_and_too_many_is_an_error(gpt_tiny_program):
    stage = _stage(gpt_tiny_program)
    assert ActivationCheckpoint(0)(stage).program is stage
    with pytest.raises(CheckpointError, match="ckpt_layers=5 but stage 0 has 4 layers"):
        ActivationCheckpoint(5)(stage)
