"""Glue between the captured program and the stage cost model: run the analysis passes per class.

``analyse_program`` runs the analysis passes (cost annotation, memory analysis) over the program's
captured forward/backward graphs once (the capture
traces one layer per layer class between the pre and post blocks) and returns, per block kind
(pre, layer, post), the restricted costs, memory and parameter counts the stage model needs.
"""
from __future__ import annotations

import math
import operator

import sympy
import torch.fx as fx

from ..passes.cost_annotation import (ATTENTION_FORWARD, GraphCosts, ProgramCosts, T, cost_annotation, op_name,
                                      tensor_shape)
from ..passes.manager import PassManager
from ..passes.memory_analysis import BlockMemory, analyse_memory, memory_analysis
from ..passes.saved_tensors import saved_tensor_table
from ..passes.sp_pricing import sequence_parallel_pricing
from ..passes.weight_gradients import weight_gradients
from .blocks import BLOCK_KINDS, BlockAnalysis, StageModelError
from .compiled import compiled_cost_annotation
from .loss_kernel import loss_shape


def _param_elements(forward: fx.GraphModule, names: set[str], params: set[str], states: dict[str, str]) -> tuple[sympy.Expr, int]:
    per_device, total = sympy.Integer(0), 0
    for node in forward.graph.nodes:
        if node.op == "placeholder" and node.name in params and node.name in names:
            elements = sympy.Mul(*tensor_shape(node.meta["val"], None))
            total += int(elements)
            per_device += elements / T if states.get(node.name) == "S" else elements
    return per_device, total


def _borrowed_elements(forward: fx.GraphModule, names: set[str], params: set[str], states: dict[str, str]) -> sympy.Expr:
    """Per-device elements of the parameters the block reads but another block owns: a head tied to the
    token embedding (the weight's placeholder sits in the pre block; the post block's loss reads it)."""
    borrowed: dict[str, sympy.Expr] = {}
    for node in forward.graph.nodes:
        if node.name not in names:
            continue
        for source in node.all_input_nodes:
            if source.op == "placeholder" and source.name in params and source.name not in names:
                elements = sympy.Mul(*tensor_shape(source.meta["val"], None))
                borrowed[source.name] = elements / T if states.get(source.name) == "S" else elements
    return sympy.Add(*borrowed.values())


def _unit_elements(block_class, forward: fx.GraphModule, names: set[str], params: set[str],
                   states: dict[str, str]) -> list[sympy.Expr]:
    """Per-device parameter elements of each module that owns parameters in a pre/post block (the
    backend's units: the embedding and the positions, the final norm and the head), in forward
    order; a layer is one unit. The block class lists its parameter paths in the order of the
    graph's parameter placeholders (checked by shape); otherwise the block counts as one unit."""
    placeholders = [n for n in forward.graph.nodes if n.op == "placeholder" and n.name in params and n.name in names]
    paths = list(block_class.param_shapes)
    shapes = [tuple(int(d) for d in n.meta["val"].shape) for n in placeholders]
    whole = [sympy.Add(*(sympy.Mul(*shape) / (T if states.get(n.name) == "S" else 1) for n, shape in zip(placeholders, shapes)))]
    if block_class.kind == "layer" or len(paths) != len(shapes) or \
            any(tuple(block_class.param_shapes[path]) != shape for path, shape in zip(paths, shapes)):
        return whole
    units: dict[str, sympy.Expr] = {}
    for path, node, shape in zip(paths, placeholders, shapes):
        module = path.rsplit(".", 1)[0] if "." in path else ""
        units[module] = units.get(module, sympy.Integer(0)) + sympy.Mul(*shape) / (T if states.get(node.name) == "S" else 1)
    return list(units.values())


def _tp_granularity(forward: fx.GraphModule, names: set[str], states: dict[str, str]) -> int:
    """gcd of the block's attention head counts and the sizes of its sharded parameters' dims."""
    sizes = []
    for node in forward.graph.nodes:
        if node.name not in names:
            continue
        if op_name(node) in ATTENTION_FORWARD:
            sizes.append(int(node.args[0].meta["val"].shape[1]))
        elif node.op == "placeholder" and states.get(node.name) == "S":
            sizes.extend(int(d) for d in node.meta["val"].shape)
    return math.gcd(*sizes) if sizes else 0


