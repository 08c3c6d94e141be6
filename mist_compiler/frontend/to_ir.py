"""Lowering: the partitioned joint graph -> a MistProgram (IR nodes, classes, saved tensors).

Saved-for-backward tensors are the forward graph's outputs after ``num_fwd_outputs``. Each is
charged to the block(s) whose backward reads it (a layer's input hidden state is charged to that
layer, as Megatron's formulas do) and deduplicated by *storage*: a saved view (``view``,
``transpose``, ``_unsafe_view``, ``t`` ...) keeps its base alive, so we count the base once,
whatever number of views of it are saved. This is what eager autograd really holds (TORCH-NOTES
section 8: e.g. the attention output and the o-projection's reshaped input are one storage).
Tensors of the attention op (q, k, v, its outputs) are left to the target-kernel model
(:func:`mist_compiler.ir.program.attention_saved_tensors`); weights saved for backward are kept
as ``kind="parameter"`` and not counted as activations.
"""
from __future__ import annotations

import operator
from dataclasses import replace

import torch
import torch.fx
from torch.fx.operator_schemas import normalize_function

from ..ir.capture_state import CaptureState
from ..ir.program import AttentionInfo, Block, BlockClass, IRNode, MistProgram, SavedTensor
from ..passes.block_discovery import POST, PRE, is_backward_node, layer_label, module_paths
from ..passes.manager import transforms
from ..passes.shape_prop import to_sympy

aten = torch.ops.aten

ATTENTION_FORWARD_OPS = {
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten.scaled_dot_product_attention.default,
}
ATTENTION_BACKWARD_OPS = {
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._scaled_dot_product_flash_attention_backward.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
    aten._scaled_dot_product_cudnn_attention_backward.default,
}

VIEW_OPS = {
    aten.view.default, aten._unsafe_view.default, aten.transpose.int, aten.t.default, aten.permute.default,
    aten.expand.default, aten.slice.Tensor, aten.select.int, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.squeeze.default, aten.detach.default, aten.alias.default, aten.as_strided.default,
    aten.unfold.default, aten.diagonal.default, aten.reshape.default, aten.view_as_real.default,
}
MULTI_VIEW_OPS = {aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.chunk.default}

# python-level ops on sizes (SymInt arithmetic) that may appear between ATen ops
SYMBOLIC_BUILTINS = {operator.getitem, operator.add, operator.sub, operator.mul, operator.floordiv,
                     operator.truediv, operator.mod, operator.neg, operator.pow, operator.eq, operator.ne,
                     operator.lt, operator.le, operator.gt, operator.ge}


class UnsupportedOpError(ValueError):
    """An op the Mist IR cannot represent; the message names it and the user's source line."""


def user_source(node: torch.fx.Node) -> str:
    trace = node.meta.get("stack_trace") or ""
    lines = [line.strip() for line in trace.strip().splitlines() if line.strip()]
    frames = [i for i, line in enumerate(lines) if line.startswith("File ")]
    if not frames:
        return "unknown source location"
    last = frames[-1]
    code = lines[last + 1] if last + 1 < len(lines) and not lines[last + 1].startswith("File ") else ""
    return f"{lines[last]}: {code}".rstrip(": ")


def check_representable(graph: torch.fx.Graph) -> None:
    for node in graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        target = node.target
        ok = node.op == "call_function" and (
            isinstance(target, torch._ops.OpOverload) or target in SYMBOLIC_BUILTINS
            or getattr(target, "__module__", "") in ("torch.fx.experimental.sym_node", "math")
            or target in (torch.sym_int, torch.sym_float, torch.sym_max, torch.sym_min, torch.sym_not)
        )
        if not ok:
            name = getattr(target, "__name__", None) or str(target)
            if isinstance(target, torch._ops.HigherOrderOperator):
                name = f"torch.ops.higher_order.{target.name()}"
            raise UnsupportedOpError(
                f"capture: op {name!r} ({node.op}) cannot be represented in the Mist IR "
                f"(only ATen ops are); it comes from {user_source(node)}"
            )


def ir_op_label(node: torch.fx.Node) -> str:
    """What an IR node prints as its op: the full ATen overload (``aten.mm.default``), attention ops
    by their role whatever kernel captured them (the cost passes name ops by ``cost_annotation.op_name``,
    the short ATen name)."""
    if node.target in ATTENTION_FORWARD_OPS:
        return "attention"
    if node.target in ATTENTION_BACKWARD_OPS:
        return "attention_backward"
    if node.target is operator.getitem:
        return "getitem"
    if isinstance(node.target, torch._ops.OpOverload):
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target))


