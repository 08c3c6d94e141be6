"""``torch.compile(model, backend="mist", options=...)``: the user's loop, run by a plan.

The dynamo backend hands the graph here (:func:`compile_with_plan`) when options ask for
training: either ``plan`` (a Plan or a path) or what tuning needs (``hardware``, ``nodes``,
``gpus_per_node``, ``global_batch``, optionally ``seq_len``, ``dtype``, ``attention``; and
``compile_units=False`` to run the stage programs eagerly, for debugging). Dynamo
lifts the model's parameters into graph inputs whose sources lead back to a local (or global)
of the frame being compiled: that object is the user's ``nn.Module`` (:func:`compiled_module`,
no search of the heap). The driver cuts the program from the graph dynamo handed the backend
(``frontend/dynamo_graph.py``: a graph traced with static sizes, ``torch.compile``'s default, or with
``labels=input_ids`` is first traced again by dynamo with symbolic sizes), else captures the module
(``Training.captured_from`` says which and why), tunes if needed, and builds this rank's engine from the module's own weights, once per module. The user's loop stays as it is::

    out = compiled(input_ids=..., labels=...)    # the whole micro-batch schedule: forward and backward
    out.loss.backward()                          # nothing left to do (the gradients are in .grad)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step(); sched.step(); opt.zero_grad()    # the user's optimizer, as in eager

``model.parameters()`` are the trained ones after every step, with ``.grad`` after every call
(:mod:`.live_parameters`: under plans that keep every parameter whole on every rank they *are* the
engine's fp32 masters and any optimizer updates them; under sharded plans the engine runs AdamW or
Adam-without-decay with the optimizer's settings read at every step, and the parameters are given
the result). ``model.state_dict()`` is therefore the trained state, with no collective. A call in
eval mode (``model.eval()``) or without gradients (``torch.no_grad()``) runs the model's own forward
on those parameters, every output computed; in training mode only the loss is computed (other
outputs, such as Hugging Face logits, are NaN tensors of their shape, with a warning).

The plan's dtype follows the user unless options say otherwise: an ``autocast`` region around the
call or inside the forward gives its dtype (mixed precision, fp32 masters), else the parameters'
dtype (an fp32 model trains in fp32, as eager and every other backend do).

Using the backend drops logging calls inside compiled code, as capture does (Hugging Face's
``warning_once`` would otherwise split GPT-2 into two graphs); a graph that still does not hold
the whole model is refused, naming where it ends.
"""
from __future__ import annotations

import atexit
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import nn

from ..ir.plan import Plan, PlanError, load_plan
from ..runtime.engine import DEFAULT_TIMEOUT_S, EXTERNAL_OPTIMIZER, Engine
from .live_parameters import (
    AliasedParameters, DynamoRuntimeError, MirroredParameters, binding_for, optimizer_settings,
)
from .option_checks import check_option_values, check_plan_model

PLAN_OPTIONS = {"plan"}
TUNING_OPTIONS = {"hardware", "nodes", "gpus_per_node", "global_batch", "seq_len", "dtype", "attention"}
RUNTIME_OPTIONS = {"timeout_s", "device", "compile_units"}
KNOWN_OPTIONS = PLAN_OPTIONS | TUNING_OPTIONS | RUNTIME_OPTIONS
_trainings: list["Training"] = []
_hooks: list[Any] = []


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
    return _trainings[-1].engine if _trainings else None


def parse_options(options: dict) -> dict[str, Any]:
    """Validated settings for the driver; unknown or missing options are named."""
    unknown = sorted(set(options) - KNOWN_OPTIONS - {"name"})
    if unknown:
        raise DynamoRuntimeError(f"mist backend: unknown option(s) {unknown}; known: {sorted(KNOWN_OPTIONS)}")
    check_option_values(options)
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
    settings.update({name: options[name] for name in TUNING_OPTIONS if name in options})
    return settings


def _chain(source: Any) -> list[Any]:
    """A dynamo source and its bases, the frame's local (or global) first."""
    chain = []
    while source is not None:
        chain.append(source)
        source = getattr(source, "base", None)
    return chain[::-1]


def compiled_module(gm: fx.GraphModule, params: list[torch.Tensor]) -> nn.Module:
    """The ``nn.Module`` whose parameters the graph lifted, read where dynamo read them: each lifted
    parameter's source is a path from a local (or global) of the frame being compiled (``L['self']``
    when a module is compiled, ``L['args'][0]`` through a decorator); the first module on the path
    that owns every parameter of the graph is the model."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    tx = InstructionTranslator.current_tx()
    if tx is not None:
        frame = tx.output.root_tx
        scope = {"L": frame.f_locals, "G": frame.f_globals}
        wanted = {id(p) for p in params}
        for node in gm.graph.nodes:
            grapharg = node.meta.get("grapharg") if node.op == "placeholder" else None
            if grapharg is None or not isinstance(grapharg.example, nn.Parameter):
                continue
            for source in _chain(grapharg.source):
                try:
                    value = eval(source.name, scope)  # noqa: S307 (dynamo's own guard expressions, in its scope)
                except Exception:
                    break
                if isinstance(value, nn.Module) and wanted <= {id(p) for p in value.parameters()}:
                    return value
            break  # every parameter comes from the same frame: one path decides
    raise DynamoRuntimeError("mist backend: the graph's parameters do not all belong to one nn.Module the compiled "
                             "code reads (compile the model, or a function of one model)")


def user_dtype(model: nn.Module, gm: fx.GraphModule) -> str:
    """The dtype the user trains in: an autocast region's (around the call or in the forward), else
    the parameters'."""
    devices = {p.device.type for p in model.parameters()} or {"cpu"}
    for device in sorted(devices):
        if torch.is_autocast_enabled(device):
            return _dtype_name(torch.get_autocast_dtype(device))
    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "__name__", "") == "_enter_autocast":
            args = list(node.args) + [None] * 3
            if args[2] is not False and isinstance(args[1], torch.dtype):
                return _dtype_name(args[1])
    floating = [p.dtype for p in model.parameters() if p.is_floating_point()]
    return _dtype_name(max(set(floating), key=floating.count) if floating else torch.float32)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


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


