"""block_discovery on small graphs built in the test (module stacks set by hand)."""
from __future__ import annotations

import torch
import torch.fx

from mist_compiler.passes.block_discovery import (
    assign_blocks, discover_blocks, find_layer_prefix, normalize_module_path,
)

aten = torch.ops.aten


def _stack(*paths: str) -> dict:
    return {f"key{i}": (path, "Module") for i, path in enumerate(paths)}


def _node(graph, name, target, args, *paths, seq_nr=None, backward=False):
    node = graph.create_node("call_function", target, args, name=name)
    node.meta["fwd_nn_module_stack" if backward else "nn_module_stack"] = _stack(*paths)
    node.meta["partitioner_tag"] = "is_backward" if backward else "is_forward"
    if seq_nr is not None:
        node.meta["seq_nr"] = seq_nr
    return node


def _param(graph, name, shape):
    node = graph.placeholder(name)
    node.meta["val"] = torch.empty(shape, device="meta")
    return node


def three_layer_graph(third_activation=aten.relu.default) -> torch.fx.Graph:
    """embed -> 3 x (fc, act, residual add) -> head sum, plus a few backward nodes."""
    graph = torch.fx.Graph()
    ids = graph.placeholder("ids")
    weights = [_param(graph, f"w{i}", (8, 8)) for i in range(3)]
    table = _param(graph, "table", (16, 8))
    x = _node(graph, "embedding", aten.embedding.default, (table, ids), "embed", seq_nr=0)
    for i, weight in enumerate(weights):
        act = third_activation if i == 2 else aten.relu.default
        fc = _node(graph, f"mm_{i}", aten.mm.default, (x, weight), f"blocks.{i}", f"blocks.{i}.fc", seq_nr=10 * i + 1)
        y = _node(graph, f"act_{i}", act, (fc,), f"blocks.{i}", seq_nr=10 * i + 2)
        x = _node(graph, f"add_{i}", aten.add.Tensor, (x, y), f"blocks.{i}", seq_nr=10 * i + 3)
    loss = _node(graph, "loss", aten.sum.default, (x,))  # no module stack: after the last layer -> post
    grad = _node(graph, "grad", aten.ones_like.default, (loss,), backward=True)  # no stack, no seq_nr -> previous
    grad_fc = _node(graph, "grad_fc", aten.mm.default, (grad, weights[1]), "blocks.1", "blocks.1.fc", backward=True)
    by_seq = _node(graph, "by_seq", aten.mul.Tensor, (grad_fc, grad_fc), seq_nr=2, backward=True)  # -> layer 0
    _node(graph, "grad_embed", aten.embedding_dense_backward.default, (by_seq, ids, 16, -1, False), "embed",
          backward=True)
    graph.output(loss)
    return graph


def test_normalize_module_path_spellings():
    assert normalize_module_path("L['self'].blocks[0].attn") == "blocks.0.attn"
    assert normalize_module_path("L['model']._modules['blocks']._modules['3']") == "blocks.3"
    assert normalize_module_path("model.layers.2.mlp") == "model.layers.2.mlp"
    assert normalize_module_path("L__self__") == "L__self__" and normalize_module_path("") == ""


def test_layer_prefix_is_the_most_repeated_numbered_parent():
    graph = three_layer_graph()
    assert find_layer_prefix(graph) == "blocks"
    nested = torch.fx.Graph()
    for index in range(2):  # two experts inside one layer, three layers: the layers win
        for layer in range(3):
            node = nested.call_function(aten.relu.default, (nested.placeholder(f"x{layer}{index}"),))
            node.meta["nn_module_stack"] = _stack(f"model.layers.{layer}", f"model.layers.{layer}.experts.{index}")
    assert find_layer_prefix(nested) == "model.layers"


def test_forward_backward_and_placeholders_land_in_their_blocks():
    partition = assign_blocks(three_layer_graph())
    blocks = partition.node_block
    assert partition.layer_indices == [0, 1, 2]
    assert blocks["embedding"] == "pre" and blocks["table"] == "pre" and blocks["ids"] == "pre"
    assert blocks["mm_0"] == "layer:0" and blocks["add_1"] == "layer:1" and blocks["w2"] == "layer:2"
    assert blocks["loss"] == "post"
    assert blocks["grad"] == "post"  # no stack, no seq_nr: follows the previous backward node
    assert blocks["grad_fc"] == "layer:1"  # its forward twin's module stack
    assert blocks["by_seq"] == "layer:0"  # by autograd seq_nr
    assert blocks["grad_embed"] == "pre"  # a non-layer module seen in forward as pre


def test_identical_layers_share_a_class_and_a_different_one_does_not():
    same = discover_blocks(three_layer_graph())
    assert len(set(same.layer_hash.values())) == 1
    assert list(same.classes().values()) == [[0, 1, 2]]
    different = discover_blocks(three_layer_graph(third_activation=aten.gelu.default))
    assert different.layer_hash[0] == different.layer_hash[1] != different.layer_hash[2]
    assert list(different.classes().values()) == [[0, 1], [2]]


def test_parameter_shapes_are_part_of_the_hash():
    graph = three_layer_graph()
    for node in graph.nodes:
        if node.name == "w2":
            node.meta["val"] = torch.empty((8, 9), device="meta")
    partition = discover_blocks(graph)
    assert partition.layer_hash[0] == partition.layer_hash[1] != partition.layer_hash[2]


def test_graph_without_layers_is_all_pre():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(aten.relu.default, (x,))
    graph.output(y)
    partition = discover_blocks(graph)
    assert partition.layer_prefix is None and partition.layer_indices == []
    assert set(partition.node_block.values()) == {"pre"}


def test_size_arithmetic_shared_between_layers_does_not_split_classes():
    """dynamo computes ``b*s`` once in the first layer and later layers reuse it."""
    graph = three_layer_graph()
    first_fc = next(n for n in graph.nodes if n.name == "mm_0")
    with graph.inserting_before(first_fc):
        size = _node(graph, "tokens", aten.sym_numel.default, (first_fc.args[0],), "blocks.0")
    size.meta["val"] = 24  # a size, not a tensor
    for node in graph.nodes:
        if node.name in ("mm_0", "mm_1", "mm_2"):
            node.kwargs = {"size_hint": size}
    partition = discover_blocks(graph)
    assert partition.node_block["tokens"] == "layer:0"
    assert len(set(partition.layer_hash.values())) == 1