def storage_base(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose storage ``node`` views (itself when it is not a view)."""
    while True:
        target = node.target
        if target in VIEW_OPS and node.args and isinstance(node.args[0], torch.fx.Node):
            node = node.args[0]
        elif target is operator.getitem and isinstance(node.args[0], torch.fx.Node) \
                and node.args[0].target in MULTI_VIEW_OPS:
            node = node.args[0].args[0]
        else:
            return node


def _attention_attrs(node: torch.fx.Node) -> dict:
    normalized = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
    kwargs = normalized.kwargs if normalized is not None else {}
    return {
        "captured_op": str(node.target),
        "is_causal": bool(kwargs.get("is_causal", False)),
        "dropout_p": float(kwargs.get("dropout_p", 0.0) or 0.0),
    }


def _argument(value):
    """An op argument as plain data: other values as ``%name``, sizes as sympy strings."""
    if isinstance(value, torch.fx.Node):
        return f"%{value.name}"
    if isinstance(value, (list, tuple)):
        return [_argument(v) for v in value]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return str(value)


def _ir_node(node: torch.fx.Node, shapes: dict, phase: str, symbol_map: dict) -> IRNode:
    if node.target in ATTENTION_FORWARD_OPS:
        attrs = _attention_attrs(node)
    elif node.target is operator.getitem:
        attrs = {"index": node.args[1]}
    else:
        attrs = {"args": _argument(list(node.args))}
        if node.kwargs:
            attrs["kwargs"] = {k: _argument(v) for k, v in node.kwargs.items()}
    value = node.meta.get("val")
    if isinstance(value, (torch.SymInt, int)) and not isinstance(value, bool):
        attrs["value"] = str(to_sympy(value, symbol_map))  # a size computed in the graph, e.g. b*s
    paths = module_paths(node)
    return IRNode(node.name, ir_op_label(node), [a.name for a in node.all_input_nodes], list(shapes.get(node.name, [])),
                  phase, attrs, paths[-1] if paths else "")


def _attention_info(node: torch.fx.Node, shapes: dict) -> AttentionInfo:
    q, k, v = (shapes[a.name][0] for a in node.args[:3])
    getitems = {u.args[1]: u for u in node.users if u.target is operator.getitem}
    out = shapes[getitems[0].name][0] if 0 in getitems else shapes[node.name][0]
    attrs = _attention_attrs(node)
    return AttentionInfo(node.name, attrs["captured_op"], q, k, v, out, attrs["is_causal"], attrs["dropout_p"])


def _attention_storages(nodes: list[torch.fx.Node]) -> set[str]:
    covered = set()
    for node in nodes:
        if node.target in ATTENTION_FORWARD_OPS:
            covered |= {storage_base(a).name for a in node.args[:3] if isinstance(a, torch.fx.Node)}
            covered.add(node.name)
            covered |= {u.name for u in node.users}
    return covered


def saved_by_block(joint, partition, shapes) -> dict[str, list[SavedTensor]]:
    """Block label -> saved tensors (deduplicated by storage) its backward reads."""
    by_name = {n.name: n for n in joint.joint_graph.graph.nodes}
    grouped: dict[tuple[str, str], list[str]] = {}
    for name in joint.saved_names:
        node = by_name.get(name)
        if node is None or not shapes.get(name):
            continue  # sizes (SymInts) saved for backward are not tensors
        readers = {partition.node_block[u.name] for u in node.users if is_backward_node(u) and u.name in partition.node_block}
        for block in readers or {partition.node_block.get(name, POST)}:
            grouped.setdefault((block, storage_base(node).name), []).append(name)
    result: dict[str, list[SavedTensor]] = {}
    for (block, base_name), names in grouped.items():
        base = by_name[base_name]
        if base.op == "placeholder":
            kind = "parameter" if base.name in joint.primal_params else "input"
        else:
            kind = "input" if partition.node_block.get(base.name) != block else "activation"
        result.setdefault(block, []).append(SavedTensor(
            base.name, ir_op_label(base) if base.op != "placeholder" else "placeholder", shapes[base.name][0], kind,
            tuple(n for n in names if n != base.name)))
    return result


def lower_block_class(class_id, kind, label, representative, joint, partition, shapes, saved) -> BlockClass:
    nodes = [n for n in joint.joint_graph.graph.nodes if partition.node_block.get(n.name) == label]
    forward = [n for n in nodes if n.op == "call_function" and not is_backward_node(n)]
    backward = [n for n in nodes if n.op == "call_function" and is_backward_node(n)]
    params = {joint.primal_params[n.name]: n for n in nodes if n.op == "placeholder" and n.name in joint.primal_params}
    prefix = representative + "." if representative else ""
    param_shapes = {path[len(prefix):] if path.startswith(prefix) else path: tuple(int(d) for d in shapes[n.name][0].shape)
                    for path, n in params.items()}
    param_dtypes = sorted({shapes[n.name][0].dtype for n in params.values()})
    covered = _attention_storages(forward)
    kept = [t for t in saved.get(label, []) if t.name not in covered]
    count = sum(int(shapes[n.name][0].numel()) for n in params.values())
    own = {n.name for n in forward + backward}
    external = {a.name: shapes[a.name][0] for n in forward + backward for a in n.all_input_nodes
                if a.name not in own and shapes.get(a.name)}
    # forward values the next blocks read: what a pipeline stage boundary sends
    sent = {n.name: shapes[n.name][0] for n in forward for u in n.users
            if shapes.get(n.name) and not is_backward_node(u) and u.op != "output"
            and partition.node_block.get(u.name, label) != label}
    sizes = {a.name: to_sympy(a.meta["val"], joint.symbol_map) for n in forward + backward for a in n.all_input_nodes
             if a.name not in own and isinstance(a.meta.get("val"), torch.SymInt)}
    return BlockClass(
        class_id, kind, partition.layer_hash.get(int(label[6:]), "") if kind == "layer" else kind,
        representative, count, param_shapes, param_dtypes[0] if param_dtypes else "float32",
        [_ir_node(n, shapes, "forward", joint.symbol_map) for n in forward],
        [_ir_node(n, shapes, "backward", joint.symbol_map) for n in backward],
        kept, [_attention_info(n, shapes) for n in forward if n.target in ATTENTION_FORWARD_OPS],
        {"joint": joint.joint_graph, "forward": joint.forward_graph, "backward": joint.backward_graph,
         "nodes": [n.name for n in nodes]},
        external, sizes, sent,
    )


@transforms(CaptureState)
def lower_to_ir(state: CaptureState) -> CaptureState:
    """Pass: build the MistProgram from the joint graph, its shapes and its block partition."""
    joint, partition, shapes = state.joint, state.partition, state.shapes
    check_representable(joint.joint_graph.graph)
    saved = saved_by_block(joint, partition, shapes)
    classes: dict[int, BlockClass] = {}
    pre = lower_block_class(0, PRE, PRE, "", joint, partition, shapes, saved)
    classes[0] = pre
    class_of_hash: dict[str, int] = {}
    layer_list = state.layer_list or partition.layer_prefix or ""
    # traced layer number -> the original layers it stands for (capture traces one per group)
    if state.layer_groups:
        originals = dict(enumerate(state.layer_groups))
    else:
        originals = {k: (k,) for k in partition.layer_indices}
    layer_blocks: list[Block] = []
    for traced in partition.layer_indices:
        digest = partition.layer_hash[traced]
        if digest not in class_of_hash:
            class_id = class_of_hash[digest] = len(classes)
            traced_path = f"{partition.layer_prefix}.{traced}" if partition.layer_prefix else str(traced)
            cls = lower_block_class(class_id, "layer", layer_label(traced), traced_path, joint, partition, shapes, saved)
            classes[class_id] = replace(cls, representative=f"{layer_list}.{originals[traced][0]}")
        cls = classes[class_of_hash[digest]]
        for index in originals[traced]:
            layer_blocks.append(Block(index, "layer", f"{layer_list}.{index}", cls.class_id, cls.param_count))
    post_id = len(classes)
    classes[post_id] = lower_block_class(post_id, POST, POST, "", joint, partition, shapes, saved)
    layer_blocks.sort(key=lambda block: block.index)
    count = len(layer_blocks)
    blocks = [Block(-1, PRE, "", 0, pre.param_count)] + layer_blocks + \
             [Block(count, POST, "", post_id, classes[post_id].param_count)]
    captured = sorted({a.captured_op for c in classes.values() for a in c.attention})
    program = MistProgram(state.model_name, blocks, classes, state.dtype, state.attention, state.seq_len,
                          ("b", "s"), dict(state.config or {}), tuple(captured), state.max_positions)
    return replace(state, program=program)
