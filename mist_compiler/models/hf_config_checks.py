"""Values of a Hugging Face config that no model can be built from, named before building it.

transformers validates some fields itself (types, ``hidden_size`` divisible by the heads for some
architectures); others build a model that fails later or silently trains nonsense (0 layers, a
vocabulary of 0, key/value heads that do not divide the heads, a negative epsilon). The checks use
the standard attribute names, which every config maps to its own (``n_embd`` is ``hidden_size``
for GPT-2), and skip fields an architecture does not have.
"""
from __future__ import annotations

import math
from typing import Any

AT_LEAST_ONE = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "max_position_embeddings", "head_dim")
POSITIVE = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "rope_theta")
PROBABILITIES = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout",
                 "hidden_dropout_prob", "attention_probs_dropout_prob")


class RawConfig:
    """A config.json's fields as attributes (checked before transformers builds, and divides by, them)."""

    def __init__(self, data: dict) -> None:
        self.__dict__.update(data)


def _value(config: Any, name: str) -> Any:
    try:
        return getattr(config, name)
    except AttributeError:
        return None


def config_problem(config: Any) -> str | None:
    """The first impossible value of ``config`` as ``"field = value: why"``, or None."""
    for name in AT_LEAST_ONE:
        value = _value(config, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            return f"{name} = {value!r}: must be an integer >= 1"
    for name in POSITIVE:
        value = _value(config, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 < value < math.inf):
            return f"{name} = {value!r}: must be a finite number > 0"
    for name in PROBABILITIES:
        value = _value(config, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1):
            return f"{name} = {value!r}: must be a probability in [0, 1]"
    heads, kv_heads = _value(config, "num_attention_heads"), _value(config, "num_key_value_heads")
    if heads and kv_heads and heads % kv_heads:
        return f"num_key_value_heads = {kv_heads}: must divide num_attention_heads = {heads}"
    hidden = _value(config, "hidden_size")
    if heads and hidden and _value(config, "head_dim") is None and hidden % heads:
        return f"hidden_size = {hidden}: must be a multiple of num_attention_heads = {heads} (or give head_dim)"
    activation = _value(config, "hidden_act") or _value(config, "activation_function")
    if isinstance(activation, str):
        from transformers.activations import ACT2FN

        if activation not in ACT2FN:
            return f"hidden_act = {activation!r}: not an activation transformers knows ({', '.join(sorted(ACT2FN)[:6])}, ...)"
    return None
