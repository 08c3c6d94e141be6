"""Cost annotation pass: FLOPs against closed forms, tensor-parallel sharding and its collectives."""
from __future__ import annotations

import functools

import sympy
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from mist_compiler.cost.analysis import analyse_program
from mist_compiler.frontend.capture import capture
from mist_compiler.models import zoo_config
from mist_compiler.passes.cost_annotation import B, S, T, cost_annotation, propagate_costs

SEQ = 128


@functools.lru_cache(maxsize=4)
def captured(name: str):
    return capture(name, seq_len=SEQ, dtype="float32")


def analysed(name: str):
    return analyse_program(captured(name))[0]


def same(a, b) -> bool:
    return sympy.simplify(sympy.expand(a - b)) == 0


def test_gpt_layer_flops_match_megatron_closed_form():
    cfg = zoo_config("gpt-tiny")
    h, f = cfg.hidden, cfg.ffn
    layer = analysed("gpt-tiny")["layer"]
    matmul = 2 * B * S * (4 * h * h + 2 * h * f)
    attention = 4 * B * S * S * h  # full s^2, the MFU convention (causal masking not halved)
    forward = layer.costs.forward.total_flops
    assert same(forward, (matmul + attention) / T)
    assert same(forward.subs(T, 1), 24 * B * S * h**2 + 4 * B * S**2 * h)  # f = 4h: Megatron's per-layer count
    # backward: matmuls twice the forward, attention 2.5x (flash backward recomputes the scores)
    assert same(layer.costs.backward.total_flops, (2 * matmul + sympy.Rational(5, 2) * attention) / T)
    by_class = layer.costs.forward.flops_by_class()
    assert same(by_class["attention"], attention / T)
    assert same(by_class["matmul"], matmul / T)


def test_llama_layer_flops_grouped_query_and_swiglu():
    cfg = zoo_config("llama-tiny")
    h, f, kv = cfg.hidden, cfg.ffn, cfg.num_kv_heads * cfg.head_dim
    layer = analysed("llama-tiny")["layer"]
    expected = 2 * B * S * (2 * h * h + 2 * h * kv + 3 * h * f) + 4 * B * S * S * h
    assert same(layer.costs.forward.total_flops, expected / T)


def test_gpt_sharding_columns_rows_and_collectives():
    cfg = zoo_config("gpt-tiny")
    h, f = cfg.hidden, cfg.ffn
    blocks = analysed("gpt-tiny")
    layer = blocks["layer"]
    sharding = layer.costs.sharding
    assert sharding.supported, sharding.message
    assert len([p for p in sharding.sharded_params]) >= 6  # the recogniser's q, k, v, up | o, down (+ head, embedding)
    # parameters per device: two LayerNorm weights replicated, every linear split by t
    assert same(layer.params_per_device, 2 * h + (4 * h * h + 2 * h * f) / T)
    hidden_bytes = 4 * B * S * h
    forward = layer.costs.forward.collectives
    backward = layer.costs.backward.collectives
    assert [c.kind for c in forward] == ["all_reduce"] * 2  # after o and after down
    assert all(same(c.bytes, hidden_bytes) for c in forward + backward)
    assert len(backward) == 2  # column-parallel input gradients: q+k+v summed first, then up


def test_vocab_parallel_embedding_head_and_cross_entropy():
    cfg = zoo_config("gpt-tiny")
    h, vocab = cfg.hidden, cfg.vocab
    blocks = analysed("gpt-tiny")
    pre, post = blocks["pre"], blocks["post"]
    assert pre.tp_optional and post.tp_optional  # split only when t divides the vocabulary
    assert same(pre.params_per_device, cfg.max_seq * h + vocab * h / T)  # positions replicated, tokens split
    [embedding_reduce] = pre.costs.forward.collectives
    assert same(embedding_reduce.bytes, 4 * B * S * h)
    assert same(post.costs.forward.flops_by_class()["matmul"], 2 * B * S * h * vocab / T)
    reductions = sorted(str(c.bytes) for c in post.costs.forward.collectives)
    assert reductions == sorted([str(8 * B * S), str(4 * B * S)])  # max + sum-exp, target logit
    [head_input_grad] = post.costs.backward.collectives
    assert same(head_input_grad.bytes, 4 * B * S * h)


def test_llama_sharding_recognised():
    layer = analysed("llama-tiny")["layer"]
    assert layer.costs.sharding.supported, layer.costs.sharding.message
    assert layer.costs.sharding.supported  # q k v gate up | o down, split as the recogniser decided


def _trace(function, *shapes):
    return make_fx(function, tracing_mode="symbolic")(*(torch.randn(*shape) for shape in shapes))


def test_mlp_pair_on_a_small_graph():
    """Seeded as the recogniser splits an MLP (up by rows, down by columns), the propagation finds
    the row-parallel output partial and all-reduces it, and divides the FLOPs by t."""
    graph = _trace(lambda x, w1, w2: F.gelu(x @ w1.t()) @ w2.t(), (4, 8), (16, 8), (8, 16))
    costs = propagate_costs(graph.graph, {"w1_1": "S", "w2_1": "S"}, None, "forward")
    assert costs.states["mm"] == "S" and [c.after for c in costs.collectives] == ["mm_1"]  # partial output reduced
    flops = costs.nodes[[c.name for c in costs.nodes].index("mm")].flops
    assert flops.free_symbols and T in flops.free_symbols  # symbolic sizes, divided by t


def test_a_split_value_reaching_a_norm_marks_pricing_and_plan_inconsistent():
    from mist_compiler.passes.cost_annotation import Sharding, annotate_graphs

    graph = _trace(lambda x, w1, w2: F.layer_norm(x @ w1.t(), (16,)) @ w2.t(), (4, 8), (16, 8), (8, 16))
    empty = _trace(lambda x: x * 2, (4, 8))
    costs = annotate_graphs(graph, empty, {"w1_1", "w2_1"}, sharding=Sharding({"w1_1", "w2_1"}, True, ""))
    assert not costs.sharding.supported and "disagrees with the tensor-parallel plan" in costs.sharding.message


def test_pass_writes_costs_and_collectives_into_the_ir():
    cfg = zoo_config("gpt-tiny")
    h, f = cfg.hidden, cfg.ffn
    program = captured("gpt-tiny")
    result = cost_annotation(program)
    layer = next(c for c in result.program.block_classes.values() if c.kind == "layer")
    original = next(c for c in program.block_classes.values() if c.kind == "layer")
    assert all("flops" not in n.attrs for n in original.forward_nodes)  # the input program is untouched
    flops = sum((sympy.sympify(n.attrs.get("flops", 0)) for n in layer.forward_nodes), sympy.Integer(0))
    assert same(flops, (2 * B * S * (4 * h * h + 2 * h * f) + 4 * B * S * S * h) / T)
    nodes = [n for c in result.program.block_classes.values() for n in c.forward_nodes + c.backward_nodes]
    hidden = [n for n in nodes if n.op == "all_reduce" and same(n.attrs["bytes"], 4 * B * S * h)]
    # embedding; o, down; q+k+v and up input gradients; head input gradient
    assert len(hidden) == 6
    assert sum(n.op == "all_reduce" for n in layer.forward_nodes) == 2
    assert result.program.tensor_parallel["supported"]
