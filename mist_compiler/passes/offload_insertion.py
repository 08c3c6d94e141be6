"""Offload insertion: map a stage's offload ratios onto its units (``Unit.offload``).

The plan gives one ratio per state kind per stage (``Offload``: weights, grads, opt, acts). This
pass decides, for each unit of the stage (pre part, layers, post part, in execution order),
which fraction of that unit's bytes of each kind lives in host memory.

Mapping rule: the *same* fraction of every unit's bytes, so the stage's offloaded bytes equal
``ratio`` times its total up to rounding, every unit needs the same host<->device traffic
relative to its size, and the one-unit-ahead prefetch sees a steady copy load (no unit with all
of its weights to fetch). The runtime rounds the fraction to whole elements of the unit's flat
buffer (:func:`~mist_compiler.ir.stage.split_boundary`). Units without parameters offload only
activations. Pure: the input is never modified.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..ir.model_graph import PARAMETER
from ..ir.plan import OFFLOAD_KINDS, Offload
from ..ir.stage import StageGraph
from .manager import PassResult


def unit_offload(has_parameters: bool, offload: Offload) -> Offload:
    """One unit's offload fractions under the stage's ``offload`` ratios (the rule above; an
    ``Offload`` holds fractions in [0, 1] by construction)."""
    if not has_parameters:
        return Offload(acts=offload.acts)
    return Offload(**{kind: getattr(offload, kind) for kind in OFFLOAD_KINDS})


def unit_offload_table(units: list[tuple[str, int]], offload: Offload) -> dict[str, Offload]:
    """``[(unit name, parameter elements)]`` -> ``{name: Offload}`` (for runtimes built by hand)."""
    return {name: unit_offload(elements > 0, offload) for name, elements in units}


@dataclass
class OffloadInsertion:
    """Set every unit's offload fractions from the stage's plan ratios."""

    offload: Offload
    name: str = "offload_insertion"
    input_type = output_type = StageGraph

    def __call__(self, stage: StageGraph) -> PassResult:
        units = [replace(u, offload=unit_offload(any(kind == PARAMETER for kind, _ in u.tensors.values()), self.offload))
                 for u in stage.units]
        return PassResult(replace(stage, units=units), self.offload.any)
