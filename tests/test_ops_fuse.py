"""fuse_linear_cross_entropy on dynamo torch-level graphs: our zoo models and tiny Hugging Face
causal LMs (Llama, Qwen2, GPT-2 with its Conv1D attention and tied head) train the same with the
fused op; chains it must not touch are left alone."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mist_compiler.frontend.joint import _logging_functions
from mist_compiler.models import build_model
from mist_compiler.ops import fuse_linear_cross_entropy

FUSED = torch.ops.mist.linear_cross_entropy.default


def _compile_and_compare(model: nn.Module, make_loss=None, expect_fused: bool = True) -> None:
    """Loss and every gradient of ``model`` through a recording backend that fuses, against eager."""
    reference = copy.deepcopy(model)
    seen: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs, **_):
        assert fuse_linear_cross_entropy(gm) == expect_fused
        seen.append(gm)
        return gm.forward

    def run(module, input_ids, labels):
        output = module(input_ids=input_ids, labels=labels) if make_loss is None else make_loss(module, input_ids, labels)
        return output if isinstance(output, torch.Tensor) else output.loss

    torch.manual_seed(1)
    ids = torch.randint(0, 100, (2, 16))
    compiled = torch.compile(run, backend=backend, fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(specialize_float=True, ignore_logging_functions=_logging_functions()):
        loss = compiled(model, ids, ids)
    torch._dynamo.reset_code(run.__code__)
    loss.backward()
    want = run(reference, ids, ids)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    for (name, got), expected in zip(model.named_parameters(), reference.parameters()):
        if expected.grad is not None:
            torch.testing.assert_close(got.grad, expected.grad, rtol=1e-5, atol=1e-6, msg=name)
    targets = [n.target for n in seen[-1].graph.nodes if n.op == "call_function"]
    assert (FUSED in targets) == expect_fused
    assert (F.cross_entropy in targets) != expect_fused


def test_zoo_gpt_and_llama():
    _compile_and_compare(build_model("gpt-tiny"))
    _compile_and_compare(build_model("llama-tiny"))


def _hf(kind: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                         eos_token_id=0)
    else:
        cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[kind]
        config = cls(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2)
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_hugging_face_for_causal_lm_loss(kind):
    """ForCausalLMLoss: labels padded and shifted, fixed_cross_entropy with ignore_index/reduction;
    GPT-2 ties its head to the token embedding."""
    _compile_and_compare(_hf(kind))


class _Head(nn.Module):
    def __init__(self, bias: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(128, 16)
        self.head = nn.Linear(16, 128, bias=bias)


def test_sum_reduction_and_ignore_index_are_kept():
    def loss(module, ids, labels):
        logits = module.head(module.embed(ids)).float()
        return F.cross_entropy(logits.reshape(-1, 128), labels.masked_fill(labels < 10, -1).reshape(-1),
                               ignore_index=-1, reduction="sum")

    _compile_and_compare(_Head(), loss)


@pytest.mark.parametrize("case", ["logits_used_twice", "head_bias", "label_smoothing", "no_reduction"])
def test_chains_it_must_not_fuse(case):
    def loss(module, ids, labels):
        logits = module.head(module.embed(ids))
        flat, target = logits.float().view(-1, 128), labels.reshape(-1)
        if case == "logits_used_twice":
            return F.cross_entropy(flat, target) + logits.square().mean()
        if case == "label_smoothing":
            return F.cross_entropy(flat, target, label_smoothing=0.1)
        if case == "no_reduction":
            return F.cross_entropy(flat, target, reduction="none").mean()
        return F.cross_entropy(flat, target)

    _compile_and_compare(_Head(bias=case == "head_bias"), loss, expect_fused=False)
