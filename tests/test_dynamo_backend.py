"""torch.compile(model, backend="mist"): same loss and gradients as eager, analysis kept, plan hand-over."""
from __future__ import annotations

import sys
import types

import pytest
import torch

import mist_compiler.torch_compile.backend as dynamo_backend
from mist_compiler.ir.program import B, S
from mist_compiler.models import build_model, parameter_count, zoo_config


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    dynamo_backend.forget_programs()
    yield
    torch._dynamo.reset()


def _loss(output):
    return output if isinstance(output, torch.Tensor) else output.loss


def assert_same_as_eager(model, vocab, dynamic=None):
    torch.manual_seed(1)
    input_ids = torch.randint(0, vocab, (2, 12))
    labels = torch.randint(0, vocab, (2, 12))
    eager = _loss(model(input_ids=input_ids, labels=labels))
    eager.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(model, backend="mist", dynamic=dynamic)
    loss = _loss(compiled(input_ids=input_ids, labels=labels))
    loss.backward()
    torch.testing.assert_close(loss, eager, rtol=1e-6, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-5, atol=1e-6, msg=f"gradient of {name}")


@pytest.mark.parametrize("name, dynamic", [("gpt-tiny", True), ("llama-tiny", None)])
def test_zoo_models_match_eager_and_are_analysed(name, dynamic):
    model = build_model(name)
    assert_same_as_eager(model, zoo_config(name).vocab, dynamic)
    program = dynamo_backend.last_program()
    assert program is not None
    assert program.params == parameter_count(zoo_config(name))
    assert len(program.layers) == zoo_config(name).layers and len(program.block_classes) == 3
    layer = next(c for c in program.block_classes.values() if c.kind == "layer")
    assert layer.attention and layer.saved_bytes_expr("flash").subs({B: 2, S: 12}) > 0
    # dynamic=True: the analysis is symbolic in b and s; otherwise it is at the compiled sizes
    assert layer.saved_bytes_expr("flash").free_symbols == ({B, S} if dynamic else set())


@pytest.mark.parametrize("kind", ["llama", pytest.param("gpt2", marks=pytest.mark.heavy)])
def test_hugging_face_models_match_eager(hf_config_path, kind):
    pytest.importorskip("transformers")
    path, _ = hf_config_path(kind)
    model = build_model("hf:" + path)  # a tiny config.json written by the test, random weights
    assert_same_as_eager(model, 128)
    programs = dynamo_backend.compiled_programs()
    assert programs and programs[-1] is dynamo_backend.last_program()
    # Hugging Face's loss logs a warning: dynamo may split the model into several graphs
    assert sum(p.params for p in programs) == sum(p.numel() for p in model.parameters())


def test_backend_is_registered_under_mist():
    assert "mist" in torch._dynamo.list_backends(exclude_tags=())


def test_plan_option_is_handed_to_the_runtime(monkeypatch):
    calls = []
    from mist_compiler.torch_compile import plan_runtime

    def compile_with_plan(gm, example_inputs, options):
        calls.append(options)
        return gm.forward

    monkeypatch.setattr(plan_runtime, "compile_with_plan", compile_with_plan)
    compiled = torch.compile(lambda x: (x * 2).sum(), backend="mist", options={"plan": "plan.json"})
    assert compiled(torch.ones(3)).item() == 6.0
    assert calls == [{"plan": "plan.json"}]


def test_bad_attention_option():
    compiled = torch.compile(lambda x: (x * 2).sum(), backend="mist", options={"attention": "paged"})
    with pytest.raises(Exception, match="option 'attention' must be one of"):
        compiled(torch.ones(3))
