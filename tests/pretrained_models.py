"""Tiny pretrained Hugging Face checkpoints written the way users get them (``save_pretrained``), and
factories that load them (``package.module:function`` specs: set ``MIST_TEST_CHECKPOINT`` first)."""
from __future__ import annotations

import os

VOCAB = 256  # byte-level: the bundled sample text and any UTF-8 file tokenise into it


def tiny_llama_config(layers: int = 2):
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=None)
    config._attn_implementation = "sdpa"
    return config


def save_tiny_llama(folder: str, *, seed: int = 0, max_shard_size: str | None = None) -> str:
    """A tiny random Llama (tied head) saved with ``save_pretrained``; returns the ``hf:`` spec."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_llama_config())
    model.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return f"hf:{folder}"


def loaded():
    """A factory calling ``from_pretrained``, as users write one."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(os.environ["MIST_TEST_CHECKPOINT"])


def loaded_then_edited():
    """A factory that changes a loaded weight: that tensor is the factory's, not the checkpoint's."""
    import torch

    model = loaded()
    with torch.no_grad():
        model.model.norm.weight.mul_(2.0)
    return model


# ---- jobs for local gloo ranks (module level: spawned ranks import them) ------------------------------

def padded_step(rank: int, world: int, folder: str) -> dict:
    """One step of a plan (dp 2, 2 micro-batches) on a batch whose rows end in padding (-100), against
    the model's own loss and gradients on the whole batch."""
    import torch
    import transformers

    import mist_compiler
    from mist_compiler.ir.plan import Plan

    torch.manual_seed(3)
    input_ids = torch.randint(0, VOCAB, (8, 16))
    labels = input_ids.clone()
    for row, length in enumerate([16, 3, 9, 16, 5, 12, 2, 16]):
        labels[row, length:] = -100
    plan = Plan.from_dict({"model": "LlamaForCausalLM", "seq_len": 16, "global_batch": 8, "dtype": "float32",
                           "grad_accum": 2, "stages": [{"layers": [0, 2], "nodes": 1, "gpus_per_node": world,
                                                        "micro_batch": 4 // world, "dp": world, "tp": 1, "zero": 0}]})
    engine = mist_compiler.compile(transformers.AutoModelForCausalLM.from_pretrained(folder), plan, timeout_s=60)
    loss = engine.forward_backward({"input_ids": input_ids, "labels": labels})
    grads = engine.gather_full_gradients(dst=0)
    engine.close()
    if rank != 0:
        return {}
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder)
    expected = reference(input_ids=input_ids, labels=labels).loss
    expected.backward()
    worst = max(float((grads[name] - p.grad).norm() / p.grad.norm()) for name, p in reference.named_parameters())
    return {"loss": loss, "expected": float(expected), "worst_grad": worst}


def trainer_export(rank: int, world: int, folder: str, out: str) -> dict:
    """``Trainer(module)`` with ``export``: the state it trained, to compare with what from_pretrained reads."""
    import transformers

    from mist_compiler.training.trainer import TrainConfig, Trainer

    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    plan = {"model": "LlamaForCausalLM", "seq_len": 32, "global_batch": 4, "dtype": "float32", "grad_accum": 1,
            "stages": [{"layers": [0, 2], "nodes": 1, "gpus_per_node": world, "micro_batch": 4 // world,
                        "dp": world, "tp": 1, "zero": 1}]}
    trainer = Trainer(model, plan, TrainConfig(steps=2, export=out, timeout_s=60), say=lambda line: None)
    trainer.fit()
    state = trainer.engine.gather_full_state(dst=0)
    trainer.close()
    if rank != 0:
        return {}
    return {"state": {name: value.numpy() for name, value in state.items()},  # by value: the rank exits
            "untouched": float(model.model.norm.weight.detach().sum())}



def shifts_inside():
    """A user's module in the older Hugging Face style: it pairs logits[:, :-1] with labels[:, 1:]
    itself, and ignores the label -1."""
    import torch
    import torch.nn.functional as F

    from tests.user_models import FusedGPT

    class ShiftingGPT(FusedGPT):
        def forward(self, input_ids, labels):
            x = self.tokens(input_ids) + self.positions(torch.arange(input_ids.shape[1], device=input_ids.device))
            for layer in self.trunk:
                x = layer(x)
            logits = self.lm_head(self.norm(x))[:, :-1]
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-1)

    return ShiftingGPT()
