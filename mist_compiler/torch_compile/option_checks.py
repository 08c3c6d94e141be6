"""What ``torch.compile(model, backend="mist", options=...)`` checks before any work, each error naming
the option: option values (types, ranges, known names), and that a ``plan`` was made for this model.

A plan names its model: a class name (a plan the backend tuned for that class), a zoo name (``mistc
tune gpt2-7b``), ``hf:...`` or ``package.module:function``. A plan for a zoo model is compared with
the module parameter by parameter (the zoo model is built on the meta device: nothing is loaded
from the plan); a class name (a capitalised identifier) must be the module's class; any other label is
the user's own. ``hf:`` and factory plans are not loaded
(a plan never names code that gets run): their layers and positions are checked against the
captured module as for every plan.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..ir.plan import MAX_INT, Plan, PlanError
from ..ir.vocabulary import ATTENTION_KERNELS, TRAINING_DTYPES
from .live_parameters import DynamoRuntimeError


class OptionError(DynamoRuntimeError):
    """A ``torch.compile`` option the mist backend cannot take; the message names it."""


def check_option_values(options: dict) -> None:
    """Types and ranges of every given option (see ``plan_runtime.parse_options`` for which exist)."""
    def fail(name: str, expected: str) -> None:
        raise OptionError(f"mist backend: option {name!r} must be {expected}, got {options[name]!r}")

    for name in ("nodes", "gpus_per_node", "global_batch", "seq_len"):
        value = options.get(name)
        if name in options and not (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_INT):
            fail(name, f"an integer in 1..{MAX_INT}")
    if "timeout_s" in options:
        value = options["timeout_s"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
            fail("timeout_s", "a number of seconds > 0")
    if "dtype" in options and options["dtype"] not in TRAINING_DTYPES:
        fail("dtype", f"one of {list(TRAINING_DTYPES)}")
    if "attention" in options and options["attention"] not in ATTENTION_KERNELS:
        fail("attention", f"one of {list(ATTENTION_KERNELS)}")
    if "hardware" in options and not (isinstance(options["hardware"], str) and options["hardware"]) \
            and type(options["hardware"]).__name__ != "HardwareProfile":
        fail("hardware", "a profile name, a profile file path or a HardwareProfile")
    if options.get("device") is not None:
        try:
            torch.device(options["device"])
        except (RuntimeError, TypeError, ValueError):
            fail("device", "a torch device ('cuda:0', 'cpu', ...)")


def check_plan_model(plan: Plan, module: nn.Module) -> None:
    """Refuse a plan made for another model than ``module`` (see the module docstring)."""
    mine = type(module).__name__
    if plan.model == mine or plan.model.startswith("hf:") or ":" in plan.model:
        return
    from ..models import build_model, known_model_names

    if plan.model not in known_model_names():
        if plan.model.isidentifier() and plan.model[:1].isupper():  # a class name, as the backend writes
            raise PlanError(f"plan field model: the plan was made for {plan.model!r}, not for this {mine}")
        return  # a label of the user's choosing: the plan's layers and positions are checked on the capture
    with torch.device("meta"):
        reference = build_model(plan.model, seq_len=plan.seq_len, seed=None)
    theirs = {name: tuple(p.shape) for name, p in reference.named_parameters()}
    ours = {name: tuple(p.shape) for name, p in module.named_parameters()}
    differ = sorted(name for name in set(theirs) | set(ours) if theirs.get(name) != ours.get(name))
    if differ:
        name = differ[0]
        raise PlanError(f"plan field model: the plan was made for {plan.model!r}, which this {mine} is not: "
                        f"{name} is {list(theirs[name]) if name in theirs else 'absent'} there, "
                        f"{list(ours[name]) if name in ours else 'absent'} here")
