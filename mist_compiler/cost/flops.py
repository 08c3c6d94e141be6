"""Model FLOPs of a training iteration and the utilisation (MFU) a predicted time implies."""
from __future__ import annotations

from ..ir.plan import Plan


def model_flops_per_iteration(config, plan: Plan) -> float | None:
    """6 * N * tokens + attention (12 * layers * hidden * seq per token, forward and backward)."""
    if config is None or not getattr(config, "hidden", None):
        return None
    if isinstance(getattr(config, "params", None), int):  # sizes read from the captured IR
        params = config.params
    else:
        from ..models import parameter_count

        params = parameter_count(config)
    tokens = plan.global_batch * plan.seq_len
    return float(tokens * (6 * params + 12 * config.layers * config.hidden * plan.seq_len))


def mfu(result, config, peak_flops_per_device: float | None) -> float | None:
    flops = model_flops_per_iteration(config, result.plan)
    if flops is None or not peak_flops_per_device:
        return None
    return flops / (result.predicted_time_s * result.plan.world_size * peak_flops_per_device)
