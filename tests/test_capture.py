"""capture(): blocks, classes, exact parameter counts, symbolic shapes, saved bytes, clear errors."""
from __future__ import annotations

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch import nn

from mist_compiler.frontend.capture import capture
from mist_compiler.frontend.joint import CaptureError, ModelOutputError
from mist_compiler.frontend.to_ir import UnsupportedOpError
from mist_compiler.ir.program import B, S
from mist_compiler.models import ModelSpecError, TransformerLM, parameter_count, zoo_config


def _layer_class(program):
    (cls,) = [c for c in program.block_classes.values() if c.kind == "layer"]
    return cls


@pytest.mark.parametrize("fixture, name", [("gpt_tiny_program", "gpt-tiny"), ("llama_tiny_program", "llama-tiny")])
def test_blocks_classes_and_exact_parameter_counts(request, fixture, name):
    program = request.getfixturevalue(fixture)
    cfg = zoo_config(name)
    assert [b.kind for b in program.blocks] == ["pre"] + ["layer"] * cfg.layers + ["post"]
    assert [b.index for b in program.layers] == list(range(cfg.layers))
    assert len(program.block_classes) == 3  # pre, one layer class, post
    assert program.params == parameter_count(cfg)
    model = TransformerLM(cfg)
    assert program.layers[0].param_count == sum(p.numel() for p in model.blocks[0].parameters())
    assert program.blocks[0].param_count == sum(p.numel() for p in model.embed.parameters()) + (
        model.pos_embed.weight.numel() if cfg.positions == "absolute" else 0)
    layer = _layer_class(program)
    hidden_state = [(B, S, cfg.hidden)]
    assert [t.shape for t in layer.outputs.values()] == hidden_state  # what a pipeline boundary sends
    assert [t.shape for t in program.block_classes[0].outputs.values()] == hidden_state
    assert layer.param_shapes["attn.q.weight"] == (cfg.hidden, cfg.hidden)
    assert layer.param_shapes["attn.k.weight"] == (cfg.num_kv_heads * cfg.head_dim, cfg.hidden)


@pytest.mark.parametrize("fixture", ["gpt_tiny_program", "llama_tiny_program"])
def test_every_shape_is_symbolic_in_b_and_s_only(request, fixture):
    program = request.getfixturevalue(fixture)
    layer = _layer_class(program)
    symbols = set()
    for node in layer.forward_nodes + layer.backward_nodes:
        for out in node.outputs:
            for dim in out.shape:
                symbols |= sympy.sympify(dim).free_symbols
    assert symbols == {B, S}
    # the q projection output is [b*s, hidden]; the attention op keeps [b, heads, s, head_dim]
    (attention,) = layer.attention
    cfg = zoo_config(program.model_name)
    assert attention.query.shape == (B, cfg.heads, S, cfg.head_dim)
    assert attention.key.shape == (B, cfg.heads, S, cfg.head_dim)  # after the GQA repeat
    assert attention.is_causal
    assert any(n.op == "attention" for n in layer.forward_nodes)
    assert any(n.op == "attention_backward" for n in layer.backward_nodes)


def gpt_layer_saved_bytes(cfg, b, s, element, attention):
    """Closed form (Megatron-style) bytes a pre-LN GPT layer keeps for backward, per micro-batch.

    Per token, in activation elements: the layer input x and the first LayerNorm's output (h
    each), q, k, v and the attention output (4h; the o-projection reads the same storage as the
    attention output), the residual sum x1 and the second LayerNorm's output (2h), the MLP up
    projection and its GELU (2 * ffn). Each LayerNorm keeps mean and rstd (one element each, in
    the activation dtype on this build). Flash attention adds its fp32 log-sum-exp (heads per
    token); the math kernel instead keeps the heads x s softmax probabilities. No dropout (the
    zoo has none), so Megatron's 34*s*b*h becomes 32*s*b*h here for ffn = 4h in fp16.
    """
    h, f, a = cfg.hidden, cfg.ffn, cfg.heads
    per_token = (8 * h + 2 * f) * element + 4 * element
    attention_bytes = a * 4 if attention == "flash" else a * s * element
    return b * s * (per_token + attention_bytes)


