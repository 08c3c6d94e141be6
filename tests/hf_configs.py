"""Tiny random Hugging Face configs of the architectures people train (written as config.json files)."""
from __future__ import annotations

import os

COMMON = {"vocab_size": 128, "max_position_embeddings": 64, "num_hidden_layers": 3, "hidden_size": 32,
          "num_attention_heads": 4, "intermediate_size": 64, "bos_token_id": 0, "eos_token_id": 0,
          "pad_token_id": None}
ARCHITECTURES = {
    "llama": ("LlamaConfig", {"num_key_value_heads": 2, "tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", {"num_key_value_heads": 2}),
    "mistral": ("MistralConfig", {"num_key_value_heads": 2, "sliding_window": None}),
    "gpt2": ("GPT2Config", {"n_embd": 32, "n_layer": 3, "n_head": 4, "n_positions": 64, "resid_pdrop": 0.0,
                            "embd_pdrop": 0.0, "attn_pdrop": 0.0}),
    "gpt_neox": ("GPTNeoXConfig", {"rotary_pct": 0.25, "hidden_dropout": 0.0, "attention_dropout": 0.0}),
    "phi": ("PhiConfig", {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0}),
    "gemma": ("GemmaConfig", {"num_key_value_heads": 2, "head_dim": 8}),
}


def write_config(kind: str, folder: str) -> str:
    """Write the tiny ``kind`` config into ``folder``; returns the model spec ``hf:<path>``."""
    import transformers

    class_name, extra = ARCHITECTURES[kind]
    settings = {**COMMON, **extra}
    if kind == "gpt2":
        settings = {k: v for k, v in settings.items() if k not in ("hidden_size", "num_hidden_layers",
                                                                      "num_attention_heads", "max_position_embeddings",
                                                                      "intermediate_size")}
    config = getattr(transformers, class_name)(**settings)
    config._attn_implementation = "sdpa"
    os.makedirs(folder, exist_ok=True)
    config.save_pretrained(folder)
    return "hf:" + os.path.join(folder, "config.json")
