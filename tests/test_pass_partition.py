"""The pipeline partition pass on small graphs: stage assignment, crossing values, free nodes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mist_compiler.frontend.layer_stack import LayerStackError, find_layer_stack
from mist_compiler.ir.plan import Plan
from mist_compiler.passes.partition import Partition, PartitionError, stage_interface, trace_model


class Layer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.proj(x))


class SkipModel(nn.Module):
    """The embedding output is used again after the last layer: it crosses every cut."""

    def __init__(self, layers: int = 3, dim: int = 8, vocab: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Layer(dim) for _ in range(layers))
        self.extra = nn.ModuleList([nn.ReLU()])  # a smaller ModuleList: not the layer stack
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids, labels):
        e = self.embed(input_ids)
        x = e
        for layer in self.layers:
            x = layer(x)
        scale = input_ids.shape[1] ** -0.5  # batch-only code: recomputed where needed, never sent
        logits = self.head(x * scale + e)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))


def _plan(ranges, seq=4) -> Plan:
    stages = [{"layers": list(r), "nodes": 1, "gpus_per_node": 1, "micro_batch": 2, "dp": 1, "tp": 1} for r in ranges]
    return Plan.from_dict({"model": "toy", "seq_len": seq, "global_batch": 2, "dtype": "float32", "grad_accum": 1,
                           "stages": stages})


def _run_stages(gm, plan, batch):
    values = ()
    for index in range(plan.pp):
        stage = Partition(plan, index)(gm).program
        kwargs = {name: batch[name] for name in stage_interface(stage).batch_inputs}
        values = stage(*values, **kwargs)
    return values


def test_layer_stack_is_the_largest_list_of_identical_blocks():
    stack = find_layer_stack(SkipModel())
    assert stack.path == "layers" and len(stack) == 3
    with pytest.raises(LayerStackError, match="no nn.ModuleList"):
        find_layer_stack(nn.Sequential(nn.Linear(2, 2)))


def test_stages_compose_to_the_whole_model_and_values_cross_every_cut():
    torch.manual_seed(0)
    model = SkipModel()
    batch = {"input_ids": torch.randint(0, 16, (2, 4)), "labels": torch.randint(0, 16, (2, 4))}
    plan = _plan([(0, 1), (1, 2), (2, 3)])
    gm = trace_model(model)
    assert torch.allclose(_run_stages(gm, plan, batch), model(**batch))
    first, middle, last = (stage_interface(Partition(plan, i)(gm).program) for i in range(3))
    assert first.batch_inputs == ["input_ids"] and [v.name for v in first.outputs] == ["embed", "layers_0"]
    assert [v.name for v in middle.inputs] == ["embed", "layers_0"] and [v.name for v in middle.outputs] == ["embed", "layers_1"]
    # the last stage recomputes `scale` from input_ids (a free node) instead of receiving it
    assert sorted(last.batch_inputs) == ["input_ids", "labels"]
    assert all(v.batched and v.sample_shape == (4, 8) and v.needs_grad for v in middle.inputs)
    assert last.block_targets == ["layers.2"] and not last.outputs


def test_one_stage_plan_is_the_model_unchanged():
    model = SkipModel()
    batch = {"input_ids": torch.randint(0, 16, (2, 4)), "labels": torch.randint(0, 16, (2, 4))}
    result = Partition(_plan([(0, 3)]), 0)(trace_model(model))
    assert not result.modified
    assert torch.equal(result.program(**batch), model(**batch))


def test_plan_layers_beyond_the_model_are_an_error():
    gm = trace_model(SkipModel(layers=2))
    with pytest.raises(PartitionError, match="stage 2 is out of range"):
        Partition(_plan([(0, 1), (1, 2)]), 2)
    plan = _plan([(0, 1), (1, 2)])
    stage = Partition(plan, 1)(gm).program  # fine: 2 layers, 2 stages
    assert stage_interface(stage).block_targets == ["layers.1"]


def test_pass_is_pure():
    gm = trace_model(SkipModel())
    before = gm.code
    Partition(_plan([(0, 2), (2, 3)]), 1)(gm)
    assert gm.code == before
