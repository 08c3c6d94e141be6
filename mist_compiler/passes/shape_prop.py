"""Symbolic shape propagation: every fx node's outputs as TensorInfo in the IR symbols (b, s).

Shapes come from PyTorch's own symbolic shapes (FakeTensor + ShapeEnv, sympy): no shape rule is
written per op here. A graph that already carries ``meta["val"]`` (dynamo / aot_autograd
graphs) is only translated: its ShapeEnv symbols (``s72``...) are renamed to the IR symbols.
A bare graph (built by hand, in tests) is first run through ``FakeTensorProp`` with symbolic
fake inputs made from ``input_specs``, whose named dimensions become the symbols.
"""
from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any, Mapping, Sequence

import sympy
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from ..ir.capture_state import CaptureState
from ..ir.program import SYMBOLS, TensorInfo
from .manager import transforms

# distinct example sizes (>= 2, unlikely to collide with model dimensions) for named dimensions
_EXAMPLE_SIZES = (3, 5, 7, 11, 13, 17, 19, 23)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def to_sympy(value: Any, symbol_map: Mapping[sympy.Symbol, sympy.Expr]) -> sympy.Expr:
    """A SymInt / int / sympy expression in ShapeEnv symbols -> sympy in the IR symbols."""
    if isinstance(value, torch.SymInt):
        value = value.node.expr
    expr = sympy.sympify(value)
    return expr.xreplace(dict(symbol_map)) if symbol_map else expr


def tensor_info(value: Any, symbol_map: Mapping[sympy.Symbol, sympy.Expr]) -> TensorInfo | None:
    if not isinstance(value, torch.Tensor):
        return None
    return TensorInfo(tuple(to_sympy(d, symbol_map) for d in value.shape), dtype_name(value.dtype))


def node_outputs(node: torch.fx.Node, symbol_map: Mapping) -> list[TensorInfo]:
    value = node.meta.get("val", node.meta.get("example_value"))
    values = value if isinstance(value, (tuple, list)) else [value]
    return [info for info in (tensor_info(v, symbol_map) for v in values) if info is not None]


def symbolic_fake_inputs(
    input_specs: Sequence[tuple[Sequence[str | int], torch.dtype]],
    fake_mode: FakeTensorMode | None = None,
) -> tuple[list[torch.Tensor], dict[sympy.Symbol, sympy.Expr], FakeTensorMode]:
    """Fake tensors whose named dimensions (``"b"``, ``"s"``...) are symbolic.

    Returns the tensors, the map ShapeEnv symbol -> IR symbol, and the fake mode.
    """
    fake_mode = fake_mode or FakeTensorMode(shape_env=ShapeEnv())
    names = sorted({d for shape, _ in input_specs for d in shape if isinstance(d, str)})
    if len(names) > len(_EXAMPLE_SIZES):
        raise ValueError(f"input_specs: at most {len(_EXAMPLE_SIZES)} named dimensions, got {names}")
    example = dict(zip(names, _EXAMPLE_SIZES))
    tensors, symbol_map = [], {}
    for shape, dtype in input_specs:
        sizes = [example[d] if isinstance(d, str) else int(d) for d in shape]
        dynamic = [DimDynamic.DYNAMIC if isinstance(d, str) else DimDynamic.STATIC for d in shape]
        fake = fake_mode.from_tensor(torch.empty(sizes, dtype=dtype),
                                     symbolic_context=StatelessSymbolicContext(dynamic_sizes=dynamic))
        for dim, size in zip(shape, fake.shape):
            if isinstance(dim, str) and isinstance(size, torch.SymInt):
                symbol_map[size.node.expr] = SYMBOLS.get(dim) or sympy.Symbol(dim, positive=True, integer=True)
        tensors.append(fake)
    return tensors, symbol_map, fake_mode


def propagate_symbolic_shapes(
    gm: torch.fx.GraphModule,
    symbol_map: Mapping[sympy.Symbol, sympy.Expr] | None = None,
    input_specs: Sequence[tuple[Sequence[str | int], torch.dtype]] | None = None,
) -> dict[str, list[TensorInfo]]:
    """Node name -> output TensorInfos with shapes in the IR symbols.

    With ``input_specs`` (one ``(shape, dtype)`` per placeholder) the graph is first executed on
    symbolic fake inputs; otherwise its existing ``meta["val"]`` is used.
    """
    symbol_map = dict(symbol_map or {})
    if input_specs is not None:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(input_specs):
            raise ValueError(f"input_specs: graph has {len(placeholders)} placeholders, got {len(input_specs)} specs")
        fakes, made, fake_mode = symbolic_fake_inputs(input_specs)
        symbol_map.update(made)
        gm = copy.deepcopy(gm)  # FakeTensorProp writes meta["val"]: keep the caller's graph untouched
        FakeTensorProp(gm, fake_mode).propagate_dont_convert_inputs(*fakes)
    missing = [n.name for n in gm.graph.nodes if n.op == "call_function" and "val" not in n.meta and "example_value" not in n.meta]
    if missing:
        raise ValueError(f"shape_prop: nodes {missing[:5]} have no meta['val']; pass input_specs to propagate")
    return {n.name: node_outputs(n, symbol_map) for n in gm.graph.nodes if n.op != "output"}


@transforms(CaptureState)
def shape_prop(state: CaptureState) -> CaptureState:
    """Pass: symbolic shapes of every node of the captured joint graph (``state.shapes``)."""
    shapes = propagate_symbolic_shapes(state.joint.joint_graph, state.joint.symbol_map)
    return replace(state, shapes=shapes)
