"""Block discovery: cut an fx graph into pre / layer / post blocks and hash layers structurally.

Works on any fx graph whose nodes carry ``nn_module_stack`` (forward nodes: dynamo, export or
aot_autograd graphs) or ``fwd_nn_module_stack`` (backward nodes of an aot_autograd joint graph):

1. the layer list is the module-path prefix with the most distinct ``prefix.<int>`` children
   (``blocks``, ``model.layers``, ``transformer.h``);
2. every forward node goes to the layer in its module stack; other forward nodes go to ``pre``
   before the first layer, ``post`` after the last, and to the running layer in between;
   placeholders go to the block of their first user;
3. backward nodes follow their forward twin (module stack, else autograd ``seq_nr``, else the
   previous backward node);
4. each layer's forward op graph (op names, dtypes, parameter shapes) gets a Weisfeiler-Lehman
   hash (networkx); layers with the same hash form one class.
"""
from __future__ import annotations

import hashlib
import re
import warnings
from dataclasses import dataclass, field, replace

import networkx as nx
import torch.fx

from ..ir.capture_state import CaptureState
from .manager import transforms

PRE, POST = "pre", "post"

_DYNAMO_ROOT = re.compile(r"^L\[['\"]\w+['\"]\]\.?")
_INDEX = re.compile(r"\[(\d+)\]")
_KEYED = re.compile(r"\[['\"]([^'\"]+)['\"]\]")
_MODULES = re.compile(r"(^|\.)_(?:modules|parameters|buffers)\.")


def layer_label(index: int) -> str:
    return f"layer:{index}"


def normalize_module_path(path: str) -> str:
    """``L['self'].blocks[0].attn`` / ``L__self__blocks.0`` -> ``blocks.0.attn``."""
    path = _DYNAMO_ROOT.sub("", path)
    path = _INDEX.sub(r".\1", path)
    path = _KEYED.sub(r".\1", path)
    path = _MODULES.sub(r"\1", path)
    return path.strip(".")


def module_paths(node: torch.fx.Node) -> list[str]:
    """Module paths (outermost first) that issued ``node``; backward nodes use their forward twin's."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    paths = []
    for value in stack.values():
        raw = value[0] if isinstance(value, (tuple, list)) else str(value)
        paths.append(normalize_module_path(str(raw)))
    return [p for p in paths if p]


def is_backward_node(node: torch.fx.Node) -> bool:
    tag = node.meta.get("partitioner_tag")
    if tag is not None:
        return tag == "is_backward"
    return "nn_module_stack" not in node.meta and "fwd_nn_module_stack" in node.meta


def find_layer_prefix(graph: torch.fx.Graph) -> str | None:
    """The module-path prefix whose numbered children are the repeated layers (or None)."""
    children: dict[str, set[int]] = {}
    for node in graph.nodes:
        for path in module_paths(node):
            parts = path.split(".")
            for depth in range(1, len(parts)):
                if parts[depth].isdigit():
                    children.setdefault(".".join(parts[:depth]), set()).add(int(parts[depth]))
    if not children:
        return None
    return max(children, key=lambda prefix: (len(children[prefix]), -prefix.count("."), -len(prefix)))


def _layer_of(paths: list[str], prefix: str | None) -> int | None:
    if prefix is None:
        return None
    head = prefix + "."
    for path in paths:
        if path.startswith(head):
            index = path[len(head):].split(".")[0]
            if index.isdigit():
                return int(index)
    return None


@dataclass
class BlockPartition:
    """Which block every node belongs to, and the structural hash of every layer."""

    layer_prefix: str | None
    node_block: dict[str, str]  # node name -> "pre" | "post" | "layer:<i>"
    layer_indices: list[int]  # layer numbers present in the graph, in order
    layer_hash: dict[int, str] = field(default_factory=dict)

    def layer_path(self, index: int) -> str:
        return f"{self.layer_prefix}.{index}" if self.layer_prefix else str(index)

    def nodes_of(self, block: str) -> list[str]:
        return [name for name, b in self.node_block.items() if b == block]

    def classes(self) -> dict[str, list[int]]:
        """structural hash -> layer numbers, in first-seen order."""
        groups: dict[str, list[int]] = {}
        for index in self.layer_indices:
            groups.setdefault(self.layer_hash[index], []).append(index)
        return groups


def assign_blocks(graph: torch.fx.Graph) -> BlockPartition:
    prefix = find_layer_prefix(graph)
    nodes = list(graph.nodes)
    forward = [n for n in nodes if n.op not in ("placeholder", "output") and not is_backward_node(n)]
    backward = [n for n in nodes if n.op not in ("placeholder", "output") and is_backward_node(n)]
    node_block: dict[str, str] = {}
    layer_of_node = {n.name: _layer_of(module_paths(n), prefix) for n in forward}
    layer_positions = [i for i, n in enumerate(forward) if layer_of_node[n.name] is not None]
    first = layer_positions[0] if layer_positions else len(forward)
    last = layer_positions[-1] if layer_positions else len(forward)
    running: str = PRE
    layer_indices: list[int] = []
    for position, node in enumerate(forward):
        layer = layer_of_node[node.name]
        if layer is not None:
            running = layer_label(layer)
            if layer not in layer_indices:
                layer_indices.append(layer)
            node_block[node.name] = running
        elif position < first:
            node_block[node.name] = PRE
        elif position > last:
            node_block[node.name] = POST
        else:
            node_block[node.name] = running
    _assign_placeholders(nodes, node_block)
    _assign_backward(forward, backward, node_block, prefix)
    return BlockPartition(prefix, node_block, layer_indices)


def _assign_placeholders(nodes: list[torch.fx.Node], node_block: dict[str, str]) -> None:
    for node in nodes:
        if node.op != "placeholder":
            continue
        users = [u for u in node.users if u.name in node_block and not is_backward_node(u)]
        node_block[node.name] = node_block[users[0].name] if users else POST


def _assign_backward(forward, backward, node_block, prefix) -> None:
    block_of_module: dict[str, str] = {}
    block_of_seq: dict[int, str] = {}
    for node in forward:
        for path in module_paths(node):
            block_of_module.setdefault(path, node_block[node.name])
        if "seq_nr" in node.meta:
            block_of_seq.setdefault(node.meta["seq_nr"], node_block[node.name])
    previous = POST
    for node in backward:
        paths = module_paths(node)
        layer = _layer_of(paths, prefix)
        if layer is not None:
            block = layer_label(layer)
        elif paths and paths[-1] in block_of_module:
            block = block_of_module[paths[-1]]
        elif node.meta.get("seq_nr") in block_of_seq:
            block = block_of_seq[node.meta["seq_nr"]]
        else:
            block = previous
        node_block[node.name] = block
        previous = block


def _op_label(node: torch.fx.Node) -> str:
    value = node.meta.get("val", node.meta.get("example_value"))
    dtype = str(getattr(value, "dtype", "")).replace("torch.", "")
    if node.op == "placeholder":
        shape = getattr(value, "shape", None)
        static = shape is not None and all(isinstance(d, int) for d in shape)
        return f"param{tuple(shape)}:{dtype}" if static else f"input:{dtype}"
    if node.op == "get_attr":  # constants: named by position (_tensor_constant3), labelled by shape
        return f"constant{tuple(getattr(value, 'shape', ()))}:{dtype}"
    target = node.target
    name = getattr(target, "__qualname__", None) if callable(target) and not hasattr(target, "_schema") else str(target)
    return f"{node.op}:{name or target}:{dtype}"


def wl_hash(graph: nx.Graph, iterations: int = 3) -> str:
    """networkx's Weisfeiler-Lehman hash over the ``label`` node attribute (its version note silenced)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The hashes produced for directed graphs changed")
        return nx.weisfeiler_lehman_graph_hash(graph, node_attr="label", iterations=iterations)