ANALYSIS_PASSES = (
    cost_annotation,  # FLOPs, bytes, op class and tensor-parallel state per node; TP collectives
    memory_analysis,  # saved activations and peaks per block class, by liveness
    weight_gradients,  # each block's backward cut into input and weight halves, and what the weight half keeps
    sequence_parallel_pricing,  # the same with sequence parallelism (sequence-split states, its collectives)
    saved_tensor_table,  # per node of the layer: bytes kept for the backward, cost to recompute (the activation MILP)
)
COMPILED_ANALYSIS_PASSES = (
    compiled_cost_annotation,  # the partition inductor makes, elementwise chains priced as fused kernels
    memory_analysis,  # what that partition saves, by liveness (fused intermediates never stored)
    weight_gradients,  # as above, on the compiled partition
    sequence_parallel_pricing,
    saved_tensor_table,
)


def _with_collectives(costs: ProgramCosts, runtime: ProgramCosts) -> ProgramCosts:
    """``costs`` with the tensor-parallel collectives of ``runtime``, per phase.

    A compiled unit is cut at its collectives, which run eagerly between compiled segments
    (``lowering.compile``): the sequence-parallel gathers and reduce-scatters of a compiled layer are
    those of its eager program. Priced on the compiled partition of the whole layer they were not:
    that partition may save a row-parallel partial sum across a reduce-scatter (an all-reduce the
    runtime never runs) and re-gathers a recomputed norm's fp32 value, where the runtime gathers the
    norm's output again (1.5x the forward's and 1.6x the backward's bytes of a Llama layer)."""
    def phase(graph: GraphCosts, collectives: GraphCosts) -> GraphCosts:
        return GraphCosts(graph.nodes, list(collectives.collectives), graph.states)

    return ProgramCosts(phase(costs.forward, runtime.forward), phase(costs.backward, runtime.backward),
                        costs.sharding, costs.param_states)


def _borrowed_gradients(backward: fx.GraphModule, post: set[str]) -> frozenset[str]:
    """A shared weight's gradient parts made in the post block's backward (``post``: its node names) before
    its last use's (a tied head's), and the adds that sum them into the gradient the backward returns: what
    a stage without the post block (a pipeline's first stage and those between) never holds."""
    order = {node: index for index, node in enumerate(backward.graph.nodes)}
    output = next(node for node in reversed(backward.graph.nodes) if node.op == "output")
    names: set[str] = set()
    for node in output.all_input_nodes:
        if node.op == "call_function" and op_name(node) == "add" and len(node.all_input_nodes) == 2 \
                and all(source.op != "placeholder" for source in node.all_input_nodes):
            last = max(node.all_input_nodes, key=order.__getitem__)
            earlier = [source for source in node.all_input_nodes if source is not last and source.name in post]
            for source in earlier:  # (an item of the fused loss's backward: the tuple holds its bytes)
                names |= {node.name, source.name} | ({source.args[0].name} if source.target is operator.getitem
                                                     else set())
    return frozenset(names)


def _memory_apart(priced, post_class: int) -> dict[int, BlockMemory]:
    """Each block class's memory as a stage without the post block holds it, where the model shares a weight
    between the blocks (a head tied to the embedding): the analysed backward, of the whole model, carries
    the head's gradient part from the post block's backward to the embedding's, which adds its own; a
    pipeline's first stage (and those between) never has it (``runtime.tied_weights``). Empty: nothing shared."""
    borrowed = _borrowed_gradients(priced.graphs.backward, priced.graphs.blocks[post_class])
    if not borrowed:
        return {}
    graphs = priced.graphs
    blocks = {str(class_id): names for class_id, names in graphs.blocks.items()}
    results = analyse_memory(graphs.forward, graphs.backward, priced.costs, graphs.params, blocks, graphs.symbols,
                             transient=priced.transient | borrowed, block_nodes=priced.block_nodes)
    return {int(label): memory for label, memory in results.items()}


