"""``torch.compile(model, backend="mist", options={"plan": ...})``: the user's loop, run by a plan.

The capture helper's dynamo backend hands the graph here (:func:`compile_with_plan`). Dynamo
lifts the model's parameters into graph inputs, so ``example_inputs`` are the real parameters:
they lead us back to the ``nn.Module`` they belong to, which the engine compiles with the plan
(:func:`mist_compiler.backends.engine.compile`). The returned callable keeps the user's loop
unchanged::

    loss = compiled(input_ids=..., labels=...)   # runs the whole micro-batch schedule: forward
                                                 # and backward, gradients reduced
    loss.backward()                              # cheap: requests the engine's optimizer step (it
                                                 # runs before the next forward or weight read)
    opt.step(); opt.zero_grad()                  # a no-op: the user's parameters get no .grad

The loss is the global batch's mean, the same on every rank. The engine trains its own copy of
the model (``last_engine().named_full_parameters()`` / ``gather_full_state()``); the user's
model keeps its initial weights and the user's optimizer never sees a gradient. A forward that is
never followed by ``backward()`` changes nothing (the next one starts a fresh iteration).

Options: ``plan`` (a Plan or a path, required), ``timeout_s`` (default 300), ``optimizer``
(an ``AdamWConfig`` or a dict of its fields), ``device``.
"""
from __future__ import annotations

import copy
import gc
import weakref
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import nn

from mist_compiler.ir.plan import Plan, PlanError, load_plan

from .engine import DEFAULT_TIMEOUT_S, Engine
from .engine import compile as compile_engine

KNOWN_OPTIONS = {"plan", "timeout_s", "optimizer", "device"}
_engines: list[Engine] = []


class DynamoRuntimeError(ValueError):
    """A graph or option the plan runtime cannot take; the message names it."""


class _DeferredOptimizerStep(torch.autograd.Function):
    """Forward: the already-computed loss. Backward: request the engine's optimizer step, which
    runs before the next forward or weight read (not inside autograd, where it is unsafe)."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, loss: torch.Tensor, engine: Engine) -> torch.Tensor:
        ctx.engine = engine
        return loss.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.engine.request_optimizer_step()
        return None, None, None


def _engine_for(model: nn.Module, plan: Plan, settings: dict[str, Any]) -> Engine:
    """One engine per (model, plan): dynamo recompiles (new guards once the runtime rebinds the
    parameters into its buckets) must keep training the same engine, not start another."""
    for engine in _engines:
        if engine.source_model is model and engine.plan == plan:
            return engine
    # The engine trains its own copy: the runtime binds parameters and their .grad into flat
    # buckets, which the user's optimizer (step, zero_grad) must never see or touch.
    engine = compile_engine(copy.deepcopy(model), plan, **settings)
    engine.source_model = model
    _engines.append(engine)
    return engine


def last_engine() -> Engine | None:
    """The engine of the most recent plan-compiled graph."""
    return _engines[-1] if _engines else None


def _options(options: dict) -> tuple[Plan, dict[str, Any]]:
    unknown = sorted(set(options) - KNOWN_OPTIONS - {"attention", "name"})
    if unknown:
        raise DynamoRuntimeError(f"mist backend: unknown option(s) {unknown}; known: {sorted(KNOWN_OPTIONS)}")
    if "plan" not in options:
        raise DynamoRuntimeError("mist backend: option 'plan' (a Plan or a path to a plan file) is required to run a plan")
    plan = options["plan"]
    if isinstance(plan, str):
        plan = load_plan(plan)
    if not isinstance(plan, Plan):
        raise PlanError(f"mist backend option 'plan': expected a Plan or a path, got {type(plan).__name__}")
    optimizer = options.get("optimizer")
    if isinstance(optimizer, dict):
        from .optimizer import AdamWConfig

        optimizer = AdamWConfig(**optimizer)
    return plan, {"optimizer": optimizer, "timeout_s": float(options.get("timeout_s", DEFAULT_TIMEOUT_S)),
                  "device": options.get("device")}


def find_owner_module(params: list[torch.Tensor]) -> nn.Module:
    """The smallest live ``nn.Module`` owning every one of ``params`` (the compiled model)."""
    wanted = {id(p) for p in params}
    best: nn.Module | None = None
    best_size = None
    for obj in gc.get_objects():
        if isinstance(obj, weakref.ProxyTypes):  # isinstance on a dead proxy raises ReferenceError
            continue
        if not isinstance(obj, nn.Module) or isinstance(obj, fx.GraphModule):
            continue
        try:
            owned = {id(p) for p in obj.parameters()}
        except Exception:
            continue
        if wanted <= owned and (best_size is None or len(owned) < best_size):
            best, best_size = obj, len(owned)
    if best is None:
        raise DynamoRuntimeError("mist backend: cannot find the nn.Module that owns the graph's parameters")
    return best


def _batch_name(placeholder: fx.Node) -> str:
    name = placeholder.name
    for prefix in ("l_kwargs_", "l_"):
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    return name.rstrip("_")


def compile_with_plan(gm: fx.GraphModule, example_inputs: list, options: dict) -> Callable:
    """Dynamo backend body for a plan: returns the callable dynamo runs instead of ``gm``."""
    plan, settings = _options(options)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        raise DynamoRuntimeError("mist backend: symbolic shapes are not supported with a plan; compile with dynamic=False")
    params = [t for t in example_inputs if isinstance(t, nn.Parameter)]
    batch_slots = {i: _batch_name(n) for i, n in enumerate(placeholders) if not isinstance(example_inputs[i], nn.Parameter)}
    missing = {"input_ids", "labels"} - set(batch_slots.values())
    if missing or not params:
        raise DynamoRuntimeError(
            f"mist backend: the graph must take the whole model with input_ids and labels (missing {sorted(missing)}); "
            "a graph break splits the model, compile with fullgraph=True to see where")
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    if not (isinstance(outputs, (tuple, list)) and len(outputs) == 1):
        raise DynamoRuntimeError("mist backend: with a plan the model must return only its scalar loss")
    model = find_owner_module(params)
    engine = _engine_for(model, plan, settings)
    anchor = torch.zeros((), requires_grad=True)

    def run(*args: Any) -> tuple[torch.Tensor]:
        batch = {name: args[i] for i, name in batch_slots.items()}
        loss = torch.tensor(engine.forward_backward(batch), dtype=torch.float32)
        return (_DeferredOptimizerStep.apply(anchor, loss, engine),)

    run.mist_engine = engine  # type: ignore[attr-defined]
    return run
