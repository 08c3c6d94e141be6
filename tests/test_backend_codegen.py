"""Codegen: the lowering pipeline for one rank, and the IR dump after any of its passes."""
from __future__ import annotations

import json

import pytest

from mist_compiler.backends.codegen import dump_lowered, lowering_pass_names

PLAN = {"model": "llama-tiny", "seq_len": 16, "global_batch": 8, "dtype": "float32", "grad_accum": 2,
        "stages": [{"layers": [0, 2], "nodes": 1, "gpus_per_node": 2, "micro_batch": 4, "dp": 1, "tp": 2, "ckpt_layers": 1},
                   {"layers": [2, 4], "nodes": 1, "gpus_per_node": 2, "micro_batch": 2, "dp": 2, "tp": 1, "zero": 2,
                    "offload": {"weights": 0.5}}]}


@pytest.fixture()
def plan_path(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(PLAN))
    return str(path)


def test_dump_after_each_lowering_pass(plan_path):
    after_partition = dump_lowered("llama-tiny", plan_path, "partition")
    assert "# stage 0: layers [0, 2)" in after_partition and "# stage 1: layers [2, 4)" in after_partition
    assert "sends ['blocks_1']" in after_partition and "receives ['blocks_1'] + batch ['labels']" in after_partition
    assert "attn.q.weight[64, 64]" in after_partition
    after_tp = dump_lowered("llama-tiny", plan_path, "tp_sharding")
    assert "VocabParallelEmbedding weight[256, 64]" in after_tp and "attn.q.weight[32, 64]" in after_tp
    assert "attn.o.weight[64, 32]" in after_tp  # row-parallel: input features split
    after_ckpt = dump_lowered("llama-tiny", plan_path, "checkpoint")
    assert after_ckpt.count("checkpoint_block(") == 1
    after_offload = dump_lowered("llama-tiny", plan_path, "offload_insertion")
    assert "UnitOffload(weights=0.5" in after_offload


def test_unknown_pass_is_named(plan_path):
    assert lowering_pass_names() == ["partition", "tp_sharding", "checkpoint", "offload_insertion"]
    with pytest.raises(ValueError, match="unknown pass 'fusion'; lowering passes are: partition, tp_sharding"):
        dump_lowered("llama-tiny", plan_path, "fusion")
