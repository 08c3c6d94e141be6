"""Model names the CLI and API accept, and how each becomes an ``nn.Module``.

Three spellings (see DESIGN.md section 1):
- a zoo name: ``gpt2-7b``, ``llama-70b``, ``gpt-tiny`` ... (the table below, from shared/FACTS.md);
- ``hf:path/to/config.json``: a Hugging Face causal LM built from its config, random weights;
- ``package.module:function``: a user's factory returning the module (called with no arguments).
"""
from __future__ import annotations

import importlib
import inspect
import json
import os
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import nn

from .hf_config_checks import RawConfig, config_problem
from .initialize import has_init_rule, initialize
from .transformer import TransformerConfig, TransformerLM


def _gpt(hidden: int, ffn: int, layers: int, heads: int, **overrides) -> TransformerConfig:
    return TransformerConfig(
        hidden=hidden, ffn=ffn, layers=layers, heads=heads, family="gpt", norm="layernorm",
        activation="gelu", positions="absolute", **overrides,
    )


def _llama(hidden: int, ffn: int, layers: int, heads: int, **overrides) -> TransformerConfig:
    return TransformerConfig(
        hidden=hidden, ffn=ffn, layers=layers, heads=heads, family="llama", norm="rmsnorm",
        activation="swiglu", positions="rotary", **overrides,
    )


ZOO: dict[str, TransformerConfig] = {
    # the Mist paper's GPT variant: no biases, untied head, vocab 50304
    "gpt2-1.3b": _gpt(2048, 8192, 24, 16),
    "gpt2-2.7b": _gpt(2560, 10240, 32, 32),
    "gpt2-7b": _gpt(4096, 16384, 32, 32),
    "gpt2-8b": _gpt(4096, 16384, 40, 32),
    "gpt2-13b": _gpt(5120, 20480, 40, 40),
    "gpt2-20b": _gpt(6144, 24576, 44, 64),
    "gpt2-22b": _gpt(6144, 24576, 48, 64),
    "gpt2-40b": _gpt(8192, 32768, 48, 64),
    "llama-350m": _llama(1024, 2816, 24, 16),
    "llama-1.3b": _llama(2048, 5632, 24, 16),
    "llama-2.7b": _llama(2560, 6912, 32, 32),
    "llama-7b": _llama(4096, 11008, 32, 32),
    "llama-13b": _llama(5120, 13824, 40, 40),
    "llama-22b": _llama(6144, 16384, 48, 64),
    "llama-70b": _llama(8192, 28672, 80, 64, kv_heads=8),
    # what people plan at cluster scale (FACTS.md): Llama 3 405B (GQA, 128K vocabulary, rope base 500000,
    # trained at sequence 8192) and the GPT-3 175B shape (96 layers, hidden 12288, 96 heads) in the
    # zoo's GPT flavour (vocab 50304, sequence 2048)
    "llama-405b": _llama(16384, 53248, 126, 128, kv_heads=8, vocab=128256, max_seq=8192, rope_theta=500000.0),
    "gpt3-175b": _gpt(12288, 49152, 96, 96),
    # small models for tests, examples and CPU benchmarks
    "gpt-tiny": _gpt(64, 256, 4, 4, vocab=512, max_seq=128),
    "llama-tiny": _llama(64, 176, 4, 4, vocab=512, kv_heads=2, max_seq=128),
    "gpt-small": _gpt(384, 1536, 4, 6, vocab=8192, max_seq=256),
    "llama-small": _llama(384, 1024, 4, 6, vocab=8192, max_seq=256),
}


class ModelSpecError(ValueError):
    """A model name, config file or factory that cannot be turned into a model."""


@dataclass(frozen=True)
class ModelSpec:
    """A resolved model name: how to build it, and its config when it is one of ours."""

    name: str
    build: Callable[[], nn.Module]
    config: TransformerConfig | None = None


def known_model_names() -> list[str]:
    return list(ZOO)


def zoo_config(name: str, seq_len: int | None = None) -> TransformerConfig:
    if name not in ZOO:
        raise ModelSpecError(
            f"unknown model {name!r}; known models: {', '.join(ZOO)}; "
            "or use hf:path/to/config.json or package.module:function"
        )
    cfg = ZOO[name]
    if seq_len is not None and seq_len > cfg.max_seq:
        cfg = replace(cfg, max_seq=seq_len)
    return cfg