def analyse_program(program, compiled: bool = False) -> tuple[dict[str, BlockAnalysis], int]:
    """Per block kind (pre, layer, post) analysis of a captured program (the analysis passes, run
    once by the pass manager), and its layer count. A model whose layers differ (dense then
    mixture-of-experts layers, alternating attention kinds) has one entry per layer class:
    ``layer`` (the first class) and ``layer#1``, ``layer#2`` ... (the others). ``compiled``: price
    the program each unit's compiled code runs (``cost.compiled``) instead of the eager one."""
    classes = {}
    for kind in BLOCK_KINDS:
        class_ids = sorted({block.class_id for block in program.blocks if block.kind == kind})
        if not class_ids and kind == "layer":
            raise StageModelError(f"model {program.model_name!r} has no layer blocks: Mist needs the model's layers "
                                  "in one nn.ModuleList of blocks (block(x) -> x)")
        if not class_ids:
            raise StageModelError(f"captured program {program.model_name!r} has no {kind} block")
        if len(class_ids) > 1 and kind != "layer":
            raise StageModelError(f"captured program {program.model_name!r} has {len(class_ids)} different {kind} "
                                  "block classes")
        for index, class_id in enumerate(class_ids):
            classes[kind if index == 0 else f"{kind}#{index}"] = program.block_class(class_id)
    try:
        analysed = PassManager(COMPILED_ANALYSIS_PASSES if compiled else ANALYSIS_PASSES)(program).program
    except ValueError as error:
        raise StageModelError(str(error)) from None
    graphs, costs = analysed.analysis.graphs, analysed.analysis.costs
    forward, params, symbols = graphs.forward, graphs.params, graphs.symbols
    blocks = {kind: graphs.blocks[block_class.class_id] for kind, block_class in classes.items()}
    memory = {kind: analysed.analysis.memory[block_class.class_id] for kind, block_class in classes.items()}
    apart = _memory_apart(analysed.analysis, classes["post"].class_id)
    result = {}
    plan = program.model_graph.tp if program.model_graph is not None else None
    for kind, names in blocks.items():
        per_device, total = _param_elements(forward, names, params, costs.param_states)
        if kind.startswith("layer") and plan is not None and plan.supported:
            granularity = plan.granularity  # what the lowering checks: heads, kv heads, split features
        else:
            granularity = _tp_granularity(forward, names, costs.param_states)
        units = _unit_elements(classes[kind], forward, names, params, costs.param_states)
        split = analysed.analysis.weight_split[classes[kind].class_id]
        block_kind = classes[kind].kind
        result[kind] = BlockAnalysis(block_kind, costs.restrict(names), memory[kind], per_device, total, granularity,
                                     tp_optional=block_kind != "layer", units=units,
                                     borrowed=_borrowed_elements(forward, names, params, costs.param_states),
                                     apart=apart.get(classes[kind].class_id) if block_kind != "post" else None,
                                     loss=loss_shape(forward, names, symbols, costs.forward.states),
                                     weight_costs=costs.backward.restrict(set(split.names)), weight_stash=split.stash)
        sequence, tables = analysed.analysis.sequence, analysed.analysis.tensors or {}
        if kind == "layer":
            result[kind].tensors = tables.get("tp")
        if kind == "layer" and sequence is not None:
            result[kind].sequence = BlockAnalysis(block_kind, sequence.costs.restrict(names),
                                                  sequence.memory[classes[kind].class_id], per_device, total,
                                                  granularity, units=units, tensors=tables.get("sp"),
                                                  weight_costs=result[kind].weight_costs,
                                                  weight_stash=result[kind].weight_stash)
    if compiled:  # the eager layer, for the units a per-tensor policy keeps eager (cheap: the passes are cached)
        eager = analyse_program(program, compiled=False)[0]
        result["layer"].eager = eager["layer"]
        for kind, block in result.items():
            if block.sequence is not None and eager.get(kind) is not None and eager[kind].sequence is not None:
                block.sequence.costs = _with_collectives(block.sequence.costs, eager[kind].sequence.costs)
    return result, sum(1 for block in program.blocks if block.kind == "layer")
