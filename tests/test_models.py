"""Reference models and the zoo: closed-form parameter counts, forward contract, name resolution errors."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from mist_compiler.models import (
    ZOO, ModelSpecError, TransformerConfig, TransformerLM, build_model, known_model_names, parameter_count,
    resolve_model, zoo_config,
)


def module_count(cfg: TransformerConfig) -> int:
    with torch.device("meta"):
        model = TransformerLM(cfg)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "gpt2-1.3b", "llama-7b", "llama-70b"])
def test_closed_form_parameter_count_matches_the_module(name):
    assert parameter_count(zoo_config(name)) == module_count(zoo_config(name))


@pytest.mark.parametrize("overrides", [{"bias": True}, {"tied_head": True}, {"kv_heads": 1},
                                       {"bias": True, "activation": "swiglu", "norm": "rmsnorm"}])
def test_closed_form_covers_config_switches(overrides):
    cfg = dataclasses.replace(zoo_config("gpt-tiny"), **overrides)
    assert parameter_count(cfg) == module_count(cfg)


def test_paper_sizes_are_what_their_names_say():
    assert round(parameter_count(zoo_config("gpt2-7b")) / 1e9, 1) == 6.9
    assert round(parameter_count(zoo_config("llama-70b")) / 1e9) == 69


def test_forward_contract_loss_and_logits():
    model = build_model("llama-tiny")
    ids = torch.randint(0, 512, (2, 10))
    loss = model(input_ids=ids, labels=ids)
    assert loss.dim() == 0 and loss.item() > 0
    assert model(input_ids=ids).shape == (2, 10, 512)
    again = build_model("llama-tiny")
    assert torch.equal(again(input_ids=ids, labels=ids), loss)  # seeded build is deterministic


def test_seq_len_beyond_max_seq_grows_positions():
    cfg = resolve_model("gpt-tiny", seq_len=256).config
    assert cfg.max_seq == 256 and zoo_config("gpt-tiny").max_seq == 128


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="hidden must be divisible by heads"):
        TransformerConfig(hidden=10, ffn=4, layers=1, heads=3)
    with pytest.raises(ValueError, match="norm must be 'layernorm' or 'rmsnorm'"):
        TransformerConfig(hidden=8, ffn=4, layers=1, heads=2, norm="batchnorm")
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['depth'\]"):
        TransformerConfig.from_dict({"hidden": 8, "ffn": 4, "layers": 1, "heads": 2, "depth": 3})
    assert TransformerConfig.from_dict(zoo_config("gpt-tiny").to_dict()) == zoo_config("gpt-tiny")


def test_name_resolution_errors(tmp_path):
    assert set(known_model_names()) == set(ZOO)
    with pytest.raises(ModelSpecError, match="unknown model 'gpt5'; known models: gpt2-1.3b"):
        resolve_model("gpt5")
    with pytest.raises(ModelSpecError, match="does not exist"):
        resolve_model(f"hf:{tmp_path}/missing.json")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ModelSpecError, match="not valid JSON"):
        resolve_model(f"hf:{bad}")
    with pytest.raises(ModelSpecError, match="cannot import module 'no_such_pkg_xyz'"):
        resolve_model("no_such_pkg_xyz:make")
    with pytest.raises(ModelSpecError, match="has no callable 'nope'"):
        resolve_model("math:nope")
    with pytest.raises(ModelSpecError, match="returned float, not an nn.Module"):
        resolve_model("random:random").build()


def test_factory_spec_builds_a_module():
    spec = resolve_model("torch.nn:Identity")
    assert isinstance(spec.build(), torch.nn.Identity) and spec.config is None


def test_cluster_scale_shapes_are_what_their_names_say():
    """Llama 3 405B (FACTS.md: 126 layers, hidden 16384, ffn 53248, 128/8 heads, vocab 128256) and GPT-3 175B."""
    llama = zoo_config("llama-405b")
    assert (llama.layers, llama.hidden, llama.ffn, llama.heads, llama.num_kv_heads, llama.vocab) == \
        (126, 16384, 53248, 128, 8, 128256)
    assert round(parameter_count(llama) / 1e9) == 406
    assert parameter_count(llama) == module_count(llama)
    gpt = zoo_config("gpt3-175b")
    assert (gpt.layers, gpt.hidden, gpt.heads) == (96, 12288, 96)
    assert round(parameter_count(gpt) / 1e9) == 175
