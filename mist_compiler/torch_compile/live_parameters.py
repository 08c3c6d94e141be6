"""The user's module is the trained module: its parameters are live after every step, with ``.grad``.

Under ``torch.compile(model, backend="mist")`` the engine runs the plan's program; the user's loop
reads ``model.parameters()`` (an optimizer, clipping, an EMA, a logger, ``model.eval()``). Two
bindings keep them the trained ones, chosen by the plan (:func:`binding_for`):

- :class:`AliasedParameters`, where every rank holds every parameter whole in fp32 (one pipeline
  stage, tp 1, ZeRO-0, nothing offloaded, not fp16, fp32 parameters, as plain data parallelism):
  each parameter *is* the engine's fp32 master of it (``param.data`` is a view of the master
  buffer; in an fp32 plan also the weight the program runs). After each compiled call its
  ``.grad`` holds the reduced gradient (added to what is there, as autograd does), and the user's
  own optimizer, clipping and scheduler update it in place exactly as in eager: any optimizer; the
  engine keeps no optimizer state. Before the next forward the masters are cast into the compute
  weights if they changed (their version counters say so).
- :class:`MirroredParameters`, for sharded plans (ZeRO 1-3, tensor or pipeline parallelism,
  offload, fp16, parameters in another dtype): the engine keeps the sharded state and runs the
  update (AdamW, with the user's optimizer's settings read at every step, so schedulers work). The
  model's parameters keep their own tensors, which are given the whole trained fp32 masters after
  every update (a gather: the price of live parameters under a sharded plan), and their ``.grad``
  the whole reduced gradient after every call. Whatever the user does to ``.grad`` before
  ``opt.step()`` (clipping, scaling, accumulating calls) is copied back into the engine's shards
  before the update; the user's optimizer itself is kept from updating the parameters a second
  time (their gradients are set aside during its ``step`` and put back after).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..ir.plan import Plan
from ..lowering.materialize import shard
from ..runtime.optimizer import AdamWConfig


class DynamoRuntimeError(ValueError):
    """A graph or option the plan runtime cannot take; the message names it."""


def optimizer_settings(optimizer: torch.optim.Optimizer) -> AdamWConfig:
    """The engine's AdamW settings from the user's optimizer, or a one-line refusal."""
    kind = type(optimizer).__name__
    groups = optimizer.param_groups
    keys = ("lr", "betas", "eps", "weight_decay")
    first = {k: groups[0].get(k) for k in keys}
    if any({k: g.get(k) for k in keys} != first for g in groups[1:]):
        raise DynamoRuntimeError(f"mist backend: {kind} has parameter groups with different settings; the plan's "
                                 "optimizer takes one setting for all parameters")
    if kind not in ("AdamW", "Adam") or (kind == "Adam" and first["weight_decay"]):
        raise DynamoRuntimeError(f"mist backend: the plan runs AdamW; {kind}"
                                 f"{' with weight decay (L2, not decoupled)' if kind == 'Adam' else ''} cannot be "
                                 "run as it (use torch.optim.AdamW)")
    if groups[0].get("amsgrad") or groups[0].get("maximize"):
        raise DynamoRuntimeError(f"mist backend: {kind} with amsgrad or maximize is not what the plan runs")
    lr = groups[0]["lr"]
    return AdamWConfig(lr=float(lr), betas=tuple(float(b) for b in first["betas"]), eps=float(first["eps"]),
                       weight_decay=float(first["weight_decay"] or 0.0))


def whole_on_every_rank(plan: Plan) -> bool:
    """Whether every rank holds every parameter whole, in fp32 masters on its device."""
    return plan.pp == 1 and plan.dtype != "float16" and all(
        stage.tp == 1 and stage.zero == 0 and not (stage.offload.weights or stage.offload.grads or stage.offload.opt)
        for stage in plan.stages)


def binding_for(model: nn.Module, plan: Plan) -> type:
    """The binding class for ``model`` trained under ``plan``."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    fp32 = all(p.dtype == torch.float32 for p in trainable)
    return AliasedParameters if fp32 and whole_on_every_rank(plan) else MirroredParameters


