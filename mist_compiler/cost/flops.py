"""Model FLOPs of training and the utilisation (MFU) a step time implies: the one formula every
part uses (the tuner's predicted MFU, ``mistc train``'s measured MFU, the benchmarks).

Per token, forward and backward: 6 x parameters (every weight's matmuls, PaLM's convention) plus
12 x layers x hidden x sequence for attention's score and value matmuls (no causal halving, as
Megatron and PaLM count). ``config`` is a model's sizes: ``params``, ``layers``, ``hidden`` (the
captured IR's :class:`~mist_compiler.driver.IRShape`, or a zoo ``TransformerConfig``).
"""
from __future__ import annotations

from ..ir.plan import Plan


def flops_per_token(config, seq_len: int) -> float | None:
    """Training FLOPs per token of a model (see the module docstring); None without its sizes."""
    if config is None or not getattr(config, "hidden", None):
        return None
    if isinstance(getattr(config, "params", None), int):  # sizes read from the captured IR
        params = config.params
    else:
        from ..models import parameter_count

        params = parameter_count(config)
    return float(6 * params + 12 * config.layers * config.hidden * seq_len)


def model_flops_per_iteration(config, plan: Plan) -> float | None:
    """FLOPs of one training iteration of ``plan``'s global batch."""
    per_token = flops_per_token(config, plan.seq_len)
    return None if per_token is None else per_token * plan.global_batch * plan.seq_len


def mfu(result, config, peak_flops_per_device: float | None) -> float | None:
    """The utilisation a predicted iteration time implies (``result``: a tuning result)."""
    flops = model_flops_per_iteration(config, result.plan)
    if flops is None or not peak_flops_per_device:
        return None
    return flops / (result.predicted_time_s * result.plan.world_size * peak_flops_per_device)
