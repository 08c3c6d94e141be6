"""Model names the CLI and API accept, and how each becomes an ``nn.Module``.

Four spellings (see DESIGN.md section 1):
- a zoo name: ``gpt2-7b``, ``llama-70b``, ``gpt-tiny`` ... (the table below, from shared/FACTS.md);
- ``hf:DIR``: a Hugging Face causal LM with its pretrained weights, from a ``save_pretrained``
  directory (``config.json`` and ``model.safetensors`` or a sharded safetensors index);
- ``hf:path/to/config.json``: a Hugging Face causal LM built from its config, random weights. Only
  where that is unambiguous: a ``config.json`` next to weights is refused (say ``hf:DIR`` to load
  them, or copy the config elsewhere to start from random weights);
- ``package.module:function``: a user's factory returning the module (called with no arguments);
  one that calls ``from_pretrained`` reads no weights when the model is built virtually (capture,
  the ranks of a plan: :mod:`.pretrained`), and its weights are then read from the checkpoint.

Pretrained weights are never re-initialised: :func:`build_model` initialises (seeded, module by
module) only the modules that hold no tensor of a checkpoint.
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
from .pretrained import (
    Checkpoint, CheckpointError, PretrainedTensors, checkpoint_names, holds_weights, is_virtual_build, note_loaded,
    reading_deferred, record_checkpoint,
)
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
            "or use hf:DIR, hf:path/to/config.json or package.module:function"
        )
    cfg = ZOO[name]
    if seq_len is not None and seq_len > cfg.max_seq:
        cfg = replace(cfg, max_seq=seq_len)
    return cfg


def _hf_config(path: str, spec: str):
    """The transformers config of ``config.json`` at ``path`` (errors in one line, naming ``spec``)."""
    try:
        with open(path) as handle:
            data = json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelSpecError(f"{spec}: config file {path!r} is not valid JSON: {error}") from None
    model_type = data.get("model_type") if isinstance(data, dict) else None
    try:
        import transformers
    except ImportError:
        raise ModelSpecError("hf: models need the 'transformers' package (pip install transformers)") from None
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not isinstance(model_type, str):
        raise ModelSpecError(f"{spec}: the config has no model_type (a Hugging Face config.json names one)")
    if model_type not in CONFIG_MAPPING:
        raise ModelSpecError(f"{spec}: model_type {model_type!r} is not an architecture transformers "
                             f"{transformers.__version__} knows")
    problem = config_problem(RawConfig(data))  # before transformers divides by a zero head count
    if problem is not None:
        raise ModelSpecError(f"{spec}: config field {problem}")
    try:
        config = transformers.AutoConfig.from_pretrained(
            os.path.dirname(os.path.abspath(path)) if os.path.basename(path) == "config.json" else path)
    except Exception as error:  # noqa: BLE001 (transformers' validators raise their own classes; text spans paragraphs)
        raise ModelSpecError(f"{spec} (model_type {model_type!r}): {_first_line(error)}") from None
    problem = config_problem(config)
    if problem is not None:
        raise ModelSpecError(f"{spec}: config field {problem}")
    return config


def _first_line(error: Exception) -> str:
    return next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)


def _from_config(config, spec: str) -> nn.Module:
    import transformers

    try:
        return transformers.AutoModelForCausalLM.from_config(config)
    except Exception as error:  # noqa: BLE001 (as above)
        raise ModelSpecError(f"{spec} (model_type {config.model_type!r}): {_first_line(error)}") from None


def _hf_builder(path: str) -> Callable[[], nn.Module]:
    """``hf:path/to/config.json``: random weights from the config."""
    spec = f"hf:{path}"
    if not os.path.isfile(path):
        raise ModelSpecError(f"hf: config file {path!r} does not exist")
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.basename(path) == "config.json" and holds_weights(folder):
        raise ModelSpecError(f"{spec} is ambiguous: {folder} also holds pretrained weights; say "
                             f"hf:{os.path.dirname(path) or '.'} to train from them, or copy config.json to another "
                             "folder to start from random weights")
    _hf_config(path, spec)  # checked now, before anything is built

    def build() -> nn.Module:
        return _from_config(_hf_config(path, spec), spec)

    return build


def _hf_pretrained_builder(folder: str) -> Callable[[], nn.Module]:
    """``hf:DIR``: the model of ``DIR/config.json`` with the weights ``save_pretrained`` wrote there. A
    virtual build reads none (the checkpoint is recorded for the tensor sources); a real one is
    ``from_pretrained``."""
    spec = f"hf:{folder}"
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise ModelSpecError(f"{spec}: the directory has no config.json (a save_pretrained directory has one)")
    if not holds_weights(folder):
        raise ModelSpecError(f"{spec}: the directory holds no weights (model.safetensors or "
                             f"model.safetensors.index.json); for random weights from its config say "
                             f"{spec.rstrip('/')}/config.json")
    try:
        checkpoint = Checkpoint.open(folder)
    except CheckpointError as error:
        raise ModelSpecError(f"{spec}: {error}") from None
    _hf_config(config_path, spec)

    def build() -> nn.Module:
        if is_virtual_build():
            model = _from_config(_hf_config(config_path, spec), spec)
            record_checkpoint(model, checkpoint)
            return model
        import transformers

        try:
            return transformers.AutoModelForCausalLM.from_pretrained(folder)
        except (ValueError, KeyError, OSError, TypeError) as error:
            raise ModelSpecError(f"{spec}: {_first_line(error)}") from None

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
            with reading_deferred() as loaded:  # from_pretrained in a virtual build: no weight is read
                model = factory()
        except Exception as error:  # the user's code: report it in one line, naming the factory
            raise ModelSpecError(f"model factory {spec!r} raised {type(error).__name__}: "
                                 f"{_first_line(error)}") from None
        if not isinstance(model, nn.Module):
            raise ModelSpecError(f"model factory {spec!r} returned {type(model).__name__}, not an nn.Module")
        note_loaded(model, loaded)
        return model

    return build


def resolve_model(spec: str, seq_len: int | None = None) -> ModelSpec:
    """Turn a model name (zoo, ``hf:``, ``module:function``) into a :class:`ModelSpec`."""
    if spec.startswith("hf:"):
        path = spec[3:]
        return ModelSpec(spec, _hf_pretrained_builder(path) if os.path.isdir(path) else _hf_builder(path))
    if ":" in spec:
        return ModelSpec(spec, _factory_builder(spec))
    cfg = zoo_config(spec, seq_len)
    return ModelSpec(spec, lambda: TransformerLM(cfg), cfg)


def build_model(spec: str, seq_len: int | None = None, seed: int | None = 0) -> nn.Module:
    """Build the named model with real weights on the CPU: pretrained ones as stored, others random.

    With a ``seed``, a model with a per-module initialisation rule is initialised module by
    module from it (:mod:`.initialize`), as every rank of a plan initialises its own shards, except
    the modules holding pretrained tensors; other models keep their constructor's initialisation
    under the global seed."""
    if seed is not None:
        torch.manual_seed(seed)
    model = resolve_model(spec, seq_len).build()
    if seed is not None and has_init_rule(model):
        initialize(model, seed, keep=pretrained_modules(spec, seq_len) if may_be_pretrained(spec) else ())
    return model


def may_be_pretrained(spec: str) -> bool:
    """Whether the named model may hold pretrained weights (``hf:DIR`` or a factory)."""
    return (spec.startswith("hf:") and os.path.isdir(spec[3:])) or (":" in spec and not spec.startswith("hf:"))


def pretrained_tensors(spec: str, seq_len: int | None = None) -> PretrainedTensors:
    """Which of the named model's tensors are pretrained, and where they are stored; built on the meta
    device, nothing is read."""
    if not may_be_pretrained(spec):
        return PretrainedTensors()
    try:
        with torch.device("meta"):
            return checkpoint_names(resolve_model(spec, seq_len).build())
    except ModelSpecError:  # a factory that cannot build on the meta device loads nothing from a checkpoint
        return PretrainedTensors()


def pretrained_modules(spec: str, seq_len: int | None = None) -> set[str]:
    """Names of the modules that own a pretrained tensor of the named model (kept as loaded)."""
    return pretrained_tensors(spec, seq_len).owners()
