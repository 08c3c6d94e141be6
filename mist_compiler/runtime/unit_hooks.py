"""Hooks around a unit's forward: a context entered before it and left after it (activation offload,
per-tensor saved-activation policies), only while gradients are recorded."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn


def around_forward(module: nn.Module, make_context: Callable[[tuple], Any]) -> list[Any]:
    """Enter ``make_context(args)`` before each forward of ``module`` that records gradients and
    leave it after; returns the two hook handles."""
    active: list[Any] = []

    def enter(module, args):
        if torch.is_grad_enabled():
            context = make_context(args)
            context.__enter__()
            active.append(context)

    def leave(module, args, output):
        if active:
            active.pop().__exit__(None, None, None)

    return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