class AliasedParameters:
    """The model's parameters are the engine's fp32 masters (see the module docstring)."""

    owns_update = False  # the user's optimizer updates the parameters

    def __init__(self, model: nn.Module, engine: Any) -> None:
        self.model, self.engine = model, engine
        by_name = dict(model.named_parameters(remove_duplicate=False))
        self.bound: list[tuple[nn.Parameter, Any, Any]] = []  # (parameter, bucket, slot)
        with torch.no_grad():
            for bucket in engine.runtime.buckets:
                master = bucket.master.device_part
                for slot in bucket.layout.slots:
                    param = by_name[engine.program.fqn.get(slot.name, slot.name)]
                    param.data = master[slot.offset:slot.offset + slot.numel].view(slot.shape)
                    self.bound.append((param, bucket, slot))
        self.versions = self._versions()

    def _versions(self) -> list[int]:
        return [param._version for param, _, _ in self.bound]

    def before_forward(self) -> None:
        """The compute weights from the masters, when the user's optimizer changed them."""
        if self._versions() != self.versions:
            self.engine.runtime.refresh_weights()
            self.versions = self._versions()

    def after_backward(self) -> None:
        """``.grad`` += the reduced gradient; the engine's gradient buffers are released."""
        with torch.no_grad():
            for param, bucket, slot in self.bound:
                views = bucket.reduced_grad_views(slot.offset, slot.offset + slot.numel)
                grad = views[0][1].view(slot.shape) if views else torch.zeros_like(param)
                if param.grad is None:
                    param.grad = grad.to(param.dtype, copy=True)
                else:
                    param.grad.add_(grad)
        self.engine.runtime.skip_step()  # nothing to update here: drop the engine's copy of the gradients

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def after_optimizer_step(self) -> None:
        pass


class MirroredParameters:
    """The engine updates its shards; the model's parameters are given the result (module docstring)."""

    owns_update = True  # the engine runs the update

    def __init__(self, model: nn.Module, engine: Any) -> None:
        self.model, self.engine = model, engine
        self.by_name = dict(model.named_parameters(remove_duplicate=False))
        self.set_aside: list[tuple[nn.Parameter, torch.Tensor | None]] = []

    def before_forward(self) -> None:
        pass

    def after_backward(self) -> None:
        """``.grad`` += the whole reduced gradient (a collective: every rank's call makes it)."""
        grads = self.engine.gather_full_gradients(dst=None)
        with torch.no_grad():
            for name, grad in grads.items():
                param = self.by_name.get(name)
                if param is None or not param.requires_grad:
                    continue
                grad = grad.to(param.device, param.dtype)
                if param.grad is None:
                    param.grad = grad
                else:
                    param.grad.add_(grad)

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The user's gradients into the engine's shards, the engine's update, the weights back."""
        settings = optimizer_settings(optimizer)
        self._write_gradients()
        self.engine.set_optimizer(settings)
        self.engine.optimizer_step()
        masters = self.engine.gather_full_masters(dst=None)
        with torch.no_grad():
            for name, param in self.by_name.items():
                if name in masters:
                    param.copy_(masters[name].to(param.device, param.dtype))
        self.set_aside = [(param, param.grad) for param in self.model.parameters()]
        for param, _ in self.set_aside:
            param.grad = None  # the user's optimizer skips parameters without a gradient

    def after_optimizer_step(self) -> None:
        for param, grad in self.set_aside:
            param.grad = grad
        self.set_aside = []

    def _write_gradients(self) -> None:
        """Each rank's part of every ``param.grad`` into the engine's reduced gradients (zeros where
        there is none)."""
        engine = self.engine
        tp_index, tp = engine.coord.tp_index, engine.stage_plan.tp
        engine.runtime.finish_gradients()
        with torch.no_grad():
            for bucket in engine.runtime.buckets:
                base = 0 if bucket.ctx.zero == 0 else bucket.shard_lo  # master element 0 in flat coordinates
                end = base + bucket.master.numel
                for slot in bucket.layout.slots:
                    lo, hi = max(base, slot.offset), min(end, slot.offset + slot.numel)
                    if lo >= hi:
                        continue
                    param = self.by_name.get(engine.program.fqn.get(slot.name, slot.name))
                    grad = param.grad if param is not None else None
                    piece = None if grad is None else shard(grad.detach(), engine.program.shards.get(slot.name),
                                                            tp_index, tp).reshape(-1)[lo - slot.offset:hi - slot.offset]
                    for window, part in bucket.reduced_grad_views(lo - base, hi - base):
                        if piece is None:
                            part.zero_()
                        else:
                            part.copy_(piece[window].to(part.device))
