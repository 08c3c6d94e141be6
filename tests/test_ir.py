"""The Mist IR: JSON round trip, attention kernel models, printer, errors."""
from __future__ import annotations

import json

import pytest
import sympy

from mist_compiler.frontend.to_ir import ATTENTION_BACKWARD_OPS, ATTENTION_FORWARD_OPS
from mist_compiler.ir import MistProgram, TensorInfo
from mist_compiler.ir.printer import format_program
from mist_compiler.ir.program import AttentionInfo, B, IRError, S, attention_saved_tensors, parse_expr


def test_json_round_trip_keeps_everything(gpt_tiny_program):
    program = gpt_tiny_program
    text = json.dumps(program.to_json())
    again = MistProgram.from_json(text)
    assert again.to_json() == program.to_json()
    assert again.params == program.params
    for class_id in program.block_classes:
        for kernel in ("flash", "math"):
            assert sympy.simplify(again.saved_bytes_expr(class_id, kernel) - program.saved_bytes_expr(class_id, kernel)) == 0
    layer = next(c for c in again.block_classes.values() if c.kind == "layer")
    node = layer.forward_nodes[3]
    assert all(isinstance(d, sympy.Expr) for out in node.outputs for d in out.shape)
    assert layer.graphs == {}  # live torch graphs are not serialised
    assert next(c for c in program.block_classes.values() if c.kind == "layer").graphs["joint"] is not None


def test_tensor_info_bytes_and_parse():
    info = TensorInfo((B, S, sympy.Integer(64)), "bfloat16")
    assert info.nbytes() == 128 * B * S
    assert TensorInfo.from_json(info.to_json()) == info
    assert parse_expr("b*s + 3") == B * S + 3 and parse_expr(7) == 7
    with pytest.raises(IRError, match="cannot parse"):
        parse_expr("b**")
    with pytest.raises(IRError, match="no known element size"):
        TensorInfo((B,), "float7").nbytes()


def test_attention_kernel_models():
    q = TensorInfo((B, sympy.Integer(8), S, sympy.Integer(64)), "float16")
    attn = AttentionInfo("sdpa", "aten.scaled_dot_product_attention.default", q, q, q, q)
    flash = dict(attention_saved_tensors(attn, "flash"))
    math = dict(attention_saved_tensors(attn, "math"))
    assert flash["logsumexp"] == TensorInfo((B, 8, S), "float32")
    assert "probs" not in flash and "logsumexp" not in math
    assert math["probs"].shape == (B, 8, S, S)
    dropped = AttentionInfo("sdpa", "x", q, q, q, q, dropout_p=0.1)
    assert "dropped_probs" in dict(attention_saved_tensors(dropped, "math"))
    with pytest.raises(IRError, match="attention kernel 'paged' is unknown"):
        attention_saved_tensors(attn, "paged")


def test_every_sdpa_kernel_maps_to_the_attention_op():
    names = {str(op) for op in ATTENTION_FORWARD_OPS}
    assert names == {
        "aten._scaled_dot_product_flash_attention_for_cpu.default", "aten._scaled_dot_product_flash_attention.default",
        "aten._scaled_dot_product_efficient_attention.default", "aten._scaled_dot_product_cudnn_attention.default",
        "aten.scaled_dot_product_attention.default",
    }
    assert len(ATTENTION_BACKWARD_OPS) == 4


def test_bad_json_names_the_field(gpt_tiny_program):
    with pytest.raises(IRError, match="'format' must be 'mist-ir/1'"):
        MistProgram.from_json({"blocks": []})
    data = gpt_tiny_program.to_json()
    del data["blocks"]
    with pytest.raises(IRError, match="missing field 'blocks'"):
        MistProgram.from_json(data)
    with pytest.raises(IRError, match="not valid JSON"):
        MistProgram.from_json("{oops")
    with pytest.raises(IRError, match="block class 9 does not exist"):
        gpt_tiny_program.saved_bytes_expr(9)


def test_printer_shows_blocks_classes_and_nodes(gpt_tiny_program):
    text = format_program(gpt_tiny_program)
    assert "4 layers in 3 block classes" in text
    assert "layers 0-3" in text
    assert "= attention(" in text and "# blocks.0.attn" in text
    assert "b*s" in text
