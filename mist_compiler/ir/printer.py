"""Human-readable text form of a MistProgram (what ``mistc ir`` prints)."""
from __future__ import annotations

from .program import BlockClass, IRNode, MistProgram


def _format_argument(value) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_format_argument(v) for v in value) + "]"
    return str(value)


def _format_node(node: IRNode) -> str:
    outputs = ", ".join(str(o) for o in node.outputs) or "-"
    if "args" in node.attrs:
        arguments = [_format_argument(a) for a in node.attrs["args"]]
        arguments += [f"{k}={_format_argument(v)}" for k, v in node.attrs.get("kwargs", {}).items()]
    else:
        arguments = ["%" + i for i in node.inputs]
    rest = {k: v for k, v in node.attrs.items() if k not in ("args", "kwargs")}
    attrs = "" if not rest else " {" + ", ".join(f"{k}={v}" for k, v in rest.items()) + "}"
    source = f"  # {node.source}" if node.source else ""
    return f"    %{node.name}: {outputs} = {node.op}({', '.join(arguments)}){attrs}{source}"


def _ranges(indices: list[int]) -> str:
    spans, start = [], None
    for i, index in enumerate(indices):
        if start is None:
            start = index
        if i + 1 == len(indices) or indices[i + 1] != index + 1:
            spans.append(f"{start}" if start == index else f"{start}-{index}")
            start = None
    return ",".join(spans)


def format_block_class(program: MistProgram, cls: BlockClass, nodes: bool = True) -> str:
    members = [b.index for b in program.blocks if b.class_id == cls.class_id]
    where = f"layers {_ranges(members)}" if cls.kind == "layer" else cls.kind
    lines = [
        f"class {cls.class_id} ({cls.kind}, hash {cls.structural_hash}): {where}; representative {cls.representative or '-'}",
        f"  params: {cls.param_count:,} ({cls.param_dtype}), {len(cls.forward_nodes)} forward / "
        f"{len(cls.backward_nodes)} backward ops",
        f"  saved for backward (attention={program.attention}): {cls.saved_bytes_expr(program.attention)} bytes",
    ]
    if cls.outputs:
        lines.append("  sends to the next block: " + ", ".join(f"%{k}: {v}" for k, v in cls.outputs.items()))
    for name, info in cls.saved_tensors(program.attention):
        lines.append(f"    saved %{name}: {info}")
    for attn in cls.attention:
        lines.append(f"  attention %{attn.node}: q {attn.query}, k {attn.key}, causal={attn.is_causal}, "
                     f"captured as {attn.captured_op}")
    if nodes:
        if cls.sizes:
            lines.append("  sizes: " + ", ".join(f"%{k} = {v}" for k, v in cls.sizes.items()))
        lines.append("  forward:")
        lines += [_format_node(n) for n in cls.forward_nodes]
        lines.append("  backward:")
        lines += [_format_node(n) for n in cls.backward_nodes]
    return "\n".join(lines)


def format_program(program: MistProgram, nodes: bool = True) -> str:
    layers = program.layers
    lines = [
        f"mist program {program.model_name}: dtype {program.dtype}, symbols {', '.join(program.symbols)} "
        f"(default s={program.seq_len}), attention kernel {program.attention}",
        f"  {program.params:,} parameters; {len(layers)} layers in {len(program.block_classes)} block classes "
        f"(pre, {len(program.block_classes) - 2} layer class(es), post)",
        "blocks:",
    ]
    for block in program.blocks:
        lines.append(f"  [{block.index:>3}] {block.kind:<5} {block.module_path or '-':<20} class {block.class_id}  "
                     f"{block.param_count:,} params")
    lines += format_tensor_parallel(program)
    for cls in program.block_classes.values():
        lines.append("")
        lines.append(format_block_class(program, cls, nodes))
    return "\n".join(lines)


def format_tensor_parallel(program: MistProgram) -> list[str]:
    """How the recogniser splits the model: the degrees it allows, or why none, and the linears it
    keeps whole (replicated on every tensor-parallel rank) with the reason."""
    graph = program.model_graph
    plan = graph.tp if graph is not None else None
    if plan is None:
        return []
    if not plan.supported:
        return [f"tensor parallelism: not possible: {plan.reason}"]
    lines = [f"tensor parallelism: tp must divide {plan.granularity} (heads, key/value heads, split features)"]
    names = {p: name for p, (_, name) in graph.tensors.items()}
    for region in graph.regions:
        for placeholder, why in plan.regions.get(region.label, None).replicated.items() if region.label in plan.regions \
                else ():
            where = f"{graph.layer_list}.{region.layers[0]}.{region.params.get(placeholder, names.get(placeholder, placeholder))}"
            lines.append(f"  kept whole on every rank: {where} ({why.split(': ', 1)[-1]})")
    return lines
