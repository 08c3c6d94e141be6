"""Tensor parallelism: the one recogniser on small models, its edits, refusals, and the proof on the model."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mist_compiler.frontend.capture import capture
from mist_compiler.ir.model_graph import RegionSharding
from mist_compiler.passes.tp_recognition import map_view_dim
from mist_compiler.passes.tp_sharding import TensorParallelError, check_degree
from mist_compiler.verify.tp_check import prove_tensor_parallel
from tests.user_models import fused_gpt, nano_gpt


def _shards(program, label="layer:0") -> dict[str, tuple]:
    region = program.model_graph.tp.regions[label]
    paths = dict(program.model_graph.regions[0].params) if label.startswith("layer") else \
        {p: name for p, (_, name) in program.model_graph.tensors.items()}
    return {paths[p]: (spec.dim, spec.segments) for p, spec in region.shards.items()}


def test_view_dimension_mapping():
    assert map_view_dim([2, 8, 64], [2, 8, 4, 16], 2) == 2  # features -> heads (outermost of the split)
    assert map_view_dim([2, 8, 4, 16], [2, 8, 64], 2) == 2  # heads merged back into features
    assert map_view_dim([2, 8, 4, 16], [2, 8, 64], 3) is None  # a split head dim cannot stay contiguous
    assert map_view_dim([16, 96], [2, 8, 96], 1) == 2


def test_gpt_and_llama_layers_split_megatron_style(gpt_tiny_program, llama_tiny_program):
    plan = gpt_tiny_program.model_graph.tp
    assert plan.supported, plan.reason
    assert _shards(gpt_tiny_program) == {"attn.q.weight": (0, ()), "attn.k.weight": (0, ()), "attn.v.weight": (0, ()),
                                         "attn.o.weight": (1, ()), "mlp.up.weight": (0, ()), "mlp.down.weight": (1, ())}
    assert _shards(gpt_tiny_program, "pre") == {"embed.weight": (0, ())}  # vocabulary-parallel embedding
    assert _shards(gpt_tiny_program, "post") == {"head.weight": (0, ())}  # vocabulary-parallel head and loss
    kinds = [e.kind for e in plan.regions["layer:0"].edits]
    assert kinds.count("copy_in") == 2 and kinds.count("reduce_out") == 2  # f before q/k/v and up, g after o and down
    assert plan.granularity == 4  # 4 heads
    assert llama_tiny_program.model_graph.tp.granularity == 2  # 2 key/value heads (grouped-query attention)
    check_degree(llama_tiny_program.model_graph.tp, 2)
    with pytest.raises(TensorParallelError, match="tp=4 does not divide .* gcd is 2"):
        check_degree(llama_tiny_program.model_graph.tp, 4)


def test_fused_qkv_hard_coded_heads_and_tied_head_are_recognised():
    program = capture(fused_gpt(), seq_len=8)
    plan = program.model_graph.tp
    assert plan.supported, plan.reason
    shards = _shards(program)
    assert shards["attn.qkv.weight"] == (0, (32, 32, 32)) and shards["attn.qkv.bias"] == (0, (32, 32, 32))
    edits = plan.regions["layer:0"].edits
    assert sum(e.kind == "divide_arg" for e in edits) >= 4  # split size and the three view(B, T, n_head, -1)
    assert _shards(program, "pre") == _shards(program, "post") == {"tokens.weight": (0, ())}  # tied: split together


class Layered(nn.Module):
    """Embedding, a list of ``layer()`` layers, a head and the loss."""

    def __init__(self, layer) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(layer() for _ in range(2))
        self.head = nn.Linear(16, 32)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x).view(-1, 32), labels.view(-1))


class NormedQ(nn.Module):
    """A layer normalising the whole (split) query projection: a norm over split features."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(16, 16), nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        return x + self.o(self.norm(self.q(x)))


class Routed(nn.Module):
    """A softmax over a linear's outputs (a router): that linear stays whole, the rest is split."""

    def __init__(self) -> None:
        super().__init__()
        self.router, self.up, self.down = nn.Linear(16, 4), nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        weight = F.softmax(self.router(x), dim=-1)[..., :1]
        return x + weight * self.down(F.gelu(self.up(x)))


