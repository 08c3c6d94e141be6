"""shape_prop on ten-node graphs built in the test: shapes come out as sympy in the named symbols."""
from __future__ import annotations

import operator

import pytest
import sympy
import torch
import torch.fx

from mist_compiler.ir.program import B, S, TensorInfo
from mist_compiler.passes.shape_prop import propagate_symbolic_shapes, symbolic_fake_inputs, to_sympy

aten = torch.ops.aten
HIDDEN, FFN = 8, 32


def mlp_graph() -> torch.fx.GraphModule:
    """x[b,s,h] -> view -> mm(w_up) -> gelu -> mm(w_down) -> view -> add(x) -> sum : ten nodes."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    w_up = graph.placeholder("w_up")
    w_down = graph.placeholder("w_down")
    flat = graph.call_function(aten.view.default, (x, [-1, HIDDEN]))
    up = graph.call_function(aten.mm.default, (flat, w_up))
    act = graph.call_function(aten.gelu.default, (up,))
    down = graph.call_function(aten.mm.default, (act, w_down))
    size_b = graph.call_function(aten.sym_size.int, (x, 0))
    size_s = graph.call_function(aten.sym_size.int, (x, 1))
    back = graph.call_function(aten.view.default, (down, [size_b, size_s, HIDDEN]))
    out = graph.call_function(aten.add.Tensor, (back, x))
    total = graph.call_function(aten.sum.default, (out,))
    graph.output(total)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


SPECS = [(("b", "s", HIDDEN), torch.float16), ((HIDDEN, FFN), torch.float16), ((FFN, HIDDEN), torch.float16)]


def test_shapes_are_sympy_in_named_symbols():
    gm = mlp_graph()
    shapes = propagate_symbolic_shapes(gm, input_specs=SPECS)
    assert all("val" not in n.meta for n in gm.graph.nodes)  # the pass does not annotate its input
    assert shapes["x"] == [TensorInfo((B, S, sympy.Integer(HIDDEN)), "float16")]
    assert shapes["mm_default"][0].shape == (B * S, FFN)
    assert shapes["gelu_default"][0].dtype == "float16"
    assert shapes["view_default_1"][0].shape == (B, S, HIDDEN)
    assert shapes["sum_default"][0].shape == ()
    assert shapes["gelu_default"][0].nbytes() == 2 * FFN * B * S
    assert shapes["sym_size_int"] == []  # sizes are not tensors


def test_existing_meta_is_translated_without_rerunning():
    gm = mlp_graph()
    fakes, symbol_map, fake_mode = symbolic_fake_inputs(SPECS)
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    FakeTensorProp(gm, fake_mode).propagate_dont_convert_inputs(*fakes)
    raw = propagate_symbolic_shapes(gm)  # no symbol map: ShapeEnv names (s0, s1 ...)
    assert {str(sym) for sym in sympy.sympify(raw["mm_default"][0].shape[0]).free_symbols}.isdisjoint({"b", "s"})
    renamed = propagate_symbolic_shapes(gm, symbol_map)
    assert renamed["mm_default"][0].shape == (B * S, FFN)


def test_same_name_is_one_symbol_across_inputs():
    fakes, symbol_map, _ = symbolic_fake_inputs([(("b", "s"), torch.int64), (("b", "s"), torch.int64)])
    assert to_sympy(fakes[0].shape[0], symbol_map) == B
    assert to_sympy(fakes[1].shape[1], symbol_map) == S


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="have no meta\\['val'\\]"):
        propagate_symbolic_shapes(mlp_graph())
    with pytest.raises(ValueError, match="3 placeholders, got 1 specs"):
        propagate_symbolic_shapes(mlp_graph(), input_specs=SPECS[:1])


def test_python_size_arithmetic_stays_symbolic():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    size_b = graph.call_function(aten.sym_size.int, (x, 0))
    size_s = graph.call_function(aten.sym_size.int, (x, 1))
    tokens = graph.call_function(operator.mul, (size_b, size_s))
    flat = graph.call_function(aten.view.default, (x, [tokens, HIDDEN]))
    graph.output(flat)
    shapes = propagate_symbolic_shapes(torch.fx.GraphModule(torch.nn.Module(), graph),
                                       input_specs=[(("b", "s", HIDDEN), torch.float32)])
    assert shapes["view_default"][0].shape == (B * S, HIDDEN)
