"""offload_insertion: stage offload ratios -> every unit's offload fractions (the same for every unit)."""
from __future__ import annotations

import pytest

from mist_compiler.ir.plan import Offload, Plan, PlanError
from mist_compiler.ir.stage import split_boundary
from mist_compiler.passes import PassManager
from mist_compiler.passes.offload_insertion import OffloadInsertion, unit_offload, unit_offload_table
from mist_compiler.passes.partition import Partition

UNITS = [("pre", 33_000), ("blocks.0", 50_000), ("blocks.1", 50_001), ("post", 0)]
PLAN = Plan.from_dict({"model": "gpt-tiny", "seq_len": 8, "global_batch": 2, "dtype": "float32", "grad_accum": 1,
                       "stages": [{"layers": [0, 4], "nodes": 1, "gpus_per_node": 1, "micro_batch": 2, "dp": 1,
                                   "tp": 1}]})


def test_every_unit_gets_the_stage_fraction_and_totals_match():
    offload = Offload(weights=0.25, grads=0.5, opt=1.0, acts=0.3)
    table = unit_offload_table(UNITS, offload)
    assert table["blocks.0"] == Offload(weights=0.25, grads=0.5, opt=1.0, acts=0.3)
    assert table["pre"] == table["blocks.1"] == table["blocks.0"]
    assert table["post"] == Offload(acts=0.3)  # no parameters: only its activations
    # the runtime rounds each unit's share to whole elements; the stage total stays 0.25 within rounding
    offloaded = sum(size - split_boundary(size, table[name].weights) for name, size in UNITS)
    assert abs(offloaded - 0.25 * sum(size for _, size in UNITS)) <= len(UNITS)


def test_pass_sets_every_unit_of_a_stage_and_is_pure(gpt_tiny_program):
    stage = Partition(PLAN, 0)(gpt_tiny_program.model_graph).program
    result = PassManager([OffloadInsertion(Offload(weights=0.5, acts=0.25))])(stage)
    assert result.modified
    assert all(u.offload == Offload(weights=0.5, acts=0.25) for u in result.program.units)
    assert all(u.offload == Offload() for u in stage.units)  # the input is untouched
    assert not OffloadInsertion(Offload())(stage).modified


def test_bad_fraction_names_the_field():
    with pytest.raises(PlanError, match=r"offload.weights: must be in \[0, 1\], got 1.5"):
        unit_offload(True, Offload(weights=1.5))
