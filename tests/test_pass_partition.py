"""The partition pass over a captured program: stages compose to the model, values cross cuts, free values are recomputed."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from mist_compiler.frontend.capture import capture
from mist_compiler.frontend.layer_stack import LayerStackError, find_layer_stack
from mist_compiler.ir.plan import Plan
from mist_compiler.lowering.materialize import ModuleTensors, build_stage
from mist_compiler.passes.partition import HIDDEN, Partition, PartitionError


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


def _run_stages(model, program, plan, batch):
    values = ()
    for index in range(plan.pp):
        stage = Partition(plan, index)(program.model_graph).program
        built = build_stage(stage, program.model_graph, ModuleTensors(model), device=torch.device("cpu"))
        kwargs = {name: batch[name] for name in stage.interface.batch_inputs}
        values = built.module(*values, **kwargs)
    return values


@pytest.fixture(scope="module")
def skip_model():
    torch.manual_seed(0)
    model = SkipModel()
    return model, capture(model, seq_len=4)


def test_layer_stack_is_the_largest_list_of_identical_blocks():
    stack = find_layer_stack(SkipModel())
    assert stack.path == "layers" and len(stack) == 3
    with pytest.raises(LayerStackError, match="no nn.ModuleList"):
        find_layer_stack(nn.Sequential(nn.Linear(2, 2)))


def test_stages_compose_to_the_whole_model_and_values_cross_every_cut(skip_model):
    model, program = skip_model
    batch = {"input_ids": torch.randint(0, 16, (2, 4)), "labels": torch.randint(0, 16, (2, 4))}
    plan = _plan([(0, 1), (1, 2), (2, 3)])
    assert torch.allclose(_run_stages(model, program, plan, batch), model(**batch))
    first, middle, last = (Partition(plan, i)(program.model_graph).program.interface for i in range(3))
    assert first.batch_inputs == ["input_ids"] and [v.name for v in first.outputs][0] == HIDDEN
    assert len(first.outputs) == 2  # the hidden state and the embedding the head reads again
    assert [v.name for v in middle.inputs] == [v.name for v in first.outputs] == [v.name for v in middle.outputs]
    # the last stage recomputes `scale` from the batch's shape (a free value) instead of receiving it
    assert "labels" in last.batch_inputs and len(last.inputs) == 2
    assert all(v.batched and v.sample_shape == (4, 8) and v.needs_grad for v in middle.inputs)
    assert last.block_targets == ["layers.2"] and not last.outputs


def test_one_stage_plan_is_the_model_unchanged(skip_model):
    model, program = skip_model
    batch = {"input_ids": torch.randint(0, 16, (2, 4)), "labels": torch.randint(0, 16, (2, 4))}
    assert torch.equal(_run_stages(model, program, _plan([(0, 3)]), batch), model(**batch))


def test_every_layer_runs_its_group_representative_with_its_own_weights(skip_model):
    model, program = skip_model
    assert len(program.model_graph.regions) == 1 and program.model_graph.regions[0].layers == (0, 1, 2)
    stage = Partition(_plan([(0, 3)]), 0)(program.model_graph).program
    layers = stage.layer_units
    assert [u.name for u in layers] == ["layers.0", "layers.1", "layers.2"]
    assert layers[0].graph is layers[2].graph  # one program per group
    assert layers[2].tensors["proj.weight"] == ("parameter", "layers.2.proj.weight")


def test_plan_layers_that_do_not_match_the_model_are_an_error(skip_model):
    _, program = skip_model
    with pytest.raises(PartitionError, match="the plan covers 2 layers but the model has 3"):
        Partition(_plan([(0, 1), (1, 2)]), 0)(program.model_graph)


def test_pass_is_pure(skip_model):
    _, program = skip_model
    before = program.model_graph.graph.code
    Partition(_plan([(0, 2), (2, 3)]), 1)(program.model_graph)
    assert program.model_graph.graph.code == before


def test_code_between_layers_is_refused_naming_it():
    class Interleaved(SkipModel):
        def forward(self, input_ids, labels):
            x = self.embed(input_ids)
            for layer in self.layers:
                x = layer(x) * 0.5  # runs between the layers
            return F.cross_entropy(self.head(x).view(-1, 16), labels.reshape(-1))

    with pytest.raises(ValueError, match=r"code runs between the layers of layers \(after layers.0: mul at "
                                         r".*test_pass_partition.py:\d+"):
        capture(Interleaved(), seq_len=4)


class PairLayer(nn.Module):
    """Returns (hidden, gate); the model below feeds the gate to the next layer."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, gate=None):
        y = x + torch.tanh(self.proj(x))
        return (y if gate is None else y * gate), torch.sigmoid(y)


def test_a_layer_reading_what_the_previous_layer_returned_besides_its_hidden_state_is_refused():
    class Gated(SkipModel):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(PairLayer(8) for _ in range(3))

        def forward(self, input_ids, labels):
            x, gate = self.embed(input_ids), None
            for layer in self.layers:
                x, gate = layer(x, gate)  # the gate crosses from one layer to the next
            return F.cross_entropy(self.head(x).view(-1, 16), labels.reshape(-1))

    with pytest.raises(ValueError, match="layers.0 reads a tensor layers.0 returned besides its hidden state"):
        capture(Gated(), seq_len=4)


def test_a_layer_not_called_on_the_previous_layers_output_is_refused():
    class Parallel(SkipModel):
        def forward(self, input_ids, labels):
            e = self.embed(input_ids)
            outs = [layer(e) for layer in self.layers]  # every layer reads the embedding
            return F.cross_entropy(self.head(torch.stack(outs).sum(0)).view(-1, 16), labels.reshape(-1))

    with pytest.raises(ValueError, match="layers.0 is not called on the hidden state layers.0 returned"):
        capture(Parallel(), seq_len=4)


def test_users_own_layer_hooks_run_inside_the_layer_not_between_layers():
    model = SkipModel()
    for layer in model.layers:
        layer.register_forward_hook(lambda _m, _a, out: out * 1.0)  # a user's hook: part of the layer
        layer.register_forward_pre_hook(lambda _m, args: (args[0] + 0.0,))
    program = capture(model, seq_len=4)
    assert program.model_graph.num_layers == 3
    assert not model.layers[0]._forward_hooks_with_kwargs and len(model.layers[0]._forward_hooks) == 1  # untouched