@dataclass
class Training:
    """One user module trained by this process: its engine and how its parameters stay live."""

    model: nn.Module
    engine: Engine
    parameters: AliasedParameters | MirroredParameters
    captured_from: str = "module"  # "graph": the program was cut from dynamo's graph; else why not


def _training_for(model: nn.Module, settings: dict, gm: fx.GraphModule, example_inputs: list) -> Training:
    """One per module: dynamo recompiles (new guards once the batch changes) keep training it."""
    for training in _trainings:
        if training.model is model:
            return training
    from .. import driver

    plan = settings.pop("plan", None)
    if plan is not None:
        check_plan_model(plan, model)
    runtime = {k: settings.pop(k) for k in list(settings) if k in RUNTIME_OPTIONS}
    if plan is None:
        settings.setdefault("dtype", user_dtype(model, gm))
    # capture (cut from dynamo's graph where it can be), tune, check
    compiled = driver.compile_model(model, plan=plan, until="plan", graph=(gm, example_inputs), **settings)
    binding = binding_for(model, compiled.plan)
    optimizer = None if binding.owns_update else EXTERNAL_OPTIMIZER
    engine = driver.compile_model(model, plan=compiled.plan, program=compiled.program, prove=False,
                                  optimizer=optimizer, **runtime).engine
    engine.source_model = model
    training = Training(model, engine, binding(model, engine), compiled.captured_from)
    if not _trainings:
        atexit.register(_close_trainings)
    _trainings.append(training)
    _install_optimizer_hooks()
    return training


def _close_trainings() -> None:
    """At exit: stop every engine's threads (its failure monitor) before the interpreter goes; the
    user's loop never closes the engines the backend made."""
    for training in _trainings:
        training.engine.close()


def _trainings_of(optimizer: torch.optim.Optimizer) -> list[Training]:
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    found = []
    for training in _trainings:
        mine = {id(p) for p in training.model.parameters() if p.requires_grad}
        if not mine & params:
            continue
        if training.parameters.owns_update and not mine <= params:
            raise DynamoRuntimeError(f"mist backend: {type(optimizer).__name__} holds only some of "
                                     f"{type(training.model).__name__}'s parameters; under this plan the engine "
                                     "updates them all: give the optimizer every trainable parameter")
        found.append(training)
    return found


def _before_optimizer_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    for training in _trainings_of(optimizer):
        training.parameters.before_optimizer_step(optimizer)


def _after_optimizer_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    for training in _trainings_of(optimizer):
        training.parameters.after_optimizer_step()


def _install_optimizer_hooks() -> None:
    if not _hooks:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        _hooks.append(register_optimizer_step_pre_hook(_before_optimizer_step))
        _hooks.append(register_optimizer_step_post_hook(_after_optimizer_step))


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
    model = compiled_module(gm, params) if params else None
    refusal = DynamoRuntimeError(
        f"mist backend: the compiled graph does not hold the whole model with input_ids and labels (missing "
        f"{sorted(missing)}): the forward breaks into several graphs, this one ending at {_where_it_ends(gm)}; "
        "a plan needs the model in one graph")

    def training_mode() -> bool:
        return torch.is_grad_enabled() and (model is None or model.training)

    if missing or model is None or loss_index is None:  # not a training step: eval forwards run as they are
        if training_mode():
            raise refusal

        def forward_only(*args: Any) -> Any:
            if training_mode():
                raise refusal
            return gm(*args)

        return forward_only
    training = _training_for(model, settings, gm, example_inputs)
    engine = training.engine
    anchor = torch.zeros((), requires_grad=True)
    others = {i: (n.meta.get("example_value") if isinstance(n, fx.Node) else n) for i, n in enumerate(outputs)
              if i != loss_index}
    ids_slot = next(i for i, name in batch_slots.items() if name == "input_ids")
    ids_example = example_inputs[ids_slot]
    warned: list[bool] = []

    def run(*args: Any) -> Any:
        if not training_mode():  # model.eval() or torch.no_grad(): the model's own forward, on its live weights
            return gm(*args)
        training.parameters.before_forward()
        batch = {name: args[i if i >= 0 else -1 - i] for i, name in batch_slots.items()
                 if name in ("input_ids", "labels")}
        loss = torch.tensor(engine.forward_backward(batch), dtype=torch.float32)
        training.parameters.after_backward()
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


__all__ = ["DynamoRuntimeError", "Training", "compile_with_plan", "compiled_module", "last_engine", "optimizer_settings",
           "parse_options", "user_dtype", "wants_runtime"]
