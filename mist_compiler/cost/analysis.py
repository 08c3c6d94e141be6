"""Glue between the captured program and the stage cost model: run the analysis passes per class.

``capture_program`` turns a model name into a ``MistProgram`` (through ``mist_compiler.capture``)
or passes a captured one through. ``analyse_program`` runs the cost-annotation and
memory-analysis passes over the program's captured forward/backward graphs once (the capture
traces one layer per layer class between the pre and post blocks) and returns, per block kind
(pre, layer, post), the restricted costs, memory and parameter counts the stage model needs.
"""
from __future__ import annotations

import functools

import sympy
import torch
import torch.fx as fx

from ..passes.cost_annotation import CANONICAL_SYMBOLS, T, annotate_graphs, tensor_shape
from ..passes.memory_analysis import analyse_memory
from .stage_model import BLOCK_KINDS, BlockAnalysis, StageModelError


def capture_program(model, *, seq_len: int, dtype: str):
    """A ``MistProgram`` for ``model`` (a name is captured; a program is returned as is)."""
    if not isinstance(model, str):
        return model
    from mist_compiler import capture

    return capture(model, seq_len=seq_len, dtype=dtype)


@functools.lru_cache(maxsize=16)
def analyse_named_model(name: str, seq_len: int, dtype: str) -> tuple[dict[str, BlockAnalysis], int, str]:
    """Capture and analyse a model by name once per process (the tuner and analyze reuse it)."""
    program = capture_program(name, seq_len=seq_len, dtype=dtype)
    blocks, num_layers = analyse_program(program)
    return blocks, num_layers, program.model_name


def parameter_placeholders(forward: fx.GraphModule, backward: fx.GraphModule) -> set[str]:
    """Forward placeholders that receive a gradient (the backward's outputs follow the primals)."""
    placeholders = [n for n in forward.graph.nodes if n.op == "placeholder"]
    output = next(n for n in backward.graph.nodes if n.op == "output")
    grads = output.args[0] if isinstance(output.args[0], (tuple, list)) else output.args
    return {placeholders[i].name for i, grad in enumerate(grads)
            if isinstance(grad, fx.Node) and i < len(placeholders)
            and isinstance(placeholders[i].meta.get("val"), torch.Tensor)
            and placeholders[i].meta["val"].dtype.is_floating_point
            and all(isinstance(d, int) for d in placeholders[i].meta["val"].shape)}


def symbol_names(program, forward: fx.GraphModule) -> dict[str, sympy.Symbol]:
    """Graph size symbols (``s72``...) -> canonical ``b``/``s``, matched against the IR's shapes."""
    values = {n.name: n.meta.get("val") for n in forward.graph.nodes}
    mapping: dict[str, sympy.Symbol] = {}
    for block_class in program.block_classes.values():
        for ir_node in block_class.forward_nodes:
            value = values.get(ir_node.name)
            if not isinstance(value, torch.Tensor) or not ir_node.outputs:
                continue
            for size, ir_size in zip(value.shape, ir_node.outputs[0].shape):
                if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                    ir_size = sympy.sympify(ir_size)
                    if isinstance(ir_size, sympy.Symbol) and ir_size.name in CANONICAL_SYMBOLS:
                        mapping[size.node.expr.name] = CANONICAL_SYMBOLS[ir_size.name]
    return mapping


def _param_elements(forward: fx.GraphModule, names: set[str], params: set[str], states: dict[str, str]) -> tuple[sympy.Expr, int]:
    per_device, total = sympy.Integer(0), 0
    for node in forward.graph.nodes:
        if node.op == "placeholder" and node.name in params and node.name in names:
            elements = sympy.Mul(*tensor_shape(node.meta["val"], None))
            total += int(elements)
            per_device += elements / T if states.get(node.name) == "S" else elements
    return per_device, total


def _reattribute_unsourced(classes: dict, backward: fx.GraphModule) -> dict[str, set[str]]:
    """Block node sets, with backward nodes no module issued (gradient-accumulation adds) moved
    to the block of their users: the capture cannot place them by module and files them last."""
    blocks = {kind: set(block_class.graphs["nodes"]) for kind, block_class in classes.items()}
    unsourced = {node.name for block_class in classes.values() for node in block_class.backward_nodes if not node.source}
    block_of = {name: kind for kind, names in blocks.items() for name in names}
    for node in reversed(list(backward.graph.nodes)):
        if node.name not in unsourced:
            continue
        targets = {block_of.get(user.name) for user in node.users} - {None}
        if len(targets) == 1:
            target = targets.pop()
            blocks[block_of[node.name]].discard(node.name)
            blocks[target].add(node.name)
            block_of[node.name] = target
    return blocks


def analyse_program(program) -> tuple[dict[str, BlockAnalysis], int]:
    """Per block kind (pre, layer, post) analysis of a captured program, and its layer count."""
    classes = {}
    for kind in BLOCK_KINDS:
        class_ids = sorted({block.class_id for block in program.blocks if block.kind == kind})
        if not class_ids:
            raise StageModelError(f"captured program {program.model_name!r} has no {kind} block")
        if len(class_ids) > 1:
            raise StageModelError(f"captured program {program.model_name!r} has {len(class_ids)} different {kind} "
                                  "block classes; the stage model needs identical layers")
        classes[kind] = program.block_class(class_ids[0])
    graphs = classes["layer"].graphs or {}
    forward, backward = graphs.get("forward"), graphs.get("backward")
    if forward is None or backward is None:
        raise StageModelError("the captured program carries no live forward/backward graphs; "
                              "analyse a freshly captured program, not one loaded from JSON")
    params = parameter_placeholders(forward, backward)
    symbols = {**CANONICAL_SYMBOLS, **symbol_names(program, forward)}
    costs = annotate_graphs(forward, backward, params, symbols)
    blocks = _reattribute_unsourced(classes, backward)
    memory = analyse_memory(forward, backward, costs, params, blocks, symbols)
    result = {}
    for kind, names in blocks.items():
        per_device, total = _param_elements(forward, names, params, costs.param_states)
        result[kind] = BlockAnalysis(kind, costs.restrict(names), memory[kind], per_device, total)
    return result, sum(1 for block in program.blocks if block.kind == "layer")
