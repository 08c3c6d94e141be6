"""torch.compile(model, backend="mist", options=...): the user's loop unchanged trains like eager.

Each test runs the literal user loop in a fresh subprocess (no package import first: dynamo finds
the backend through its entry point), against the same loop run eagerly, and compares every
loss and the final ``model.state_dict()`` with ``--check``'s noise-based comparison.
"""
from __future__ import annotations

import pytest

from user_loop import gpt2_setup, run_user_loop, write_gpt2_plan


def test_torch_compile_tunes_then_trains_the_users_module_with_the_users_optimizer():
    """Options name the cluster, not a plan: the backend tunes, then trains. The user's AdamW at
    lr 1e-2 with a decaying schedule is what trains (not a default), and state_dict() is the result."""
    result = run_user_loop({"hardware": "cpu", "nodes": 1, "gpus_per_node": 1, "global_batch": 4, "seq_len": 16,
                            "dtype": "float32"})
    assert result["worst"] <= max(10 * result["noise"], 1e-6), result  # within 10x rounding noise
    assert result["losses"][2] < result["losses"][0]  # it trained


def test_torch_compile_with_a_plan_and_hugging_face_outputs(tmp_path):
    """A Hugging Face GPT-2 (its loss logs a warning: a graph break unless logging is dropped),
    under a given plan, returning its output object."""
    pytest.importorskip("transformers")
    result = run_user_loop({"plan": write_gpt2_plan(tmp_path)}, gpt2_setup(tmp_path / "gpt2"), tmp_path)
    assert result["worst"] <= max(10 * result["noise"], 1e-6), result


def test_options_are_checked_and_named():
    from mist_compiler.torch_compile.plan_runtime import DynamoRuntimeError, parse_options

    with pytest.raises(DynamoRuntimeError, match=r"unknown option\(s\) \['zero_level'\]"):
        parse_options({"plan": "plan.json", "zero_level": 3})
    with pytest.raises(DynamoRuntimeError, match=r"\['global_batch', 'hardware'\] are needed to tune"):
        parse_options({"timeout_s": 3})
    with pytest.raises(DynamoRuntimeError, match="option 'nodes' must be an integer in 1.."):
        parse_options({"hardware": "cpu", "global_batch": 8, "nodes": 0})


def test_an_optimizer_the_plan_cannot_run_is_refused_in_one_line():
    import torch

    from mist_compiler.torch_compile.plan_runtime import DynamoRuntimeError, optimizer_settings

    params = [torch.nn.Parameter(torch.zeros(2))]
    assert optimizer_settings(torch.optim.AdamW(params, lr=0.5)).lr == 0.5
    assert optimizer_settings(torch.optim.Adam(params, lr=0.1)).weight_decay == 0.0
    with pytest.raises(DynamoRuntimeError, match="the plan runs AdamW; SGD cannot be run"):
        optimizer_settings(torch.optim.SGD(params, lr=0.1))
    with pytest.raises(DynamoRuntimeError, match="L2, not decoupled"):
        optimizer_settings(torch.optim.Adam(params, lr=0.1, weight_decay=0.1))
