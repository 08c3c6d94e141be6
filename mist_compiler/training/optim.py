"""The training recipe around the engine's AdamW: schedule, parameter groups, global clipping.

- ``LRSchedule``: linear warm-up then cosine decay to ``min_lr`` (a pure function of the step, so a
  resumed run needs nothing but the step number).
- Parameter groups: weight decay only on matrices that are not embeddings; norms, biases and
  embeddings (any parameter with fewer than two dimensions or whose name says embed/wte/wpe) get
  none. The engine's fused AdamW runs over flat buckets mixing both kinds, so decay is applied
  here, decoupled exactly as ``torch.optim.AdamW`` does it (``p *= 1 - lr * wd`` before the Adam
  update), on the runs of master elements that decay, and the fused update runs with ``wd = 0``.
- ``grad_norm``: the global L2 norm of the reduced gradients, equal to one process's: each rank
  sums the squares of the elements it owns (:class:`.layout.BucketView`: each element of the model
  once over data, tensor and pipeline parallelism, ZeRO shards and offloaded parts), one
  all-reduce over the world adds them. ``clip`` then scales every reduced gradient in place.
- Divergence: a step whose loss or gradient norm is not finite never updates anything (its
  gradients are dropped, as dynamic loss scaling does for an overflow); the caller counts such
  steps. The same all-reduce carries each rank's stop request (:mod:`.preemption`), so every rank
  learns in the same step that one of them was signalled.

``torch.nn.utils.clip_grad_norm_`` and optimizer param groups need ``param.grad`` tensors and a
``torch.optim`` optimizer; the engine's gradients live in sharded flat buffers, hence this module.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..runtime.optimizer import AdamWConfig
from .layout import BucketView, bucket_views

_EMBEDDING = re.compile(r"(^|\.)(embed\w*|wte|wpe|word_embeddings|position_embeddings|tok_embeddings)(\.|$)")


def decays(fqn: str, shape: tuple[int, ...]) -> bool:
    """Whether weight decay applies to the parameter ``fqn`` (full shape ``shape``)."""
    return len(shape) >= 2 and not _EMBEDDING.search(fqn)


@dataclass(frozen=True)
class LRSchedule:
    """``lr`` after ``warmup`` linear steps, cosine down to ``min_lr`` at ``total`` steps."""

    lr: float
    total: int
    warmup: int = 0
    min_lr: float = 0.0

    def __post_init__(self) -> None:
        if not self.lr >= 0 or not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"learning rate: need 0 <= min_lr <= lr, got lr={self.lr}, min_lr={self.min_lr}")
        if self.total < 1 or not 0 <= self.warmup:
            raise ValueError(f"schedule: need total >= 1 and warmup >= 0, got total={self.total}, warmup={self.warmup}")

    def __call__(self, step: int) -> float:
        """The learning rate of (1-based) ``step``."""
        if step <= self.warmup:
            return self.lr * step / self.warmup
        span = max(self.total - self.warmup, 1)
        progress = min(max(step - self.warmup, 0) / span, 1.0)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup: int = 0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip: float = 1.0  # max global gradient norm; 0 disables clipping

    def __post_init__(self) -> None:
        for name in ("lr", "min_lr", "eps", "weight_decay", "clip"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"optimizer setting {name} must be a finite number >= 0, got {value!r}")
        if not (isinstance(self.warmup, int) and self.warmup >= 0):
            raise ValueError(f"optimizer setting warmup must be an integer >= 0, got {self.warmup!r}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optimizer setting betas must be two numbers in [0, 1), got {self.betas!r}")


@dataclass(frozen=True)
class StepOutcome:
    """What an optimizer step did (identical on every rank)."""

    grad_norm: float  # before clipping; NaN or inf when the step diverged
    skipped: bool  # nothing was updated (a diverged step, or an fp16 overflow the loss scaler handles)
    diverged: bool  # the loss or the gradient norm was not finite
    stop: bool  # some rank was asked to stop (SIGTERM/SIGINT): stop after this step


class TrainingOptimizer:
    """Applies :class:`OptimConfig` to an engine: one ``step(lr)`` after each ``forward_backward``."""

    def __init__(self, engine: Any, config: OptimConfig) -> None:
        self.engine = engine
        self.config = config
        self.views: list[BucketView] = bucket_views(engine)
        self.norm_runs = [view.owned_runs() for view in self.views]
        self.decay_runs = [_merge([(p.lo, p.hi) for p in view.held if decays(p.fqn, p.full_shape)])
                           for view in self.views]

    def grad_norm(self, stop_requested: bool = False) -> tuple[float, bool]:
        """The global gradient norm, and whether any rank asked to stop (collective: every rank calls it)."""
        device = self.engine.device
        total = torch.zeros((), dtype=torch.float64, device=device)
        for view, runs in zip(self.views, self.norm_runs):
            for lo, hi in runs:
                for _, part in view.bucket.reduced_grad_views(lo, hi):
                    total += torch.linalg.vector_norm(part, dtype=torch.float64).to(device).square()
        both = torch.stack([total, torch.tensor(float(stop_requested), dtype=torch.float64, device=device)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(both)  # a NaN anywhere makes the sum NaN on every rank: all skip together
        squares, stop = both.tolist()
        return math.sqrt(squares) if squares >= 0 else math.nan, stop > 0

    def clip(self, norm: float) -> None:
        if self.config.clip > 0 and math.isfinite(norm) and norm > self.config.clip:
            coef = self.config.clip / (norm + 1e-6)
            for part in self.engine.runtime.reduced_gradients():
                part.mul_(coef)

    def step(self, lr: float, loss: float = 0.0, stop_requested: bool = False) -> StepOutcome:
        """Norm, clip, decay and update with learning rate ``lr``, unless ``loss`` or the norm is not
        finite (then nothing is updated). Collective; the outcome is the same on every rank."""
        cfg = self.config
        norm, stop = self.grad_norm(stop_requested)
        overflow = self.engine.overflowed  # fp16: the loss scaler skips this step and backs off
        diverged = not math.isfinite(loss) or (not math.isfinite(norm) and not overflow)
        if diverged:
            self.engine.skip_optimizer_step()
            return StepOutcome(norm, skipped=True, diverged=True, stop=stop)
        if not overflow:
            self.clip(norm)
            if cfg.weight_decay > 0 and lr > 0:
                factor = 1.0 - lr * cfg.weight_decay
                for view, runs in zip(self.views, self.decay_runs):
                    for lo, hi in runs:
                        for part, _ in view.bucket.master.overlapping(lo, hi):
                            part.mul_(factor)
        self.engine.set_optimizer(AdamWConfig(lr=lr, betas=cfg.betas, eps=cfg.eps, weight_decay=0.0))
        self.engine.optimizer_step()
        return StepOutcome(norm, skipped=overflow, diverged=False, stop=stop)


def _merge(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(runs):
        if merged and merged[-1][1] == lo:
            merged[-1] = (merged[-1][0], hi)
        else:
            merged.append((lo, hi))
    return merged
