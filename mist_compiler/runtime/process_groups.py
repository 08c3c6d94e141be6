"""The process groups of a plan's rank layout (:mod:`mist_compiler.ir.topology`), built on every rank.

``torch.distributed.new_group`` must be called by every rank in the same order, so
:func:`build_groups` creates all of them everywhere and returns the ones this rank belongs to:
data- and tensor-parallel groups, the tied-weight group, and one two-rank group per pipeline
*channel* (a directed pair of ranks exchanging activations or gradients, ``pipeline.channel_pairs``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..ir.schedule import build_schedule
from ..ir.topology import Topology
from .pipeline import channel_pairs


@dataclass
class ProcessGroups:
    """The groups this rank belongs to (``None`` for a group of one rank)."""

    dp: Any
    tp: Any
    tied: Any
    dp_ranks: list[int]
    tp_ranks: list[int]
    tied_ranks: list[int]
    channels: dict[tuple[int, int], Any] = field(default_factory=dict)  # (src, dst) -> group, this rank's


def _group(ranks: list[int], dist: Any, timeout: Any) -> Any:
    return dist.new_group(ranks, timeout=timeout)


def build_groups(topology: Topology, rank: int, *, tied: bool, timeout: Any) -> ProcessGroups:
    """Create every data/tensor-parallel (and tied-weight) group on every rank; return this rank's."""
    import torch.distributed as dist

    plan = topology.plan
    mine: dict[str, Any] = {}
    ranks_of: dict[str, list[int]] = {}
    for stage, plan_stage in enumerate(plan.physical_stages):
        for t in range(plan_stage.tp):
            ranks = topology.dp_ranks(stage, t)
            group = _group(ranks, dist, timeout)
            if rank in ranks:
                mine["dp"], ranks_of["dp"] = group, ranks
        for d in range(plan_stage.dp):
            ranks = topology.tp_ranks(stage, d)
            group = _group(ranks, dist, timeout)
            if rank in ranks:
                mine["tp"], ranks_of["tp"] = group, ranks
    if tied and topology.ends_apart:
        first, last = topology.end_stages
        if plan.stages[first].tp == plan.stages[last].tp:  # rank t of each stage holds the same rows
            joined = [topology.tied_ranks(t) for t in range(plan.stages[first].tp)]
        else:  # rows do not line up: one group joins both stages (see tied_weights.py)
            joined = [sorted({r for s in (first, last) for t in range(plan.stages[s].tp) for r in topology.dp_ranks(s, t)})]
        for ranks in joined:
            group = _group(ranks, dist, timeout)
            if rank in ranks:
                mine["tied"], ranks_of["tied"] = group, ranks
    channels = {}
    schedule = build_schedule(plan.schedule, plan.pp, plan.virtual_stages, plan.grad_accum)
    for src, dst in channel_pairs(topology, schedule):
        group = _group(sorted({src, dst}), dist, timeout)
        if rank in (src, dst):
            channels[(src, dst)] = group
    return ProcessGroups(
        dp=mine["dp"], tp=mine["tp"], tied=mine.get("tied"),
        dp_ranks=ranks_of["dp"], tp_ranks=ranks_of["tp"], tied_ranks=ranks_of.get("tied", []), channels=channels,
    )
