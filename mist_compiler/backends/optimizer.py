"""AdamW on flat fp32 master shards, the optimizer-offloaded part updated in host memory.

``FlatAdamW`` owns, per unit, the fp32 master copy of this rank's shard and the two Adam moments,
each a ``SplitBuffer`` with the plan's ``opt`` fraction on the host. A step is one fused update per
part (device part on the device, host part on the host): no per-parameter Python work. The math is
exactly ``torch.optim.AdamW`` (decoupled weight decay, bias corrections from the step count).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from . import kernels
from .offload import HostMemory, SplitBuffer


@dataclass(frozen=True)
class AdamWConfig:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if not self.lr >= 0.0:
            raise ValueError(f"AdamWConfig.lr must be >= 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"AdamWConfig.betas must be two numbers in [0, 1), got {self.betas}")
        if not self.eps > 0.0:
            raise ValueError(f"AdamWConfig.eps must be > 0, got {self.eps}")
        if not self.weight_decay >= 0.0:
            raise ValueError(f"AdamWConfig.weight_decay must be >= 0, got {self.weight_decay}")


class ShardState:
    """Master weights and Adam moments of one unit's local shard (fp32, split device/host)."""

    def __init__(self, master: SplitBuffer, host_memory: HostMemory, opt_fraction: float) -> None:
        self.master = master
        make = lambda kind: SplitBuffer(master.numel, torch.float32, master.device, opt_fraction, host_memory, kind)
        self.exp_avg = make("opt")
        self.exp_avg_sq = make("opt")
        if self.exp_avg.boundary != master.boundary:
            raise ValueError("ShardState: master and moments must split at the same element")


class FlatAdamW:
    """AdamW over the units' flat shards; ``step`` is called once per training step."""

    def __init__(self, config: AdamWConfig) -> None:
        self.config = config
        self.step_count = 0

    def step(self, states: list[ShardState], grad_reader: list[Callable[[int, int, torch.device], torch.Tensor]]) -> None:
        """Update every shard; ``grad_reader[i](start, end, device)`` gives unit i's reduced fp32 grads."""
        self.step_count += 1
        cfg = self.config
        for state, read_grad in zip(states, grad_reader):
            for (start, master), (_, exp_avg), (_, exp_avg_sq) in zip(
                    state.master.parts(), state.exp_avg.parts(), state.exp_avg_sq.parts()):
                grad = read_grad(start, start + master.numel(), master.device)
                kernels.adamw(master, grad, exp_avg, exp_avg_sq, step=self.step_count, lr=cfg.lr,
                              betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
