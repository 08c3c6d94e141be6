"""Rank layout of a plan and the process groups it needs.

Stages take contiguous rank ranges in order; inside stage ``s`` (first rank ``offset_s``) the
rank of data-parallel index ``d`` and tensor-parallel index ``t`` is ``offset_s + d * tp_s + t``.
Groups: one data-parallel group per (stage, tp index), one tensor-parallel group per (stage, dp
index) and, for models whose head is tied to the embedding across stages, one group per tp
index joining the first and the last stage (one group joining both stages whole when their tp
differ). ``torch.distributed.new_group`` must be called by
every rank in the same order, so :func:`build_groups` creates all of them everywhere.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mist_compiler.ir.plan import Plan, PlanError


@dataclass(frozen=True)
class RankCoord:
    stage: int
    dp_index: int
    tp_index: int


@dataclass(frozen=True)
class Topology:
    plan: Plan

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    def stage_offset(self, stage: int) -> int:
        return sum(s.devices for s in self.plan.stages[:stage])

    def rank_of(self, stage: int, dp_index: int, tp_index: int) -> int:
        plan_stage = self.plan.stages[stage]
        return self.stage_offset(stage) + dp_index * plan_stage.tp + tp_index

    def coord(self, rank: int) -> RankCoord:
        if not 0 <= rank < self.world_size:
            raise PlanError(f"plan field stages: rank {rank} is outside the plan's {self.world_size} devices")
        for stage, plan_stage in enumerate(self.plan.stages):
            offset = self.stage_offset(stage)
            if rank < offset + plan_stage.devices:
                local = rank - offset
                return RankCoord(stage, local // plan_stage.tp, local % plan_stage.tp)
        raise AssertionError("unreachable")

    def check_world_size(self, world_size: int) -> None:
        """A plan must use exactly the launched ranks."""
        if world_size != self.world_size:
            per_stage = " + ".join(f"{s.dp}*{s.tp}" for s in self.plan.stages)
            raise PlanError(
                f"plan field stages: the plan needs {self.world_size} ranks (sum of dp*tp per stage: {per_stage}) "
                f"but {world_size} were launched"
            )

    def dp_ranks(self, stage: int, tp_index: int) -> list[int]:
        return [self.rank_of(stage, d, tp_index) for d in range(self.plan.stages[stage].dp)]

    def tp_ranks(self, stage: int, dp_index: int) -> list[int]:
        return [self.rank_of(stage, dp_index, t) for t in range(self.plan.stages[stage].tp)]

    def tied_ranks(self, tp_index: int) -> list[int]:
        """First- and last-stage ranks with tp index ``tp_index`` (the same vocabulary rows of a tied
        weight when both stages have the same tp)."""
        first, last = 0, self.plan.pp - 1
        return sorted(set(self.dp_ranks(first, tp_index)) | set(self.dp_ranks(last, tp_index)))

    def sample_range(self, stage: int, dp_index: int, micro: int) -> tuple[int, int]:
        """Global-batch sample indices ``[start, end)`` of one rank's share of micro-batch ``micro``."""
        per_micro = self.plan.global_batch // self.plan.grad_accum
        mb = self.plan.stages[stage].micro_batch
        start = micro * per_micro + dp_index * mb
        return start, start + mb


@dataclass
class ProcessGroups:
    """The groups this rank belongs to (``None`` for a group of one rank)."""

    dp: Any
    tp: Any
    tied: Any
    dp_ranks: list[int]
    tp_ranks: list[int]
    tied_ranks: list[int]


def _group(ranks: list[int], dist: Any, timeout: Any) -> Any:
    return dist.new_group(ranks, timeout=timeout)


def build_groups(topology: Topology, rank: int, *, tied: bool, timeout: Any) -> ProcessGroups:
    """Create every data/tensor-parallel (and tied-weight) group on every rank; return this rank's."""
    import torch.distributed as dist

    plan = topology.plan
    mine: dict[str, Any] = {}
    ranks_of: dict[str, list[int]] = {}
    for stage, plan_stage in enumerate(plan.stages):
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
    if tied and plan.pp > 1:
        first, last = 0, plan.pp - 1
        if plan.stages[first].tp == plan.stages[last].tp:  # rank t of each stage holds the same rows
            joined = [topology.tied_ranks(t) for t in range(plan.stages[first].tp)]
        else:  # rows do not line up: one group joins both stages (see tied_weights.py)
            joined = [sorted({r for s in (first, last) for t in range(plan.stages[s].tp) for r in topology.dp_ranks(s, t)})]
        for ranks in joined:
            group = _group(ranks, dist, timeout)
            if rank in ranks:
                mine["tied"], ranks_of["tied"] = group, ranks
    return ProcessGroups(
        dp=mine["dp"], tp=mine["tp"], tied=mine.get("tied"),
        dp_ranks=ranks_of["dp"], tp_ranks=ranks_of["tp"], tied_ranks=ranks_of.get("tied", []),
    )
