"""Offload insertion: map a stage's offload ratios onto its units (a per-unit ``UnitOffload`` table).

The plan gives one ratio per state kind per stage (``Offload``: weights, grads, opt, acts). This
pass decides, for each unit of the stage (pre block, layer blocks, post block, in execution order),
which fraction of that unit's bytes of each kind lives in host memory.

Mapping rule: the *same* fraction of every unit's bytes. A unit of B bytes of a kind offloads
``round(ratio * B)`` bytes of it, so the stage's offloaded bytes equal ``ratio`` times its total up
to rounding, every unit needs the same host<->device traffic relative to its size, and the
one-unit-ahead prefetch sees a steady copy load (no unit with all of its weights to fetch). The
fraction is rounded to whole elements inside the unit's flat buffer (the runtime's
``SplitBuffer``); ``unit_elements`` lets the pass report that exactly. Units with no bytes of a kind
get 0 for it.

Input: ``OffloadInput`` (unit names with their parameter element counts and the stage's
``Offload``); output: ``{unit name: UnitOffload}`` plus the offloaded element counts. Pure: the
input is never modified.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..backends.offload import split_boundary
from ..backends.zero import UnitOffload
from ..ir.plan import OFFLOAD_KINDS, Offload
from .manager import PassResult


class OffloadInsertionError(ValueError):
    """Bad input to the offload-insertion pass; the message names the field."""


@dataclass(frozen=True)
class OffloadInput:
    units: tuple[tuple[str, int], ...]  # (unit name, parameter elements) in execution order
    offload: Offload


@dataclass(frozen=True)
class OffloadTable:
    per_unit: dict[str, UnitOffload]
    offloaded_weight_elements: dict[str, int] = field(default_factory=dict)

    def total_offloaded_weight_elements(self) -> int:
        return sum(self.offloaded_weight_elements.values())


def _validate(program: OffloadInput) -> None:
    if not program.units:
        raise OffloadInsertionError("offload insertion: units must be a non-empty list of (name, elements)")
    seen: set[str] = set()
    for index, unit in enumerate(program.units):
        if not (isinstance(unit, tuple) and len(unit) == 2 and isinstance(unit[0], str)
                and isinstance(unit[1], int) and unit[1] >= 0):
            raise OffloadInsertionError(f"offload insertion: units[{index}] must be (name, elements >= 0), got {unit!r}")
        if unit[0] in seen:
            raise OffloadInsertionError(f"offload insertion: units[{index}] repeats the name {unit[0]!r}")
        seen.add(unit[0])
    for kind in OFFLOAD_KINDS:
        value = getattr(program.offload, kind)
        if not 0.0 <= value <= 1.0:
            raise OffloadInsertionError(f"offload insertion: offload.{kind} must be in [0, 1], got {value}")


def offload_insertion(program: OffloadInput) -> PassResult:
    """The pass: ``OffloadInput`` -> ``PassResult(OffloadTable)``; modified when anything is offloaded."""
    _validate(program)
    ratios = {kind: getattr(program.offload, kind) for kind in OFFLOAD_KINDS}
    per_unit: dict[str, UnitOffload] = {}
    offloaded: dict[str, int] = {}
    for name, elements in program.units:
        if elements == 0:
            per_unit[name] = UnitOffload(weights=0.0, grads=0.0, opt=0.0, acts=ratios["acts"])
        else:
            per_unit[name] = UnitOffload(**ratios)
        offloaded[name] = elements - split_boundary(elements, per_unit[name].weights)
    return PassResult(OffloadTable(per_unit, offloaded), modified=program.offload.any)


offload_insertion.name = "offload_insertion"


def unit_offload_table(units: list[tuple[str, int]], offload: Offload) -> dict[str, UnitOffload]:
    """Convenience wrapper for the runtime and codegen: ``[(name, elements)]`` -> ``{name: UnitOffload}``."""
    return offload_insertion(OffloadInput(tuple(units), offload)).program.per_unit
