"""Lowering on a device that is not the capture's: graphs captured on the CPU name it (position ids'
``torch.arange(..., device=cpu)``), and ``build_stage`` points them at the rank's device.

The rank's device here is ``meta`` (CI has no GPU): a stage that still made a CPU tensor inside
would fail to mix it with the meta weights, as it failed on CUDA (first GPU run, 2026-11-26)."""
from __future__ import annotations

import pytest
import torch

from mist_compiler.ir.plan import Plan
from mist_compiler.ir.topology import RankCoord
from mist_compiler.lowering.lower import lower
from mist_compiler.lowering.materialize import ModuleTensors
from mist_compiler.models import build_model
from mist_compiler.verify.check import synthetic_batch

SEQ, BATCH = 32, 2


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_a_stage_built_for_another_device_makes_every_tensor_there(name, gpt_tiny_program, llama_tiny_program):
    program = {"gpt-tiny": gpt_tiny_program, "llama-tiny": llama_tiny_program}[name]
    plan = Plan.from_dict({"model": name, "seq_len": SEQ, "global_batch": BATCH, "dtype": "float32", "grad_accum": 1,
                           "stages": [{"layers": [0, 4], "nodes": 1, "gpus_per_node": 1, "micro_batch": BATCH,
                                       "dp": 1, "tp": 1}]})
    stage = lower(program, plan, RankCoord(0, 0, 0), ModuleTensors(build_model(name, seq_len=SEQ)),
                  device=torch.device("meta"))
    stage.materialize_all()
    graphs = [stage.module.graph] + [module.graph for _, module in stage.units]
    named = [value for graph in graphs for node in graph.nodes for value in node.kwargs.values()
             if isinstance(value, torch.device)]
    assert named and all(device.type == "meta" for device in named)
    batch = {key: value.to("meta") for key, value in synthetic_batch(512, BATCH, SEQ, 0).items()}
    loss = stage.module(**batch)
    assert loss.device.type == "meta"


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_hugging_face_stage_built_for_another_device_runs_there(kind):
    """Hugging Face graphs name devices in more places (position ids, masks, rotary tables)."""
    transformers = pytest.importorskip("transformers")
    from conftest import tiny_hf_config
    from mist_compiler.frontend.capture import capture

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_hf_config(kind))
    program = capture(model, seq_len=SEQ)
    plan = Plan.from_dict({"model": "hf", "seq_len": SEQ, "global_batch": BATCH, "dtype": "float32", "grad_accum": 1,
                           "stages": [{"layers": [0, 2], "nodes": 1, "gpus_per_node": 1, "micro_batch": BATCH,
                                       "dp": 1, "tp": 1}]})
    stage = lower(program, plan, RankCoord(0, 0, 0), ModuleTensors(model), device=torch.device("meta"))
    stage.materialize_all()
    batch = {key: value.to("meta") for key, value in synthetic_batch(128, BATCH, SEQ, 0).items()}
    loss = stage.module(**batch)
    assert loss.device.type == "meta"
