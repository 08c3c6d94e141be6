"""The ``torch.compile(model, backend="mist")`` entry point.

Without training options, the backend analyses the dynamo graph into a MistProgram (kept as
:func:`last_program`) and runs it on this process exactly like eager: aot_autograd with
forward/backward compilers that return the partitioned graphs as boxed callables. With
``options={"plan": ...}`` or what tuning needs (``hardware``, ``nodes``, ``gpus_per_node``,
``global_batch``) it hands over to ``mist_compiler.torch_compile.plan_runtime.compile_with_plan``:
tune (if no plan), then train the user's module through the distributed runtime.

Loading it makes dynamo drop logging calls in compiled code (see :func:`_drop_logging_calls`).
Reached as "mist" through the ``torch_dynamo_backends`` entry point of the installed package:
dynamo imports this module and registers :func:`mist_backend` itself, so importing it must
not register anything (a second registration is dynamo's "duplicate name" error, TORCH-NOTES
section 9). :func:`register` is for a source tree that is not installed; it is idempotent.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx

from ..ir.capture_state import CaptureState
from ..frontend.joint import JointCapture, joint_backend
from ..frontend.to_ir import lower_to_ir
from ..ir.program import ATTENTION_KERNELS, MistProgram
from ..passes.block_discovery import block_discovery
from ..passes.manager import PassManager
from ..passes.shape_prop import shape_prop

ANALYSIS_OPTIONS = {"attention": "target attention kernel for saved-tensor analysis (flash|math)",
                    "name": "model name recorded in the program"}

_last: dict[str, MistProgram | None] = {"program": None}
_history: list[MistProgram] = []  # one program per graph compiled, oldest first (bounded)
HISTORY_LIMIT = 16


class BackendOptionError(ValueError):
    """Bad ``torch.compile(..., options=...)`` for the mist backend; names the option."""


def last_program() -> MistProgram | None:
    """The MistProgram of the most recent graph the mist backend compiled (None before any)."""
    return _last["program"]


def compiled_programs() -> list[MistProgram]:
    """Programs of the last graphs compiled, oldest first: a model with graph breaks gives several."""
    return list(_history)


def forget_programs() -> None:
    """Drop the analyses kept so far (last_program() becomes None)."""
    _history.clear()
    _last["program"] = None


def analyse(joint: JointCapture, name: str = "dynamo", attention: str = "flash") -> MistProgram:
    """The analysis passes of ``capture`` applied to a graph dynamo handed us (no layer reduction)."""
    dtypes = sorted({str(n.meta["val"].dtype).replace("torch.", "") for n in joint.joint_graph.graph.nodes
                     if n.name in joint.primal_params and isinstance(n.meta.get("val"), torch.Tensor)
                     and n.meta["val"].is_floating_point()})
    tokens = [n.meta.get("val") for n in joint.joint_graph.graph.nodes if n.name in joint.primal_inputs]
    seq = next((int(t.shape[1]) for t in tokens if isinstance(t, torch.Tensor) and t.dim() == 2
                and not t.is_floating_point() and not isinstance(t.shape[1], torch.SymInt)), 2048)
    state = CaptureState(None, name, attention, dtypes[0] if dtypes else "float32", seq, joint=joint)
    return PassManager([shape_prop, block_discovery, lower_to_ir])(state).program.program


def _delegate(gm: torch.fx.GraphModule, example_inputs: list, options: dict):
    from .plan_runtime import compile_with_plan  # the distributed runtime: imported only when training

    return compile_with_plan(gm, example_inputs, options)


def mist_backend(gm: torch.fx.GraphModule, example_inputs: list, **kwargs: Any):
    """Dynamo backend: analyse into a MistProgram and run like eager, or run a plan."""
    options = dict(kwargs.get("options") or {})
    if "plan" in options or set(options) - set(ANALYSIS_OPTIONS):
        return _delegate(gm, example_inputs, options)
    attention = options.get("attention", "flash")
    if attention not in ATTENTION_KERNELS:
        raise BackendOptionError(f"mist backend: option 'attention' must be one of {list(ATTENTION_KERNELS)}, got {attention!r}")
    name = str(options.get("name", "dynamo"))

    def on_capture(joint: JointCapture) -> None:
        program = analyse(joint, name, attention)
        _last["program"] = program
        _history.append(program)
        del _history[:-HISTORY_LIMIT]

    return joint_backend(on_capture)(gm, example_inputs)


def _drop_logging_calls() -> None:
    """Logging calls inside compiled code are dropped rather than splitting the model's graph
    (Hugging Face's ``warning_once`` in GPT-2's loss), as capture does; done when the backend is
    loaded, i.e. when a user asks for it, since tracing happens before the backend is called."""
    from ..frontend.joint import _logging_functions

    torch._dynamo.config.ignore_logging_functions.update(_logging_functions())


_drop_logging_calls()


def register() -> None:
    """Make ``backend="mist"`` available without the installed entry point (safe to call again)."""
    from torch._dynamo.backends.registry import _COMPILER_FNS

    if "mist" not in _COMPILER_FNS:
        torch._dynamo.register_backend(name="mist")(mist_backend)
