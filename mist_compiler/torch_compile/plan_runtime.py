"""``torch.compile(model, backend="mist", options=...)``: the user's loop, run by a plan.

The dynamo backend hands the graph here (:func:`compile_with_plan`) when options ask for
training: either ``plan`` (a Plan or a path) or what tuning needs (``hardware``, ``nodes``,
``gpus_per_node``, ``global_batch``, optionally ``seq_len``, ``dtype``, ``attention``; and
``compile_units=False`` to run the stage programs eagerly, for debugging). Dynamo
lifts the model's parameters into graph inputs, which lead back to the user's ``nn.Module``; the
driver captures it, tunes if needed, and builds this rank's engine from the module's own weights.
The user's loop stays as it is::

    out = compiled(input_ids=..., labels=...)    # the whole micro-batch schedule: forward and backward
    out.loss.backward()                          # nothing left to do (gradients are in the engine)
    opt.step(); opt.zero_grad()                  # the engine steps, with opt's hyperparameters

``opt.step()`` of an optimizer over the model's parameters runs the engine's update with that
optimizer's settings read at every step (so a learning-rate scheduler works): ``AdamW``, and
``Adam`` without weight decay (the same update); any other optimizer is refused in one line.
``model.state_dict()`` returns the trained weights (a collective when the plan shards them: call
it on every rank, as with FSDP's full state dict). Only the loss is computed under a plan: other
outputs (Hugging Face logits) are NaN tensors of their shape, with a warning.

Using the backend drops logging calls inside compiled code, as capture does (Hugging Face's
``warning_once`` would otherwise split GPT-2 into two graphs); a graph that still does not hold
the whole model is refused, naming where it ends.
"""
from __future__ import annotations

import gc
import warnings
import weakref
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import nn

from ..ir.plan import Plan, PlanError, load_plan
from ..runtime.engine import DEFAULT_TIMEOUT_S, Engine
from ..runtime.optimizer import AdamWConfig

PLAN_OPTIONS = {"plan"}
TUNING_OPTIONS = {"hardware", "nodes", "gpus_per_node", "global_batch", "seq_len", "dtype", "attention"}
RUNTIME_OPTIONS = {"timeout_s", "device", "compile_units"}
KNOWN_OPTIONS = PLAN_OPTIONS | TUNING_OPTIONS | RUNTIME_OPTIONS
_engines: list[Engine] = []
_hook: list[Any] = []


class DynamoRuntimeError(ValueError):
    """A graph or option the plan runtime cannot take; the message names it."""


class _Loss(torch.autograd.Function):
    """The step's loss as a tensor the user can call ``backward()`` on (the engine already did)."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        return loss.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, None


def wants_runtime(options: dict) -> bool:
    """Whether ``torch.compile`` options ask to train (a plan, or what tuning needs)."""
    return bool(set(options) & (PLAN_OPTIONS | TUNING_OPTIONS | RUNTIME_OPTIONS))


def last_engine() -> Engine | None:
    """The engine of the most recent plan-compiled graph."""
    return _engines[-1] if _engines else None


def parse_options(options: dict) -> dict[str, Any]:
    """Validated settings for the driver; unknown or missing options are named."""
    unknown = sorted(set(options) - KNOWN_OPTIONS - {"name"})
    if unknown:
        raise DynamoRuntimeError(f"mist backend: unknown option(s) {unknown}; known: {sorted(KNOWN_OPTIONS)}")
    settings: dict[str, Any] = {"timeout_s": float(options.get("timeout_s", DEFAULT_TIMEOUT_S))}
    if options.get("device") is not None:
        settings["device"] = options["device"]
    if "compile_units" in options:  # False: the stage programs run eagerly (debugging)
        if not isinstance(options["compile_units"], bool):
            raise DynamoRuntimeError(f"mist backend: option 'compile_units' must be True or False, got "
                                     f"{options['compile_units']!r}")
        settings["compile_units"] = options["compile_units"]
    if "plan" in options:
        plan = options["plan"]
        plan = load_plan(plan) if isinstance(plan, str) else plan
        if not isinstance(plan, Plan):
            raise PlanError(f"mist backend option 'plan': expected a Plan or a path, got {type(plan).__name__}")
        settings["plan"] = plan
        return settings
    missing = sorted({"hardware", "global_batch"} - set(options))
    if missing:
        raise DynamoRuntimeError(f"mist backend: option(s) {missing} are needed to tune a plan (or give 'plan')")
    for name in ("nodes", "gpus_per_node", "global_batch", "seq_len"):
        if name in options and not (isinstance(options[name], int) and options[name] >= 1):
            raise DynamoRuntimeError(f"mist backend: option {name!r} must be a positive integer, got {options[name]!r}")
    settings.update({name: options[name] for name in TUNING_OPTIONS if name in options})
    return settings


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


def _where_it_ends(gm: fx.GraphModule) -> str:
    last = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    trace = (last[-1].meta.get("stack_trace") or "").strip().splitlines() if last else []
    frames = [line.strip() for line in trace if line.strip().startswith("File ")]
    return frames[-1].replace("File ", "") if frames else "an unknown line"


def _engine_for(model: nn.Module, settings: dict) -> Engine:
    """One engine per model: dynamo recompiles (new guards once the batch changes) keep training it."""
    for engine in _engines:
        if engine.source_model is model:
            return engine
    from .. import driver

    plan = settings.pop("plan", None)
    runtime = {k: settings.pop(k) for k in list(settings) if k in RUNTIME_OPTIONS}
    compiled = driver.compile_model(model, plan=plan, **settings, **runtime)
    engine = compiled.engine
    engine.source_model = model
    _engines.append(engine)
    _install_optimizer_hook()
    model.register_state_dict_pre_hook(_sync_weights)
    return engine


def _sync_weights(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    """Before ``state_dict()``: the user's parameters take the engine's trained weights."""
    engine = next((e for e in _engines if e.source_model is module), None)
    if engine is None:
        return
    full = engine.gather_full_state(dst=None)
    with torch.no_grad():
        for name, param in module.named_parameters(remove_duplicate=False):
            if name in full:
                param.copy_(full[name].to(param.device, param.dtype))
            else:
                canonical = next((n for n, p in module.named_parameters() if p is param), None)
                if canonical in full:
                    param.copy_(full[canonical].to(param.device, param.dtype))


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


def _before_optimizer_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for engine in _engines:
        model = engine.source_model
        if model is not None and {id(p) for p in model.parameters()} <= params:
            engine.set_optimizer(optimizer_settings(optimizer))
            engine.optimizer_step()


def _install_optimizer_hook() -> None:
    if not _hook:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _hook.append(register_optimizer_step_pre_hook(_before_optimizer_step))


def _is_scalar(node) -> bool:
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point()


def _sizes_of(example: torch.Tensor, actual: torch.Tensor) -> dict[str, int]:
    """Symbolic sizes of the example input ids (batch, sequence) -> this call's values."""
    return {str(d): int(a) for d, a in zip(example.shape, actual.shape) if isinstance(d, torch.SymInt)}


