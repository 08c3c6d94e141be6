"""The stage cost model's per-block functions: the analysis' sympy expressions of a block class
(FLOPs and bytes per op class and phase, GEMM shapes, collectives, saved and peak bytes, units)
lambdified in ``(b, s, t)`` for numpy, once per block class (``stage_model`` evaluates them)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import sympy

from ..passes.cost_annotation import B, S, T
from .blocks import BlockAnalysis, StageModelError
from .op_time import POINTWISE_PREFIX


_LAMBDIFIED: dict[sympy.Expr, Callable] = {}  # expression -> numpy function: analyses of one model repeat them
_LAMBDIFIED_MAX = 8192


def lambdify_bst(expr: sympy.Expr) -> Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]:
    expr = sympy.sympify(expr)
    function = _LAMBDIFIED.get(expr)
    if function is None:
        unknown = expr.free_symbols - {B, S, T}
        if unknown:
            raise StageModelError(f"cost expression {expr} has symbols {sorted(map(str, unknown))} besides b, s, t")
        function = sympy.lambdify((B, S, T), expr, modules="numpy")
        if len(_LAMBDIFIED) >= _LAMBDIFIED_MAX:
            _LAMBDIFIED.clear()
        _LAMBDIFIED[expr] = function

    def evaluate(b: np.ndarray, s: np.ndarray, t: np.ndarray) -> np.ndarray:
        b, s, t = np.broadcast_arrays(np.asarray(b, float), np.asarray(s, float), np.asarray(t, float))
        return np.broadcast_to(np.asarray(function(b, s, t), dtype=float), b.shape).copy()

    return evaluate


@dataclass
class BlockFunctions:
    """Lambdified per-block quantities."""

    flops: dict[str, dict[str, Callable]]  # phase -> op class -> f(b, s, t)
    nbytes: dict[str, dict[str, Callable]]
    collectives: dict[str, list[tuple[str, Callable]]]  # phase -> (collective kind, payload) of the TP edges
    saved: Callable
    input: Callable
    output: Callable
    forward_peaks: list[Callable]  # points where the block's weights are in use
    backward_peaks: list[Callable]
    forward_peaks_weights_free: list[Callable]  # points past its last weight use / before its first (the loss)
    backward_peaks_weights_free: list[Callable]
    saved_sequence: list[Callable]  # saved storages in the order the forward saves them
    saved_offloadable: list[bool]
    params_per_device: Callable
    tp_supported: bool
    op_count: dict[str, int]  # phase -> ops that run a kernel (views excluded): each pays the profile's op overhead
    tp_granularity: int
    units: list[Callable]  # the first two units in forward order (the second 0 when there is one)
    tp_optional: bool = False
    gemms: dict[str, list[tuple[Callable, Callable]]] = field(default_factory=dict)  # phase -> (flops, bytes) per matmul
    loss: tuple[Callable, Callable, Callable] | None = None  # the fused loss's (N, H, V per device), cost.loss_kernel
    loss_dtype_bytes: int = 4
    stash: Callable | None = None  # bytes the backward's weight half keeps from the input half
    borrowed: Callable | None = None  # elements of parameters another block owns (BlockAnalysis.borrowed)
    backward_peaks_apart: list[Callable] | None = None  # in a stage without the post block (BlockAnalysis.apart)


SEQUENCE_LAYER = "layer_sp"  # the layer's functions as sequence parallelism runs it

# The math attention kernel materialises the b*h*s*s scores: forward writes the scores, softmax
# reads and writes them, probs @ v reads them (4 passes); backward reads the probabilities twice
# and writes / reads their gradient and the scores' gradient (6 passes).
MATH_ATTENTION_PASSES = {"forward": 4, "backward": 6}


# The fused loss's own passes over its slices of logits, per logit of d bytes (``ops.linear_cross_entropy``):
# forward the GEMM writes a slice and the log-sum-exp reads it; backward the recompute writes it and the
# softmax gradient reads and rewrites it. Its node is priced as a GEMM (its inputs and outputs only), so
# these are added as softmax-class traffic; ``cost.loss_kernel`` takes the same passes off for the plain loss.
FUSED_LOSS_PASSES = {"forward": 2, "backward": 3}


def _class_bytes(block: BlockAnalysis, phase: str, graph_costs, attention: str) -> dict[str, sympy.Expr]:
    nbytes = dict(graph_costs.bytes_by_class())
    if attention == "math" and block.memory.attention_probs != 0 and phase in MATH_ATTENTION_PASSES:
        extra = MATH_ATTENTION_PASSES[phase] * block.memory.attention_probs
        nbytes["attention"] = nbytes.get("attention", sympy.Integer(0)) + extra
    if block.loss is not None and phase in FUSED_LOSS_PASSES:
        loss = block.loss
        passes = FUSED_LOSS_PASSES[phase] * loss.dtype_bytes * loss.rows * loss.vocab
        nbytes["softmax"] = nbytes.get("softmax", sympy.Integer(0)) + passes
    return nbytes


def _class_flops(graph_costs, class_bytes: dict[str, sympy.Expr]) -> dict[str, sympy.Expr]:
    """FLOPs per op class, with a zero for every class that only has bytes (the time loop runs over these)."""
    flops = dict(graph_costs.flops_by_class())
    for op_class in class_bytes:
        flops.setdefault(op_class, sympy.Integer(0))
    return flops


def block_functions(block: BlockAnalysis, attention: str) -> BlockFunctions:
    # "weight": the backward's weight half (part of "backward"), for schedules that run it apart
    weight = block.weight_costs if block.weight_costs is not None else block.costs.backward.restrict(set())
    phases = {"forward": block.costs.forward, "backward": block.costs.backward, "weight": weight}
    class_bytes = {p: _class_bytes(block, p, g, attention) for p, g in phases.items()}
    return BlockFunctions(
        flops={p: {c: lambdify_bst(e) for c, e in _class_flops(g, class_bytes[p]).items()} for p, g in phases.items()},
        nbytes={p: {c: lambdify_bst(e) for c, e in class_bytes[p].items()} for p in phases},
        collectives={p: [(c.kind, lambdify_bst(c.bytes)) for c in g.collectives] for p, g in phases.items()},
        saved=lambdify_bst(block.memory.saved[attention]),
        input=lambdify_bst(block.memory.input),
        output=lambdify_bst(block.memory.output),
        forward_peaks=[lambdify_bst(e) for e in _weighted_points(block, "forward", attention)],
        backward_peaks=[lambdify_bst(e) for e in _weighted_points(block, "backward", attention)],
        forward_peaks_weights_free=[lambdify_bst(e) for e in _weights_free_points(block, "forward", attention)],
        backward_peaks_weights_free=[lambdify_bst(e) for e in _weights_free_points(block, "backward", attention)],
        # activation offload is priced per layer (greedy_offload), so only the layer's sequence is needed
        saved_sequence=[lambdify_bst(e) for e in block.memory.saved_sequence] if block.kind == "layer" else [],
        saved_offloadable=list(block.memory.saved_offloadable) if block.kind == "layer" else [],
        params_per_device=lambdify_bst(block.params_per_device),
        tp_supported=block.tp_supported,
        op_count={p: sum(1 for c in g.nodes if c.op_class != "view" and not c.op_class.startswith(POINTWISE_PREFIX))
                  for p, g in phases.items()},
        tp_granularity=block.tp_granularity,
        tp_optional=block.tp_optional,
        gemms={p: [(lambdify_bst(c.flops), lambdify_bst(c.bytes)) for c in g.nodes if c.op_class == "matmul"]
               for p, g in phases.items()},
        units=[lambdify_bst(e) for e in ((block.units or [block.params_per_device]) + [sympy.Integer(0)])[:2]],
        loss=None if block.loss is None else tuple(lambdify_bst(e) for e in (block.loss.rows, block.loss.hidden,
                                                                          block.loss.vocab)),
        loss_dtype_bytes=block.loss.dtype_bytes if block.loss is not None else 4,
        stash=lambdify_bst(block.weight_stash),
        borrowed=lambdify_bst(block.borrowed),
        backward_peaks_apart=None if block.apart is None else [lambdify_bst(e)
                                                               for e in block.apart.backward_peaks[attention]],
    )


def _weighted_points(block: BlockAnalysis, phase: str, attention: str) -> list[sympy.Expr]:
    """Peak candidates at which the block holds its weights (the backend's units are modules: only
    the post block's loss runs outside one, so only the post block splits its points)."""
    memory = block.memory
    split = getattr(memory, f"{phase}_peaks_weights", {}).get(attention)
    if block.kind != "post" or not split:
        return getattr(memory, f"{phase}_peaks")[attention]
    return split


def _weights_free_points(block: BlockAnalysis, phase: str, attention: str) -> list[sympy.Expr]:
    if block.kind != "post":
        return []
    return getattr(block.memory, f"{phase}_peaks_weights_free", {}).get(attention) or []


def costliest_layer(classes: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The terms of a layer when a model's layers differ (dense and mixture-of-experts, alternating
    attention kinds): each quantity at its largest over the classes, so wherever the tuner cuts
    the stages their time and memory are upper bounds (each class is analysed on its own)."""
    if len(classes) == 1:
        return classes[0]
    names = {name for terms in classes for name in terms}
    return {name: np.max(np.stack([terms[name] for terms in classes if name in terms]), axis=0) for name in names}