def _is_size_value(node: torch.fx.Node) -> bool:
    value = node.meta.get("val", node.meta.get("example_value"))
    return isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))


def structural_hash(graph: torch.fx.Graph, members: set[str]) -> str:
    """Weisfeiler-Lehman hash of the op graph induced by ``members`` (external inputs collapsed).

    Size arithmetic (``b*s`` as a SymInt) is left out: dynamo computes it once and later layers
    reuse it, which would make the first layer look different.
    """
    digraph = nx.DiGraph()
    by_name = {n.name: n for n in graph.nodes}
    members = {name for name in members if not _is_size_value(by_name[name])}
    for name in members:
        digraph.add_node(name, label=_op_label(by_name[name]))
    for name in members:
        for argument in by_name[name].all_input_nodes:
            if argument.name not in members:
                digraph.add_node(f"external:{argument.name}", label="external")
                digraph.add_edge(f"external:{argument.name}", name)
            else:
                digraph.add_edge(argument.name, name)
    wl = wl_hash(digraph)
    params = sorted(_op_label(by_name[n]) for n in members if by_name[n].op == "placeholder")
    return hashlib.sha1((wl + "|" + ";".join(params)).encode()).hexdigest()[:16]


def discover_blocks(graph: torch.fx.Graph) -> BlockPartition:
    """Assign every node to a block and hash every layer's forward op graph."""
    partition = assign_blocks(graph)
    forward_members: dict[int, set[str]] = {i: set() for i in partition.layer_indices}
    by_name = {n.name: n for n in graph.nodes}
    for name, block in partition.node_block.items():
        if block.startswith("layer:") and not is_backward_node(by_name[name]):
            forward_members[int(block[6:])].add(name)
    hashes = {index: structural_hash(graph, members) for index, members in forward_members.items()}
    return replace(partition, layer_hash=hashes)


@transforms(CaptureState)
def block_discovery(state: CaptureState) -> CaptureState:
    """Pass: partition the captured joint graph into blocks (``state.joint.joint_graph``)."""
    return replace(state, partition=discover_blocks(state.joint.joint_graph.graph))
