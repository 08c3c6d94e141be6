"""offload_insertion: stage offload ratios -> per-unit UnitOffload table (same fraction of every unit)."""
from __future__ import annotations

import pytest

from mist_compiler.backends.zero import UnitOffload
from mist_compiler.ir.plan import Offload
from mist_compiler.passes import PassManager
from mist_compiler.passes.offload_insertion import (OffloadInput, OffloadInsertionError, offload_insertion,
                                                    unit_offload_table)

UNITS = (("pre", 33_000), ("blocks.0", 50_000), ("blocks.1", 50_001), ("post", 0))


def test_every_unit_gets_the_stage_fraction_and_totals_match():
    offload = Offload(weights=0.25, grads=0.5, opt=1.0, acts=0.3)
    result = offload_insertion(OffloadInput(UNITS, offload))
    assert result.modified
    table = result.program
    assert table.per_unit["blocks.0"] == UnitOffload(weights=0.25, grads=0.5, opt=1.0, acts=0.3)
    assert table.per_unit["pre"] == table.per_unit["blocks.1"] == table.per_unit["blocks.0"]
    # a unit without parameters has nothing to offload but its activations
    assert table.per_unit["post"] == UnitOffload(acts=0.3)
    # offloaded weight elements: round(0.25 * size) per unit; the stage total is 0.25 of all within rounding
    assert table.offloaded_weight_elements == {"pre": 8250, "blocks.0": 12500, "blocks.1": 12500, "post": 0}
    total = sum(size for _, size in UNITS)
    assert abs(table.total_offloaded_weight_elements() - 0.25 * total) <= len(UNITS)


def test_no_offload_is_unmodified_and_runs_in_the_pass_manager():
    result = PassManager([offload_insertion])(OffloadInput(UNITS, Offload()))
    assert not result.modified
    assert all(entry == UnitOffload() for entry in result.program.per_unit.values())
    assert unit_offload_table(list(UNITS), Offload(weights=1.0))["blocks.1"].weights == 1.0


def test_input_is_not_modified():
    program = OffloadInput(UNITS, Offload(weights=0.5))
    offload_insertion(program)
    assert program.units == UNITS and program.offload == Offload(weights=0.5)


@pytest.mark.parametrize("units, offload, message", [
    ((), Offload(), "units must be a non-empty"),
    ((("a", 1), ("a", 2)), Offload(), "repeats the name 'a'"),
    ((("a", -1),), Offload(), r"units\[0\] must be"),
    ((("a", 1),), Offload(weights=1.5), "offload.weights must be in"),
])
def test_bad_input_names_the_field(units, offload, message):
    with pytest.raises(OffloadInsertionError, match=message):
        offload_insertion(OffloadInput(units, offload))