class PrefixSummed(nn.Module):
    """A running sum over the projected features: no split of them computes it."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return x + self.o(torch.cumsum(self.q(x), dim=-1))


def test_a_norm_over_split_features_gets_its_statistics_all_reduced_and_is_proven():
    program = capture(Layered(NormedQ), seq_len=8)
    plan = program.model_graph.tp
    assert plan.supported, plan.reason
    assert _shards(program) == {"q.weight": (0, ()), "q.bias": (0, ()), "norm.weight": (0, ()), "norm.bias": (0, ()),
                                "o.weight": (1, ())}
    assert [e.kind for e in plan.regions["layer:0"].edits].count("tp_norm") == 1
    prove_tensor_parallel(program, 2)


def test_a_linear_no_split_fits_is_replicated_with_its_reason_and_the_rest_split():
    program = capture(Layered(Routed), seq_len=8)
    region = program.model_graph.tp.regions["layer:0"]
    assert _shards(program) == {"up.weight": (0, ()), "up.bias": (0, ()), "down.weight": (1, ())}
    (why,) = region.replicated.values()
    assert "softmax" in why and "test_pass_tp_sharding.py" in why
    prove_tensor_parallel(program, 2)


def test_an_unsplittable_layer_is_refused_naming_the_layer_op_and_source_line():
    program = capture(Layered(PrefixSummed), seq_len=8)
    plan = program.model_graph.tp
    assert not plan.supported
    assert "layer layers.0" in plan.reason and "cumsum" in plan.reason and "test_pass_tp_sharding.py" in plan.reason
    with pytest.raises(TensorParallelError, match="tensor parallelism is not possible for this model"):
        check_degree(plan, 2)


@pytest.mark.parametrize("view_qkv", [False, True], ids=["split", "view-B-T-3-h-d"])
def test_nanogpt_fused_c_attn_is_split_per_part_and_per_head(view_qkv):
    program = capture(nano_gpt(0.0, view_qkv), seq_len=8)
    shards = _shards(program)
    assert shards["attn.c_attn.weight"] == shards["attn.c_attn.bias"] == (0, (32, 32, 32))
    assert shards["attn.c_proj.weight"] == (1, ()) and program.model_graph.tp.granularity == 4
    prove_tensor_parallel(program, 2)


def test_the_split_is_proven_on_the_model_and_a_wrong_split_is_caught(gpt_tiny_program):
    prove_tensor_parallel(gpt_tiny_program, 2)
    prove_tensor_parallel(capture(fused_gpt(), seq_len=8), 2)
    # a split the rules got wrong (the head-count rewrites forgotten) must not pass
    program = capture(fused_gpt(), seq_len=8)
    graph = program.model_graph
    layer = graph.tp.regions["layer:0"]
    wrong = RegionSharding(layer.shards, [e for e in layer.edits if e.kind != "divide_arg"])
    sabotaged = replace(program, model_graph=replace(graph, tp=replace(graph.tp, regions={**graph.tp.regions,
                                                                                          "layer:0": wrong})))
    with pytest.raises(TensorParallelError, match="tp=2: the split program"):
        prove_tensor_parallel(sabotaged, 2)


def test_a_gradient_zero_up_to_rounding_is_judged_at_the_models_gradient_scale(tmp_path):
    """OPT's key-projection bias has a zero gradient (softmax ignores a constant added to every key):
    its rounding noise must not refuse the split, while a real difference still does."""
    from mist_compiler.verify.tp_check import TOLERANCE, _difference

    noise = torch.full((8,), 1e-9)
    assert _difference(noise, -noise, typical=1.0) < TOLERANCE
    assert _difference(torch.full((8,), 1e-2), torch.zeros(8), typical=1.0) > TOLERANCE
    assert _difference(torch.full((8,), 1.01), torch.ones(8), typical=1e-6) > TOLERANCE  # relative when not tiny
    pytest.importorskip("transformers")
    from tests.hf_configs import write_config

    program = capture(write_config("opt", str(tmp_path / "opt"), dropout=False), seq_len=8, analyse=False)
    prove_tensor_parallel(program, 2)
