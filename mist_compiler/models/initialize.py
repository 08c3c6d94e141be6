"""Initialise a model module by module, the same way whether it is whole or built on meta.

A rank of a large plan must not build the whole model: it builds it on the meta device and
materialises only the tensors it keeps. For its initial values to equal single-process training
(what ``--check`` compares against), initialisation must not depend on the order in which
modules are materialised. So every module is initialised with the random generator seeded from
``(seed, its name)``, by the model's own per-module rule: ``model._init_weights(module)`` when
the model has one (Hugging Face models, the zoo) else ``module.reset_parameters()``. A tensor
shared by several modules (a tied embedding and head) gets every owner's rule, in module order,
as a whole-model initialisation would.

:func:`initialize` applies this to a whole model (the reference); :class:`MetaInit` materialises
single tensors of a meta-device model. A model without ``_init_weights`` (:func:`has_init_rule`)
keeps the initialisation its constructor gives it and is built whole on every rank instead; a
tensor a model's rule leaves untouched (detected: it is filled with NaN first) is taken from
such a whole build too.
"""
from __future__ import annotations

import hashlib
import threading
from typing import Callable, Collection

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake


class UninitializedError(ValueError):
    """A tensor of a meta-device model that no per-module rule initialises."""


def seed_for(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def module_rule(model: nn.Module, module: nn.Module) -> Callable[[], None] | None:
    """The initialisation of ``module``'s own tensors, or None when the model defines none."""
    rule = getattr(model, "_init_weights", None)
    if callable(rule):
        return lambda: rule(module)
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        return reset
    return None


def _owned(module: nn.Module) -> list[torch.Tensor]:
    return [t for t in list(module._parameters.values()) + list(module._buffers.values()) if t is not None]


def has_init_rule(model: nn.Module) -> bool:
    """Whether the model defines its initialisation per module (``_init_weights(module)``, the
    Hugging Face convention the zoo follows). Models that do not keep the initialisation their
    constructor gave them, and are built whole."""
    return callable(getattr(model, "_init_weights", None))


def _init_module(model: nn.Module, name: str, module: nn.Module, seed: int) -> None:
    rule = module_rule(model, module)
    if rule is None:
        raise ValueError(f"module {name or '<root>'} ({type(module).__name__}) holds tensors but neither the model "
                         "defines _init_weights(module) nor the module reset_parameters()")
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed_for(seed, name))
        rule()


def holds_values(tensor: torch.Tensor) -> bool:
    """Whether a tensor has values to initialise (not a meta-device or FakeTensor stand-in)."""
    return not tensor.is_meta and not is_fake(tensor)


def initialize(model: nn.Module, seed: int = 0, keep: Collection[str] = ()) -> nn.Module:
    """Initialise every module of a model in place with the seeded per-module rules; returns it.
    Modules whose tensors hold no values (built on the meta device or under a fake mode, as
    capture and the ranks of a plan build the whole model) are left alone: there is nothing to set;
    so are the modules named in ``keep`` (those holding pretrained weights)."""
    for name, module in model.named_modules():
        owned = _owned(module)
        if owned and name not in keep and any(holds_values(tensor) for tensor in owned):
            _init_module(model, name, module, seed)
    return model


class MetaInit:
    """Full tensors of a meta-device model, materialised (on the CPU) and initialised on demand."""

    def __init__(self, model: nn.Module, seed: int = 0) -> None:
        self.model, self.seed = model, seed
        self.modules = dict(model.named_modules(remove_duplicate=False))
        self.owners: dict[int, list[str]] = {}  # id(meta tensor) -> modules holding it, in order
        for name, module in model.named_modules():  # each module once, by its first name, as initialize()
            for tensor in _owned(module):
                self.owners.setdefault(id(tensor), []).append(name)
        self._last: tuple[str, torch.Tensor] | None = None
        self._lock = threading.Lock()  # materialising swaps modules' tensor tables for a moment

    def full(self, kind: str, name: str) -> torch.Tensor:
        with self._lock:
            return self._full(kind, name)

    def _full(self, kind: str, name: str) -> torch.Tensor:
        module_name, _, attr = name.rpartition(".")
        module = self.modules.get(module_name)
        meta = None if module is None else (module._parameters.get(attr) if attr in module._parameters
                                            else module._buffers.get(attr))
        if meta is None:
            raise KeyError(f"the model has no {kind} {name!r}")
        if self._last is not None and self._last[0] == name:
            return self._last[1]
        value = self._materialise(meta)
        self._last = (name, value)
        return value

    def _materialise(self, meta: torch.Tensor) -> torch.Tensor:
        """A real copy of ``meta`` initialised by every owner's rule (owners restored to meta after)."""
        owners = [self.modules[n] for n in self.owners[id(meta)]]
        saved = [(m, dict(m._parameters), dict(m._buffers)) for m in owners]
        memo: dict[int, torch.Tensor] = {}

        def real(tensor: torch.Tensor | None) -> torch.Tensor | None:
            if tensor is None:
                return None
            if id(tensor) not in memo:
                empty = torch.empty_like(tensor, device="cpu")
                memo[id(tensor)] = nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty
            return memo[id(tensor)]

        try:
            for module in owners:
                module._parameters = {k: real(v) for k, v in module._parameters.items()}
                module._buffers = {k: real(v) for k, v in module._buffers.items()}
            if memo[id(meta)].is_floating_point():
                memo[id(meta)].data.fill_(float("nan"))
            for name in self.owners[id(meta)]:
                _init_module(self.model, name, self.modules[name], self.seed)
            value = memo[id(meta)].detach()
            if not value.is_floating_point() or bool(torch.isnan(value).any()):
                raise UninitializedError("no per-module rule initialises this tensor")
            return value
        finally:
            for module, parameters, buffers in saved:
                module._parameters, module._buffers = parameters, buffers
