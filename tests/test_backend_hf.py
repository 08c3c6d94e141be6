"""Hugging Face models: fx cannot trace them here, so one-stage plans run the module whole."""
from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from mist_compiler.ir.plan import Plan

pytest.importorskip("transformers")

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
          "max_position_embeddings": 32, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}
LR = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-6, "weight_decay": 0.1}


def _plan(model: str, stages: list) -> Plan:
    return Plan.from_dict({"model": model, "seq_len": 8, "global_batch": 4, "dtype": "float32", "grad_accum": 2,
                           "stages": stages})


def _stage(layers, **extra):
    return {"layers": list(layers), "nodes": 1, "gpus_per_node": 1, "micro_batch": 2, "dp": 1, "tp": 1, **extra}


def test_hf_model_with_tied_embeddings_trains_like_one_process(tmp_path):
    from mist_compiler.backends.engine import compile as compile_plan
    from mist_compiler.backends.optimizer import AdamWConfig
    from mist_compiler.backends.worker import compare, reference_training, synthetic_batch
    from mist_compiler.models import build_model
    from mist_compiler.passes.partition import PartitionError

    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    name = f"hf:{path}"
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        plan = _plan(name, [_stage((0, 2), zero=1)])
        engine = compile_plan(build_model(name), plan, optimizer=AdamWConfig(**LR))
        losses = [engine.step(synthetic_batch(128, 4, 8, s)) for s in range(3)]
        state = engine.gather_full_state()
        engine.close()
        ref_losses, ref_state = reference_training(build_model(name), plan, 3, LR)
        worst, where = compare(losses, {k: v for k, v in state.items()}, ref_losses,
                               {k: v for k, v in ref_state.items() if k in state})
        assert worst <= 1e-5, (worst, where)
        with pytest.raises(PartitionError, match="need a traceable model"):
            compile_plan(build_model(name), _plan(name, [_stage((0, 2), ckpt_layers=1)]))
    finally:
        dist.destroy_process_group()