@pytest.mark.parametrize("dtype, element", [("float32", 4), ("float16", 2)])
def test_gpt_layer_saved_bytes_match_closed_form(gpt_tiny_program, dtype, element):
    program = gpt_tiny_program if dtype == "float32" else capture("gpt-tiny", dtype=dtype)
    assert program.dtype == dtype
    cfg = zoo_config("gpt-tiny")
    layer = _layer_class(program)
    for attention in ("flash", "math"):
        for b, s in [(1, 128), (4, 64), (3, 17)]:
            expected = gpt_layer_saved_bytes(cfg, b, s, element, attention)
            assert program.saved_bytes(layer.class_id, b, s, attention) == expected, (attention, b, s)
    expr = program.saved_bytes_expr(layer.class_id, "math")
    assert sympy.degree(expr, S) == 2 and sympy.degree(program.saved_bytes_expr(layer.class_id, "flash"), S) == 1


def eager_saved_bytes(module: nn.Module, x: torch.Tensor) -> int:
    """Bytes eager autograd keeps for ``module(x)``'s backward: distinct non-parameter storages."""
    parameters = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(x).sum().backward()
    return sum(storages.values())


@pytest.mark.parametrize("fixture, name", [("gpt_tiny_program", "gpt-tiny"), ("llama_tiny_program", "llama-tiny")])
def test_saved_bytes_match_what_eager_autograd_keeps(request, fixture, name):
    """The CPU run uses the flash kernel, so the flash model must equal eager, storage by storage."""
    program = request.getfixturevalue(fixture)
    layer = _layer_class(program)
    block = TransformerLM(zoo_config(name)).blocks[0]
    for b, s in [(2, 16), (3, 40)]:
        x = torch.randn(b, s, zoo_config(name).hidden, requires_grad=True)
        assert program.saved_bytes(layer.class_id, b, s, "flash") == eager_saved_bytes(block, x), (b, s)


def test_attention_output_is_not_double_counted(gpt_tiny_program):
    """The o-projection's input is a view of the attention output: one storage, counted once."""
    layer = _layer_class(gpt_tiny_program)
    (attention,) = layer.attention
    names = [name for name, _ in layer.saved_tensors("flash")]
    assert f"{attention.node}.out" in names
    hidden_sized = [info for _, info in layer.saved_tensors("flash") if info.numel() == B * S * 64]
    assert len(hidden_sized) == 8  # x, ln1, q, k, v, out, x1, ln2


def test_different_layers_get_different_classes():
    import dataclasses

    from mist_compiler.models.transformer import Block

    cfg = zoo_config("gpt-tiny")
    model = TransformerLM(cfg)
    model.blocks[2] = Block(dataclasses.replace(cfg, ffn=128))  # a narrower MLP in layer 2
    program = capture(model)
    layer_classes = [c for c in program.block_classes.values() if c.kind == "layer"]
    assert len(layer_classes) == 2
    by_index = {b.index: b.class_id for b in program.layers}
    assert by_index[0] == by_index[1] == by_index[3] != by_index[2]
    assert program.block_class(by_index[2]).representative == "blocks.2"
    assert program.block_class(by_index[2]).param_shapes["mlp.up.weight"] == (128, 64)
    assert program.params == sum(p.numel() for p in model.parameters())
    narrow, wide = program.saved_bytes(by_index[2], 1, 8), program.saved_bytes(by_index[0], 1, 8)
    assert wide - narrow == 8 * 2 * (256 - 128) * 4  # up and GELU outputs, fp32, 8 tokens


def test_capture_of_a_module_keeps_its_real_weights_untouched():
    torch.manual_seed(0)
    model = TransformerLM(zoo_config("gpt-tiny"))
    before = model.head.weight.detach().clone()
    program = capture(model, (torch.zeros(4, 4, dtype=torch.int32),))  # example inputs fix the token dtype
    assert program.params == sum(p.numel() for p in model.parameters())
    assert not model.head.weight.is_meta and torch.equal(model.head.weight.detach(), before)
    assert type(model.head.weight) is nn.Parameter
    assert any(t.tensor.dtype == "int32" for t in program.block_classes[0].saved)