def compile_with_plan(gm: fx.GraphModule, example_inputs: list, options: dict) -> Callable:
    """Dynamo backend body for training: returns the callable dynamo runs instead of ``gm``."""
    settings = parse_options(options)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    params = [t for t in example_inputs if isinstance(t, nn.Parameter)]
    batch_slots = {i: _batch_name(n) for i, n in enumerate(placeholders)
                   if isinstance(example_inputs[i], torch.Tensor) and not isinstance(example_inputs[i], nn.Parameter)
                   and not example_inputs[i].is_floating_point()}
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    loss_index = next((i for i, node in enumerate(outputs) if _is_scalar(node)), None)
    if "labels" not in batch_slots.values() and "input_ids" in batch_slots.values() and loss_index is not None:
        # labels=input_ids (the same tensor passed twice, as Hugging Face examples do): one graph input
        ids_slot = next(i for i, name in batch_slots.items() if name == "input_ids")
        batch_slots[-1 - ids_slot] = "labels"
    missing = {"input_ids", "labels"} - set(batch_slots.values())
    if missing or not params or loss_index is None:
        raise DynamoRuntimeError(
            f"mist backend: the compiled graph does not hold the whole model with input_ids and labels (missing "
            f"{sorted(missing)}): the forward breaks into several graphs, this one ending at {_where_it_ends(gm)}; "
            "a plan needs the model in one graph")
    model = find_owner_module(params)
    engine = _engine_for(model, settings)
    anchor = torch.zeros((), requires_grad=True)
    others = {i: (n.meta.get("example_value") if isinstance(n, fx.Node) else n) for i, n in enumerate(outputs)
              if i != loss_index}
    ids_slot = next(i for i, name in batch_slots.items() if name == "input_ids")
    ids_example = example_inputs[ids_slot]
    warned: list[bool] = []

    def run(*args: Any) -> tuple:
        batch = {name: args[i if i >= 0 else -1 - i] for i, name in batch_slots.items() if name in ("input_ids", "labels")}
        loss = torch.tensor(engine.forward_backward(batch), dtype=torch.float32)
        sizes = _sizes_of(ids_example, args[ids_slot])
        results: list[Any] = [None] * len(outputs)
        results[loss_index] = _Loss.apply(anchor, loss)
        for index, value in others.items():
            if isinstance(value, torch.Tensor):
                if not warned:
                    warnings.warn("mist backend: under a plan only the loss is computed; the model's other outputs "
                                  "(logits) are NaN", stacklevel=2)
                    warned.append(True)
                shape = [sizes.get(str(d), None) if isinstance(d, torch.SymInt) else int(d) for d in value.shape]
                results[index] = torch.full([d if d is not None else 1 for d in shape], float("nan"), dtype=value.dtype)
            else:
                results[index] = value
        return tuple(results)

    run.mist_engine = engine  # type: ignore[attr-defined]
    return run
