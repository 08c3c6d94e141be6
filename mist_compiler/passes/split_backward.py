"""Backward split: mark the units whose backward runs as two halves (zero-bubble schedules).

A schedule that splits backward (``ir/schedule.py``: ``zb-h1``, ``zbv``) runs each unit's
input-gradient half when the previous stage waits for it and its weight-gradient half later.
This pass says which units are cut (``Unit.split_backward``); the lowering
(:mod:`mist_compiler.lowering.split_backward`) makes the two halves from each marked unit's joint
graph. A unit is cut when it has parameters (else it has no weight half) and calls no
tensor-parallel collective (those are autograd functions around a process group, which the joint
graph's fake-tensor trace cannot run): such a unit does its whole backward in the input half, and
the cost model prices it so (``cost/schedule.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..ir.model_graph import PARAMETER
from ..ir.stage import StageGraph, Unit
from .manager import PassResult


def can_split(unit: Unit) -> bool:
    """A unit whose backward the lowering can cut in two (see the module docstring)."""
    return not unit.needs_tp and any(kind == PARAMETER for kind, _ in unit.tensors.values())


@dataclass
class SplitBackward:
    """Mark every unit that can be split when ``enabled`` (the plan's schedule splits backward)."""

    enabled: bool
    name: str = "split_backward"
    input_type = output_type = StageGraph

    def __call__(self, stage: StageGraph) -> PassResult:
        if not self.enabled:
            return PassResult(stage, False)
        units = [replace(u, split_backward=can_split(u)) for u in stage.units]
        return PassResult(replace(stage, units=units), any(u.split_backward for u in units))
