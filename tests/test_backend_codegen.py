"""Codegen: the lowering pipeline for one rank, and the dump after any of its passes."""
from __future__ import annotations

import pytest

from mist_compiler.ir.plan import Plan
from mist_compiler.lowering.lower import LOWERING_PASSES, dump_lowered

PLAN = Plan.from_dict({
    "model": "llama-tiny", "seq_len": 16, "global_batch": 8, "dtype": "float32", "grad_accum": 2,
    "stages": [{"layers": [0, 2], "nodes": 1, "gpus_per_node": 2, "micro_batch": 4, "dp": 1, "tp": 2, "ckpt_layers": 1},
               {"layers": [2, 4], "nodes": 1, "gpus_per_node": 2, "micro_batch": 2, "dp": 2, "tp": 1, "zero": 2,
                "offload": {"weights": 0.5}}]})


def test_dump_after_each_lowering_pass(llama_tiny_program):
    after_partition = dump_lowered(llama_tiny_program, PLAN, "partition")
    assert "# stage 0: layers [0, 2)" in after_partition and "# stage 1: layers [2, 4)" in after_partition
    assert "sends ['hidden']" in after_partition and "receives ['hidden'] + batch ['input_ids', 'labels']" in after_partition
    after_tp = dump_lowered(llama_tiny_program, PLAN, "tp_sharding")
    assert "tp.copy" in after_tp and "tp.reduce" in after_tp and "tp.embedding" in after_tp
    assert "split {" in after_tp and "'attn.q.weight': (0, ())" in after_tp and "'attn.o.weight': (1, ())" in after_tp
    after_ckpt = dump_lowered(llama_tiny_program, PLAN, "checkpoint")
    assert after_ckpt.count("checkpoint_block(") == 1 and "checkpointed" in after_ckpt
    after_offload = dump_lowered(llama_tiny_program, PLAN, "offload_insertion")
    assert "Offload(weights=0.5" in after_offload


def test_unknown_pass_is_named(llama_tiny_program):
    assert LOWERING_PASSES == ("partition", "tp_sharding", "sequence_parallel", "loss_kernel", "checkpoint",
                               "activation_policy", "offload_insertion", "split_backward")
    with pytest.raises(ValueError, match="unknown pass 'fusion'; lowering passes are: partition, tp_sharding"):
        dump_lowered(llama_tiny_program, PLAN, "fusion")
