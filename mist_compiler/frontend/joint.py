"""Joint forward+backward ATen graphs through dynamo + aot_autograd.

``joint_backend(on_capture)`` is a dynamo backend: it hands the torch-level graph to
``aot_module_simplified`` with a partition function that records the joint graph, splits it with
``default_partition`` (every value the backward reads is saved: what eager autograd keeps) and
reports a :class:`JointCapture`. The compiled forward/backward are boxed callables running the
partitioned graphs, so the same backend also trains (``mist_backend``).

Before handing it on, the backend fuses the LM head with its cross-entropy loss in the torch-level
graph (``mist_compiler.ops.fuse_linear_cross_entropy``), so the joint graph, the cost model and a
runtime that runs that graph all see ``mist::linear_cross_entropy``; ``fuse_loss=False`` (or the
``loss_fusion(False)`` context, for callers further up) keeps the graph as traced.

``trace_joint(model, input_ids, labels)`` runs that backend once on a model whose weights are
FakeTensors, compiled with ``dynamic=True`` so the batch and sequence sizes are symbols.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass, field
from typing import Callable

import sympy
import torch
import torch.fx
from functorch.compile import make_boxed_func
from torch._functorch.aot_autograd import aot_module_simplified
from torch._functorch.partitioners import default_partition
from torch.utils._python_dispatch import _disable_current_modes

from ..ir.program import B, S
from ..ops import fuse_linear_cross_entropy
from ..passes.block_discovery import module_paths
from .boundaries import Boundaries, strip_boundaries

_FUSE_LOSS = [True]  # the default of joint_backend(fuse_loss=None); see loss_fusion


def loss_fusion_enabled() -> bool:
    """What a joint backend built now without an explicit ``fuse_loss`` does."""
    return _FUSE_LOSS[-1]


@contextlib.contextmanager
def loss_fusion(enabled: bool):
    """Within the block, joint backends built without an explicit ``fuse_loss`` fuse (or not)."""
    _FUSE_LOSS.append(bool(enabled))
    try:
        yield
    finally:
        _FUSE_LOSS.pop()


@dataclass
class JointCapture:
    """The graphs of one capture and what their placeholders are."""

    torch_graph: torch.fx.GraphModule  # dynamo's torch-level graph (nn_module_stack, sources)
    joint_graph: torch.fx.GraphModule  # forward+backward ATen graph (before partitioning)
    forward_graph: torch.fx.GraphModule
    backward_graph: torch.fx.GraphModule
    num_fwd_outputs: int
    saved_names: list[str]  # forward outputs after num_fwd_outputs: the values saved for backward
    symbol_map: dict  # ShapeEnv symbol -> IR symbol (b, s)
    primal_params: dict[str, str] = field(default_factory=dict)  # joint placeholder -> parameter path
    primal_inputs: dict[str, str] = field(default_factory=dict)  # joint placeholder -> input name
    boundaries: Boundaries = field(default_factory=Boundaries)  # layer entry/exit values of torch_graph
    primal_sources: dict[str, str] = field(default_factory=dict)  # joint placeholder -> torch_graph placeholder
    # what torch_graph's placeholders are, (tensors, batch, sizes) as regions.classify_inputs gives them,
    # when the graph's dynamo sources do not say it (a graph cut from the one a user's torch.compile traced)
    input_kinds: tuple | None = None


def _is_parameter(node: torch.fx.Node, example) -> bool:
    return isinstance(example, torch.nn.Parameter) or "_parameters_" in node.name


def _parameter_path(node: torch.fx.Node) -> str:
    """``blocks.0.attn.q.weight`` from the placeholder's module stack and its dynamo name."""
    leaf = node.name.split("_parameters_")[-1].strip("_")
    paths = module_paths(node)
    return f"{paths[-1]}.{leaf}" if paths else leaf


def batch_seq_symbols(gm: torch.fx.GraphModule) -> dict:
    """Map the ShapeEnv symbols of the token input's two dimensions to ``b`` and ``s``."""
    candidates = []
    for node in gm.graph.nodes:
        example = node.meta.get("example_value")
        if node.op == "placeholder" and isinstance(example, torch.Tensor) and example.dim() == 2 \
                and not example.is_floating_point():
            candidates.append((0 if "input_ids" in node.name else 1, node, example))
    if not candidates:
        return {}
    _, _, tokens = min(candidates, key=lambda c: c[0])
    mapping = {}
    for dim, symbol in zip(tokens.shape, (B, S)):
        if isinstance(dim, torch.SymInt) and isinstance(dim.node.expr, sympy.Symbol):
            mapping[dim.node.expr] = symbol
    return mapping


def joint_backend(on_capture: Callable[[JointCapture], None], fuse_loss: bool | None = None):
    """A dynamo backend that records the joint graph and runs the partitioned graphs (the LM head and
    its loss fused first unless ``fuse_loss`` is False; None: the ``loss_fusion`` default)."""
    fuse = _FUSE_LOSS[-1] if fuse_loss is None else fuse_loss

    def backend(gm: torch.fx.GraphModule, example_inputs: list, **_kwargs):
        boundaries = strip_boundaries(gm)  # capture's layer markers (none when the user compiles)
        if fuse:  # the graph every rank runs: the head and its loss fused (no N x V logits)
            fuse_linear_cross_entropy(gm)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]

        def partition(joint: torch.fx.GraphModule, joint_inputs, *, num_fwd_outputs: int, **kwargs):
            forward, backward = default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
            forward_outputs = list(forward.graph.find_nodes(op="output"))[0].args[0]
            saved = [n.name for n in forward_outputs[num_fwd_outputs:] if isinstance(n, torch.fx.Node)]
            primals = [n for n in joint.graph.nodes if n.op == "placeholder" and n.name.startswith("primals")]
            params, inputs, sources = {}, {}, {}
            for primal, node, example in zip(primals, placeholders, example_inputs):
                sources[primal.name] = node.name
                if _is_parameter(node, example):
                    params[primal.name] = _parameter_path(node)
                else:
                    inputs[primal.name] = node.name
            on_capture(JointCapture(gm, joint, forward, backward, num_fwd_outputs, saved,
                                    batch_seq_symbols(gm), params, inputs, boundaries, sources))
            return forward, backward

        def boxed(graph: torch.fx.GraphModule, _inputs):
            return make_boxed_func(graph.forward)

        return aot_module_simplified(gm, example_inputs, fw_compiler=boxed, bw_compiler=boxed, partition_fn=partition)

    return backend