@pytest.mark.parametrize("kind, as_module", [("llama", False), ("gpt2", True)])
def test_capture_hugging_face_config(hf_config_path, kind, as_module):
    transformers = pytest.importorskip("transformers")
    path, config = hf_config_path(kind)
    model = transformers.AutoModelForCausalLM.from_config(config)
    program = capture(model if as_module else "hf:" + path)
    assert program.params == sum(p.numel() for p in model.parameters())  # tied weights counted once
    assert len(program.layers) == 2 and len(program.block_classes) == 3
    assert program.seq_len == 64
    layer = _layer_class(program)
    assert layer.attention and layer.saved_bytes_expr("flash").free_symbols <= {B, S}


def test_unknown_model_name_lists_known_models():
    with pytest.raises(ModelSpecError, match="unknown model 'gpt-nope'.*gpt2-7b.*llama-tiny"):
        capture("gpt-nope")


class ReturnsHidden(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)

    def forward(self, input_ids, labels=None):
        return self.embed(input_ids).sum(-1)  # [batch, seq]: neither a loss nor logits


class ReturnsString(ReturnsHidden):
    def forward(self, input_ids, labels=None):
        return {"text": "hello"}


@pytest.mark.parametrize("model, described", [(ReturnsHidden(), r"a tensor of shape \(2, 16\)"),
                                               (ReturnsString(), "dict")])
def test_model_returning_neither_loss_nor_logits(model, described):
    with pytest.raises(ModelOutputError, match=f"must return a scalar loss.*returned {described}"):
        capture(model)


class UsesCond(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.head = nn.Linear(8, 32)

    def forward(self, input_ids, labels=None):
        x = self.embed(input_ids)
        x = torch.cond(x.sum() > 0, lambda t: t * 2.0, lambda t: t.sin(), (x,))
        logits = self.head(x)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_unrepresentable_op_names_op_and_user_source():
    with pytest.raises(UnsupportedOpError, match=r"op 'torch.ops.higher_order.cond'.*test_capture.py.*line \d+"):
        capture(UsesCond())


def test_every_value_a_node_reads_has_a_shape(gpt_tiny_program):
    """Cost models need input shapes: weights, the block input and graph-computed sizes are all known."""
    layer = _layer_class(gpt_tiny_program)
    mm = next(n for n in layer.forward_nodes if n.op == "aten.mm.default")
    assert [layer.tensor(name).shape[-1] for name in mm.inputs] == [64, 64]
    assert layer.tensor(mm.inputs[0]).shape == (B * S, 64)
    sizes = [n.attrs["value"] for n in layer.forward_nodes if "value" in n.attrs]
    assert "b*s" in sizes
    for node in layer.forward_nodes + layer.backward_nodes:
        if node.op in ("aten.mm.default", "aten.addmm.default", "attention", "attention_backward"):
            assert all(layer.tensor(name) is not None for name in node.inputs), node.name


def test_example_inputs_are_checked():
    with pytest.raises(ValueError, match="input_ids must be a 2-D integer tensor"):
        capture("gpt-tiny", (torch.zeros(4, 4),))
    with pytest.raises(ValueError, match="expected \\(input_ids,\\) or \\(input_ids, labels\\), got 3"):
        capture("gpt-tiny", (torch.zeros(2, 2, dtype=torch.long),) * 3)


class GraphBreak(UsesCond):
    def forward(self, input_ids, labels=None):
        x = self.embed(input_ids)
        torch._dynamo.graph_break()
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def test_graph_break_is_a_clear_error():
    with pytest.raises(CaptureError, match=r"cannot trace the model's forward and backward into one graph: .*graph_break"):
        capture(GraphBreak())


def test_bad_options():
    import mist_compiler
    from mist_compiler import driver

    assert mist_compiler.capture is driver.capture  # the package-level API is the driver's
    with pytest.raises(ValueError, match="attention must be one of"):
        capture("gpt-tiny", attention="paged")
    with pytest.raises(ValueError, match="dtype must be one of"):
        capture("gpt-tiny", dtype="int8")
