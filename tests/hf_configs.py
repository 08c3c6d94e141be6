"""Tiny random Hugging Face configs of the architectures people train (written as config.json files).

Each family keeps its config's defaults except for size (and what a tiny size needs): GPT-2, OPT
and GPT-BigCode train with their default dropout of 0.1. ``MOE`` marks the mixture-of-experts
families, ``LAYER_KINDS`` those whose layers are not all alike (alternating attention kinds, dense
layers before MoE layers).
"""
from __future__ import annotations

import os

COMMON = {"vocab_size": 128, "max_position_embeddings": 64, "num_hidden_layers": 3, "hidden_size": 32,
          "num_attention_heads": 4, "intermediate_size": 64, "bos_token_id": 0, "eos_token_id": 0,
          "pad_token_id": None}
_GPT2_SIZES = {"n_embd": 32, "n_layer": 3, "n_head": 4, "n_positions": 64}
_EXPERTS = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}
ARCHITECTURES = {
    "llama": ("LlamaConfig", {"num_key_value_heads": 2, "tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", {"num_key_value_heads": 2}),
    "qwen3": ("Qwen3Config", {"num_key_value_heads": 2, "head_dim": 8}),  # per-head q/k norms
    "mistral": ("MistralConfig", {"num_key_value_heads": 2, "sliding_window": None}),
    "gemma": ("GemmaConfig", {"num_key_value_heads": 2, "head_dim": 8}),
    "gemma2": ("Gemma2Config", {"num_key_value_heads": 2, "head_dim": 8}),  # sliding / full attention alternate
    "gemma3": ("Gemma3TextConfig", {"num_key_value_heads": 2, "head_dim": 8}),
    "gpt2": ("GPT2Config", _GPT2_SIZES),  # dropout 0.1
    "gpt_bigcode": ("GPTBigCodeConfig", _GPT2_SIZES),  # multi-query attention, dropout 0.1
    "gpt_neox": ("GPTNeoXConfig", {"rotary_pct": 0.25}),
    "gptj": ("GPTJConfig", {**_GPT2_SIZES, "rotary_dim": 4}),
    "opt": ("OPTConfig", {"ffn_dim": 64, "word_embed_proj_dim": 32}),  # dropout 0.1
    "bloom": ("BloomConfig", {"n_layer": 3, "n_head": 4}),  # ALiBi, fused q|k|v viewed per head
    "falcon": ("FalconConfig", {"new_decoder_architecture": True, "num_kv_heads": 2}),  # x @ W.T, grouped q|k|v
    "stablelm": ("StableLmConfig", {"num_key_value_heads": 2}),
    "olmo": ("OlmoConfig", {"num_key_value_heads": 2}),
    "olmo2": ("Olmo2Config", {"num_key_value_heads": 2}),  # q/k norms over the whole projection
    "phi": ("PhiConfig", {}),
    "phi3": ("Phi3Config", {"num_key_value_heads": 2}),  # fused q|k|v sliced
    "starcoder2": ("Starcoder2Config", {"num_key_value_heads": 2}),
    "mixtral": ("MixtralConfig", {"num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": ("Qwen2MoeConfig", {"num_key_value_heads": 2, "num_experts": 4, **_EXPERTS,
                                     "shared_expert_intermediate_size": 64}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_key_value_heads": 2, "num_experts": 4, **_EXPERTS, "head_dim": 8}),
    "deepseek_v3": ("DeepseekV3Config", {"num_key_value_heads": 4, "n_routed_experts": 4, **_EXPERTS,
                                         "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 16,
                                         "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8,
                                         "n_group": 1, "topk_group": 1}),  # MLA; dense layer, then MoE layers
    # router_jitter_noise 0: PhiMoE's training-mode router samples among experts whose scores are within
    # 2 x the jitter of the best (Gumbel noise from torch's random stream, README "Random ops"), which no
    # two runs draw alike; at 0 only exact ties are sampled, so --check compares like with like
    "phimoe": ("PhimoeConfig", {"num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
                                "router_jitter_noise": 0.0}),
}
MOE = {"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "phimoe"}
# The families the default suite trains on two ranks (the rest run with ``-m heavy``): one for each
# mechanism the matrix exercises, so that a regression in any of them shows in CI. llama: tied
# embedding/head, grouped-query attention, RMSNorm, rotary; gpt2: dropout, Conv1D (x @ W); bloom:
# ALiBi, fused q|k|v viewed per head; falcon: x @ W.T, grouped q|k|v; qwen3: per-head q/k norms;
# gemma2: sliding and full attention alternating (layer kinds); mixtral: routed experts;
# deepseek_v3: multi-head latent attention, a dense layer before mixture-of-experts layers.
IN_CI = {"llama", "gpt2", "bloom", "falcon", "qwen3", "gemma2", "mixtral", "deepseek_v3"}
LAYER_KINDS = {"gemma2", "deepseek_v3"}
_DROPOUT_KEYS = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout", "hidden_dropout", "dropout",
                 "activation_dropout", "classifier_dropout")


def write_config(kind: str, folder: str, dropout: bool = True) -> str:
    """Write the tiny ``kind`` config into ``folder`` (``dropout=False``: every dropout probability
    0); returns the model spec ``hf:<path>``."""
    import transformers

    class_name, extra = ARCHITECTURES[kind]
    settings = {**COMMON, **extra}
    if "n_embd" in extra or kind == "bloom":  # configs that name their sizes otherwise
        settings = {k: v for k, v in settings.items() if k not in ("hidden_size", "num_hidden_layers",
                                                                  "num_attention_heads", "max_position_embeddings",
                                                                  "intermediate_size")}
        settings["hidden_size" if kind == "bloom" else "n_embd"] = 32
    config = getattr(transformers, class_name)(**settings)
    if not dropout:
        for key in _DROPOUT_KEYS:
            if isinstance(getattr(config, key, None), float):
                setattr(config, key, 0.0)
    config._attn_implementation = "sdpa"
    os.makedirs(folder, exist_ok=True)
    config.save_pretrained(folder)
    return "hf:" + os.path.join(folder, "config.json")
