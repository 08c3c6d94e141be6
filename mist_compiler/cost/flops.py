"""Model FLOPs of training and the utilisation (MFU) a step time implies: the one count every part
uses (the tuner's predicted MFU, ``mistc train``'s measured MFU, the benchmarks).

Model FLOPs are what the model computes, not what the runtime executes: three times the forward
pass's FLOPs (the backward of a GEMM is two GEMMs of its size), counted on the captured program by
the stage cost model (``StageCostModel.model_flops_per_sequence``): recomputation (checkpointing, a
fused loss recomputing its logits) is not counted, an embedding lookup costs nothing, and a mixture of
experts counts the experts each token is routed to, not all of them. Attention counts the full
``s x s`` products (no causal halving), as Megatron and PaLM do. Every counted FLOP is also priced, at
most at the profile's peak, so a predicted MFU never exceeds 100%.

Where no program was counted, the closed form: per token ``6 x matmul weights + 12 x layers x hidden x
sequence``, the matmul weights being the layers' and the head's (not the embedding tables, not norm
weights or biases). ``config`` is a model's sizes: a zoo ``TransformerConfig`` (exact: the tests check
it against the program's count), or the captured IR's :class:`~mist_compiler.driver.IRShape`, which only
knows all ``params`` (6 x params then, embeddings included).
"""
from __future__ import annotations

from ..ir.plan import Plan


def matmul_weights(config) -> int:
    """Elements of a zoo config's layer and head matmul weights."""
    hidden, kv = config.hidden, config.num_kv_heads * config.head_dim
    layer = 2 * hidden * hidden + 2 * hidden * kv + hidden * config.ffn * (3 if config.activation == "swiglu" else 2)
    return config.layers * layer + config.vocab * hidden


def flops_per_token(config, seq_len: int) -> float | None:
    """Training FLOPs per token of a model (see the module docstring); None without its sizes."""
    if config is None or not getattr(config, "hidden", None):
        return None
    weights = config.params if isinstance(getattr(config, "params", None), int) else matmul_weights(config)
    return float(6 * weights + 12 * config.layers * config.hidden * seq_len)


def model_flops_per_iteration(config, plan: Plan) -> float | None:
    """FLOPs of one training iteration of ``plan``'s global batch."""
    per_token = flops_per_token(config, plan.seq_len)
    return None if per_token is None else per_token * plan.global_batch * plan.seq_len


def mfu(result, config, peak_flops_per_device: float | None) -> float | None:
    """The utilisation a predicted iteration time implies (``result``: a tuning result; its
    ``model_flops``, the program's count, when the cost model gave one, else the closed form)."""
    flops = getattr(result, "model_flops", None) or model_flops_per_iteration(config, result.plan)
    if flops is None or not peak_flops_per_device:
        return None
    return flops / (result.predicted_time_s * result.plan.world_size * peak_flops_per_device)