def takes_use_cache(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forward has a ``use_cache`` switch (Hugging Face models): training
    never wants a key/value cache, whose updates would otherwise be traced and run."""
    try:
        return "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def model_call_kwargs(model: torch.nn.Module) -> dict:
    """Keyword arguments every training call of ``model`` adds to ``input_ids`` and ``labels``."""
    return {"use_cache": False} if takes_use_cache(model) else {}


def loss_of(output, model_name: str = "model") -> torch.Tensor:
    """The scalar loss (or the logits) in a model's output: a tensor, ``.loss``, ``["loss"]``,
    a tuple's first item or ``.logits``; anything else is a clear error."""
    loss = output
    if not isinstance(loss, torch.Tensor):
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, dict):
            loss = output.get("loss")
        if loss is None and isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
            loss = output[0]
        if loss is None:
            loss = getattr(output, "logits", None)
    if isinstance(loss, torch.Tensor) and (loss.dim() == 0 or loss.dim() == 3):
        return loss
    described = f"a tensor of shape {tuple(output.shape)}" if isinstance(output, torch.Tensor) else type(output).__name__
    raise ModelOutputError(
        f"{model_name}: forward(input_ids=..., labels=...) must return a scalar loss, an object with "
        f".loss, or logits [batch, seq, vocab]; it returned {described}"
    )


class ModelOutputError(ValueError):
    """A model whose forward returns neither a scalar loss nor logits."""


class CaptureError(ValueError):
    """torch.compile could not trace the model into one graph; the message says where."""


def _short_dynamo_message(error: Exception) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    head = lines[0] if lines else type(error).__name__
    user = [line.strip() for line in lines if line.strip().startswith("File ") and "mist_compiler" not in line]
    where = f" (at {user[-1]})" if user else ""
    return f"{head}{where}"


def _logging_functions() -> set:
    names = [n for n in dir(logging.Logger) if n in ("debug", "info", "warning", "warn", "error") or n.endswith("_once")]
    return set(torch._dynamo.config.ignore_logging_functions) | {getattr(logging.Logger, n) for n in names}


def graph_only_backend(on_capture: Callable[[JointCapture], None], fuse_loss: bool | None = None):
    """A dynamo backend that records only the torch-level graph (no aot_autograd): what a rank
    needs to run a plan whose pricing was done elsewhere (the loss fused as ``joint_backend`` does,
    so what runs is what was priced)."""
    fuse = _FUSE_LOSS[-1] if fuse_loss is None else fuse_loss

    def backend(gm: torch.fx.GraphModule, example_inputs: list, **_kwargs):
        boundaries = strip_boundaries(gm)
        if fuse:
            fuse_linear_cross_entropy(gm)
        on_capture(JointCapture(gm, None, None, None, 0, [], batch_seq_symbols(gm), boundaries=boundaries))
        return gm.forward

    return backend


def trace_joint(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                analyse: bool = True) -> JointCapture:
    """Trace ``model(input_ids=, labels=) -> loss`` (FakeTensor weights) into a joint graph
    (``analyse=False``: the torch-level graph only)."""
    captured: list[JointCapture] = []
    extra = model_call_kwargs(model)

    def run(model, input_ids, labels):
        output = model(input_ids=input_ids, labels=labels, **extra)
        loss = loss_of(output)
        if loss.dim() == 3:  # logits: the capture adds the standard next-token loss
            loss = torch.nn.functional.cross_entropy(loss.float().flatten(0, 1), labels.flatten())
        return loss

    # dynamic=True: sizes become symbols, and equal example sizes share one (duck sizing), so
    # input_ids and labels agree on b and s; parameter shapes stay static.
    backend = joint_backend(captured.append) if analyse else graph_only_backend(captured.append)
    compiled = torch.compile(run, backend=backend, fullgraph=True, dynamic=True)
    try:
        # module float attributes (eps) stay constants: otherwise dynamo lifts them to inputs,
        # fails in aot_autograd and traces everything a second time
        # logging calls in model code (Hugging Face's warning_once) are dropped, not graph breaks
        # a dispatch mode the caller has open (a memory probe) would make dynamo skip the frame; the
        # trace runs on fake tensors, so nothing the mode could see happens here
        fake_mode = getattr(input_ids, "fake_mode", None)
        with torch._dynamo.config.patch(specialize_float=True, ignore_logging_functions=_logging_functions()), \
                _disable_current_modes(), fake_mode if fake_mode is not None else contextlib.nullcontext():
            compiled(model, input_ids, labels)
    except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as error:
        raise CaptureError(
            f"capture: torch.compile cannot trace the model's forward and backward into one graph: "
            f"{_short_dynamo_message(error)}"
        ) from None
    finally:
        torch._dynamo.reset_code(run.__code__)
    if not captured:
        raise RuntimeError("capture: dynamo produced no graph with gradients (does the model have parameters?)")
    return captured[-1]
