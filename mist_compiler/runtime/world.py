"""This rank's place in the launched world under a plan: its device, its process group, its
coordinates (stage, data-parallel and tensor-parallel index) and the groups it belongs to.

:func:`join_world` is the first step that touches devices or processes; the driver runs it
before lowering, because lowering builds the stage's modules on this rank's device and shards
them over its tensor-parallel group. The order matters on GPUs: the device is made current
before anything touches CUDA, the process group is bound to it, every group is created on every
rank in the same order, and the world communicator runs one collective before the pipeline's
first batched transfer (:mod:`.device`).
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..ir.plan import Plan, StagePlan
from ..ir.topology import RankCoord, Topology
from ..ops.groups import ProcessGroup
from .device import init_process_group, select_device, warm_up_world
from .process_groups import ProcessGroups, build_groups

DEFAULT_TIMEOUT_S = 300.0


@dataclass
class RankWorld:
    """Where this process runs in the plan's world."""

    plan: Plan
    topology: Topology
    device: torch.device
    rank: int
    size: int
    coord: RankCoord
    groups: ProcessGroups
    timeout_s: float

    @property
    def stage(self) -> StagePlan:
        return self.plan.stages[self.coord.stage]

    @property
    def tp_group(self) -> ProcessGroup:
        """The tensor-parallel group as the ops a lowered graph calls see it."""
        return ProcessGroup(self.groups.tp, self.coord.tp_index, self.stage.tp)


def join_world(plan: Plan, *, tied: bool, device: torch.device | str | None = None,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> RankWorld:
    """Pick and bind this rank's device, join (or start) the process group, check that the plan
    uses exactly the launched ranks and build its groups (``tied``: the model's embedding and head
    share a weight, so a pipeline needs a group joining its first and last stage). Collective."""
    topology = Topology(plan)
    chosen = select_device(device)  # made current first: every kernel and collective on the rank's own GPU
    init_process_group(timeout_s, chosen)
    rank, size = dist.get_rank(), dist.get_world_size()
    topology.check_world_size(size)
    groups = build_groups(topology, rank, tied=tied, timeout=datetime.timedelta(seconds=timeout_s))
    warm_up_world(chosen)
    return RankWorld(plan, topology, chosen, rank, size, topology.coord(rank), groups, timeout_s)
