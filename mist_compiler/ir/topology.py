"""Rank layout of a plan: which rank runs which stage, data-parallel index and tensor-parallel index.

Physical stages (groups of devices, ``Plan.physical_stages``) take contiguous rank ranges in order; inside stage ``s`` (first rank ``offset_s``) the
rank of data-parallel index ``d`` and tensor-parallel index ``t`` is ``offset_s + d * tp_s + t``.
Groups of ranks follow: one data-parallel group per (stage, tp index), one tensor-parallel group
per (stage, dp index) and, for models whose head is tied to the embedding across stages, one
group per tp index joining the stages of the first and the last virtual stage (one group joining
both stages whole when their tp differ). Pure arithmetic on the plan; :mod:`mist_compiler.runtime.process_groups`
creates the groups.
"""
from __future__ import annotations

from dataclasses import dataclass

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
        return sum(s.devices for s in self.plan.physical_stages[:stage])

    def rank_of(self, stage: int, dp_index: int, tp_index: int) -> int:
        plan_stage = self.plan.stages[stage]
        return self.stage_offset(stage) + dp_index * plan_stage.tp + tp_index

    def coord(self, rank: int) -> RankCoord:
        if not 0 <= rank < self.world_size:
            raise PlanError(f"plan field stages: rank {rank} is outside the plan's {self.world_size} devices")
        for stage, plan_stage in enumerate(self.plan.physical_stages):
            offset = self.stage_offset(stage)
            if rank < offset + plan_stage.devices:
                local = rank - offset
                return RankCoord(stage, local // plan_stage.tp, local % plan_stage.tp)
        raise AssertionError("unreachable")

    def check_world_size(self, world_size: int) -> None:
        """A plan must use exactly the launched ranks."""
        if world_size != self.world_size:
            per_stage = " + ".join(f"{s.dp}*{s.tp}" for s in self.plan.physical_stages)
            raise PlanError(
                f"plan field stages: the plan needs {self.world_size} ranks (sum of dp*tp per stage: {per_stage}) "
                f"but {world_size} were launched"
            )

    def dp_ranks(self, stage: int, tp_index: int) -> list[int]:
        return [self.rank_of(stage, d, tp_index) for d in range(self.plan.stages[stage].dp)]

    def tp_ranks(self, stage: int, dp_index: int) -> list[int]:
        return [self.rank_of(stage, dp_index, t) for t in range(self.plan.stages[stage].tp)]

    @property
    def end_stages(self) -> tuple[int, int]:
        """Physical stages of the first and of the last virtual stage (the embedding's, the head's)."""
        return self.plan.placement[0], self.plan.placement[-1]

    @property
    def ends_apart(self) -> bool:
        """The embedding and the head run on different devices (a tied weight needs a group)."""
        first, last = self.end_stages
        return first != last

    def tied_ranks(self, tp_index: int) -> list[int]:
        """First- and last-stage ranks with tp index ``tp_index`` (the same vocabulary rows of a tied
        weight when both stages have the same tp)."""
        first, last = self.end_stages
        return sorted(set(self.dp_ranks(first, tp_index)) | set(self.dp_ranks(last, tp_index)))

    def sample_range(self, stage: int, dp_index: int, micro: int) -> tuple[int, int]:
        """Global-batch sample indices ``[start, end)`` of one rank's share of micro-batch ``micro``."""
        per_micro = self.plan.global_batch // self.plan.grad_accum
        mb = self.plan.stages[stage].micro_batch
        start = micro * per_micro + dp_index * mb
        return start, start + mb