def _hf_builder(path: str) -> Callable[[], nn.Module]:
    if not os.path.isfile(path):
        raise ModelSpecError(f"hf: config file {path!r} does not exist")
    try:
        with open(path) as handle:
            data = json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelSpecError(f"hf: config file {path!r} is not valid JSON: {error}") from None
    model_type = data.get("model_type") if isinstance(data, dict) else None

    def build() -> nn.Module:
        try:
            import transformers
        except ImportError:
            raise ModelSpecError("hf: models need the 'transformers' package (pip install transformers)") from None
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        if not isinstance(model_type, str):
            raise ModelSpecError(f"hf:{path}: the config has no model_type (a Hugging Face config.json names one)")
        if model_type not in CONFIG_MAPPING:
            raise ModelSpecError(f"hf:{path}: model_type {model_type!r} is not an architecture transformers "
                                 f"{transformers.__version__} knows")
        problem = config_problem(RawConfig(data))  # before transformers divides by a zero head count
        if problem is not None:
            raise ModelSpecError(f"hf:{path}: config field {problem}")
        try:
            config = transformers.AutoConfig.from_pretrained(
                os.path.dirname(os.path.abspath(path)) if os.path.basename(path) == "config.json" else path)
            problem = config_problem(config)
            if problem is not None:
                raise ModelSpecError(f"hf:{path}: config field {problem}")
            return transformers.AutoModelForCausalLM.from_config(config)
        except ModelSpecError:
            raise
        except Exception as error:  # noqa: BLE001 (transformers' validators raise their own classes; text spans paragraphs)
            lines = [line.strip() for line in str(error).splitlines() if line.strip()]
            text = " ".join(lines[:3])[:400] if lines else type(error).__name__
            raise ModelSpecError(f"hf:{path} (model_type {model_type!r}): {text}") from None

    return build


def _factory_builder(spec: str) -> Callable[[], nn.Module]:
    module_name, _, function_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ModelSpecError(f"cannot import module {module_name!r} for model factory {spec!r}: {error}") from None
    except SyntaxError as error:
        raise ModelSpecError(f"model factory {spec!r}: {error.filename} line {error.lineno} does not parse: "
                             f"{error.msg}") from None
    except Exception as error:  # the user's module-level code: report it in one line, naming the module
        raise ModelSpecError(f"model factory {spec!r}: importing {module_name} raised {type(error).__name__}: "
                             f"{error}") from None
    factory = getattr(module, function_name, None)
    if not callable(factory):
        raise ModelSpecError(f"model factory {spec!r}: {module_name} has no callable {function_name!r}")

    try:
        inspect.signature(factory).bind()
    except TypeError as error:
        raise ModelSpecError(f"model factory {spec!r} must be callable without arguments: {error}") from None
    except ValueError:  # no signature to inspect (a builtin): try it
        pass

    def build() -> nn.Module:
        try:
            model = factory()
        except Exception as error:  # the user's code: report it in one line, naming the factory
            raise ModelSpecError(f"model factory {spec!r} raised {type(error).__name__}: {error}") from None
        if not isinstance(model, nn.Module):
            raise ModelSpecError(f"model factory {spec!r} returned {type(model).__name__}, not an nn.Module")
        return model

    return build


def resolve_model(spec: str, seq_len: int | None = None) -> ModelSpec:
    """Turn a model name (zoo, ``hf:``, ``module:function``) into a :class:`ModelSpec`."""
    if spec.startswith("hf:"):
        return ModelSpec(spec, _hf_builder(spec[3:]))
    if ":" in spec:
        return ModelSpec(spec, _factory_builder(spec))
    cfg = zoo_config(spec, seq_len)
    return ModelSpec(spec, lambda: TransformerLM(cfg), cfg)


def build_model(spec: str, seq_len: int | None = None, seed: int | None = 0) -> nn.Module:
    """Build the named model with real (random) weights on the CPU.

    With a ``seed``, a model with a per-module initialisation rule is initialised module by
    module from it (:mod:`.initialize`), as every rank of a plan initialises its own shards; other
    models keep their constructor's initialisation under the global seed."""
    if seed is not None:
        torch.manual_seed(seed)
    model = resolve_model(spec, seq_len).build()
    if seed is not None and has_init_rule(model):
        initialize(model, seed)
    return model
