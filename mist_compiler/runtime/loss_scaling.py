"""Dynamic loss scaling for float16 training: scale the loss, skip steps whose gradients overflow.

Same rule as ``torch.amp.GradScaler`` (init 2**16, x2 after 2000 clean steps, x0.5 and the step
skipped on any inf/NaN), hand-written because GradScaler works on ``param.grad`` tensors and an
``optimizer``, while the engine's gradients live in flat buckets that are reduced across data
parallelism and stages before any optimizer sees them:

- the last stage backpropagates ``loss * scale / G``, so every stage's activation gradients and
  weight gradients (fp16 buffers) carry the scale;
- the runtime divides by the scale while it casts each bucket into its fp32 reduction buffer
  (the same pass that divides by dp: no extra pass over the gradients);
- after the reductions every rank checks its own reduced fp32 shards (one read pass; ``found``
  stays a device tensor) and the engine all-reduces the flag over the whole world together with
  the loss (one collective and one host sync per step, which the loss needed anyway), so every rank
  of every stage skips or steps together, and every rank updates its scale identically.

bf16 (the default) and fp32 need none of this: :func:`loss_scaler_for` returns ``None``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch


@dataclass(frozen=True)
class LossScaleConfig:
    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        if not (self.init_scale > 0 and self.growth_factor > 1 and 0 < self.backoff_factor < 1
                and self.growth_interval >= 1):
            raise ValueError(f"LossScaleConfig: need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, "
                             f"growth_interval >= 1; got {self}")


class DynamicLossScaler:
    """The scale (a host float, identical on every rank) and its update rule."""

    def __init__(self, config: LossScaleConfig | None = None) -> None:
        self.config = config or LossScaleConfig()
        self.scale = float(self.config.init_scale)
        self.clean_steps = 0
        self.skipped_steps = 0

    def found_nonfinite(self, tensors: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
        """1.0 (a device tensor, no host sync) when any element of ``tensors`` is inf or NaN, else 0.0.

        A sum is finite exactly when every summand is, short of an fp32 overflow of the sum itself,
        which unscaled gradients do not reach; it needs no temporary of the tensor's size."""
        found = torch.zeros((), dtype=torch.float32, device=device)
        for tensor in tensors:
            if tensor.numel():
                total = tensor.sum(dtype=torch.float32).to(device, non_blocking=True)
                found = torch.maximum(found, (~torch.isfinite(total)).float())
        return found

    def update(self, found_nonfinite: bool) -> bool:
        """Advance the scale after a step; True when that step must be skipped."""
        cfg = self.config
        if found_nonfinite:
            self.scale *= cfg.backoff_factor
            self.clean_steps = 0
            self.skipped_steps += 1
            return True
        self.clean_steps += 1
        if self.clean_steps == cfg.growth_interval:
            self.scale *= cfg.growth_factor
            self.clean_steps = 0
        return False


def loss_scaler_for(dtype: str, config: LossScaleConfig | None = None) -> DynamicLossScaler | None:
    """A dynamic loss scaler for float16 training; None for bfloat16 and float32."""
    return DynamicLossScaler(config) if dtype == "float16" else None
