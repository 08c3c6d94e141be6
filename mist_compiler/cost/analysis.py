"""Glue between the captured program and the stage cost model: run the analysis passes per class.

``capture_program`` turns a model name into a ``MistProgram`` (through ``mist_compiler.capture``)
or passes a captured one through; ``analyse_program`` runs the cost-annotation and
memory-analysis passes on the representative graphs of the pre, layer and post block classes.
``analyse_graphs`` is the same for one block given its forward/backward GraphModules.
"""
from __future__ import annotations

import sympy
import torch
import torch.fx as fx

from ..passes.cost_annotation import CANONICAL_SYMBOLS, T, annotate_block, tensor_shape
from ..passes.memory_analysis import analyse_block_memory
from .stage_model import BLOCK_KINDS, BlockAnalysis, StageModelError


def _param_elements(forward: fx.GraphModule, params: set[str], states: dict[str, str]) -> tuple[sympy.Expr, int]:
    per_device, total = sympy.Integer(0), 0
    for node in forward.graph.nodes:
        if node.op == "placeholder" and node.name in params:
            value = node.meta.get("val")
            if not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point:
                continue
            elements = sympy.Mul(*tensor_shape(value, None))
            total += int(elements)
            per_device += elements / T if states.get(node.name) == "S" else elements
    return per_device, total


def analyse_graphs(kind: str, forward: fx.GraphModule, backward: fx.GraphModule, params: set[str],
                   symbols: dict[str, sympy.Symbol] | None = None,
                   backward_inputs: dict[str, str] | None = None) -> BlockAnalysis:
    """Cost annotation + memory analysis of one block from its captured graphs.

    ``params``: the forward graph's placeholder names that are parameters (trainable weights);
    ``symbols``: names of the graph's size symbols -> canonical ``b``/``s`` symbols.
    """
    symbols = {**CANONICAL_SYMBOLS, **(symbols or {})}
    costs = annotate_block(forward, backward, params, symbols, backward_inputs)
    memory = analyse_block_memory(forward, backward, costs, params, symbols, backward_inputs)
    per_device, total = _param_elements(forward, params, costs.param_states)
    return BlockAnalysis(kind, costs, memory, per_device, total)


def capture_program(model, *, seq_len: int, dtype: str):
    """A ``MistProgram`` for ``model`` (a name is captured; a program is returned as is)."""
    if not isinstance(model, str):
        return model
    from mist_compiler import capture

    return capture(model, seq_len=seq_len, dtype=dtype)


def _class_graphs(block_class) -> tuple[fx.GraphModule, fx.GraphModule, set[str], dict, dict]:
    graphs = getattr(block_class, "graphs", None) or {}
    forward, backward = graphs.get("forward"), graphs.get("backward")
    if forward is None or backward is None:
        raise StageModelError(
            f"block class {getattr(block_class, 'class_id', '?')} ({getattr(block_class, 'kind', '?')}) carries no live "
            "forward/backward graphs; analyse a freshly captured program, not one loaded from JSON")
    params = set(graphs.get("params") or ())
    if not params:  # fall back on the placeholders holding the class's parameters (static float shapes)
        params = {n.name for n in forward.graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
                  and n.meta["val"].dtype.is_floating_point and all(isinstance(d, int) for d in n.meta["val"].shape)}
    symbols = {name: CANONICAL_SYMBOLS[canon] for name, canon in (graphs.get("symbols") or {}).items()}
    return forward, backward, params, symbols, dict(graphs.get("backward_inputs") or {})


def analyse_program(program) -> tuple[dict[str, BlockAnalysis], int]:
    """Per block kind (pre, layer, post) analysis of a captured program, and its layer count."""
    by_kind: dict[str, BlockAnalysis] = {}
    layers = [block for block in program.blocks if block.kind == "layer"]
    for kind in BLOCK_KINDS:
        blocks = [block for block in program.blocks if block.kind == kind]
        if not blocks:
            raise StageModelError(f"captured program {program.model_name!r} has no {kind} block")
        class_ids = sorted({block.class_id for block in blocks})
        if len(class_ids) > 1:
            raise StageModelError(
                f"captured program {program.model_name!r} has {len(class_ids)} different {kind} block classes; "
                "the stage model needs identical layers")
        forward, backward, params, symbols, mapping = _class_graphs(program.block_class(class_ids[0]))
        by_kind[kind] = analyse_graphs(kind, forward, backward, params, symbols, mapping)
    return by_kind, len(layers)
