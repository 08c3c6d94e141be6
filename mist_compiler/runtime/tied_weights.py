"""Weights tied across the pipeline (embedding on the first stage, head on the last).

See :class:`TiedWeights`. Per step it moves one gradient all-reduce and one weight broadcast per
tied weight over the group joining the first and last stages; it never gathers a whole stage.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..ir.vocabulary import TORCH_DTYPES


class TiedWeights:
    """A weight shared by the first stage (embedding) and the last (head) of a pipeline.

    The first stage owns it (its runtime shards and updates it); the last stage keeps a plain
    copy outside its runtime. Gradients: the last stage accumulates its share over the
    micro-batches and, after its schedule, all-reduces ``sum(h_r) / dp_last`` over the tied group;
    the first stage takes part in that all-reduce from the gradient transform of its *last*
    micro-batch (the last stage is then done with backward, so nobody waits on anybody) and adds
    it to its own gradient. After the step the first stage sends the updated weight, and nothing
    else of its stage.

    With the same tp on both stages, rank t of each holds the same vocabulary rows: one group per
    t, the share is all-reduced slice for slice and the weight broadcast from the first stage's dp
    rank 0. With different tp (a heterogeneous pipeline) the rows do not line up, so one group
    joins both stages and the exchanges carry the whole weight: every rank writes its own rows
    into a zero tensor of the full shape and the all-reduce sums the pieces (each row is written
    by one rank per dp replica, so the sum is exact); each rank then reads its rows.
    """

    def __init__(self, engine: Any, names: list[str]) -> None:  # engine: the rank's Engine (not imported: it imports us)
        self.engine = engine
        self.names = names  # tied parameter names present in this stage program, in model-name order
        self.is_first = engine.coord.stage == 0
        self.group = engine.groups.tied
        self.whole = engine.plan.stages[0].tp != engine.plan.stages[-1].tp  # exchange whole weights
        self.source = engine.topology.rank_of(0, 0, engine.coord.tp_index)
        self.last_backward = False
        self.params: dict[str, nn.Parameter] = {}  # on the last stage: the tied copies, kept out of its runtime
        if not self.is_first:
            for name, param in _unit_parameters(engine.program.units):
                if name in names:
                    self.params[name] = param

    @classmethod
    def create(cls, engine: Any) -> "TiedWeights | None":
        if not engine.topology.ends_apart or engine.coord.stage not in engine.topology.end_stages:
            return None
        local = {name for name, _ in _unit_parameters(engine.program.units)}
        names = sorted(local & engine.tied_names, key=lambda name: (engine.program.fqn[name], name))
        return cls(engine, names) if names else None

    def attach(self, runtime: Any) -> None:
        if self.is_first:
            for name in self.names:
                runtime.register_grad_transform(name, lambda grad, name=name: self._add_last_stage_share(name, grad))
        else:
            dtype = TORCH_DTYPES[self.engine.plan.dtype]
            for param in self.params.values():
                param.data = param.data.to(self.engine.device, dtype)

    def begin_iteration(self) -> None:
        for param in self.params.values():
            param.grad = None

    # ---- where this rank's rows sit in the whole weight (the whole-weight exchange) ----------------
    def _rows(self, name: str, local: torch.Tensor) -> tuple[torch.Size, int, list[slice]]:
        spec = self.engine.program.shards.get(name)
        tp = self.engine.stage_plan.tp
        if spec is None or tp == 1:
            return local.shape, 0, [slice(0, local.shape[0])]
        shape = list(local.shape)
        shape[spec.dim] *= tp
        return torch.Size(shape), spec.dim, spec.rank_slices(shape[spec.dim], self.engine.coord.tp_index, tp)

    def _writes(self, name: str) -> bool:
        """Whether this rank's rows are its own (a weight every tp rank holds whole is written by tp rank 0)."""
        return self.engine.program.shards.get(name) is not None or self.engine.coord.tp_index == 0

    def _whole(self, name: str, local: torch.Tensor | None, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """All-reduce of a zero tensor of the whole weight's shape holding ``local`` at this rank's rows."""
        shape, dim, rows = self._rows(name, like)
        whole = torch.zeros(shape, dtype=dtype, device=like.device)
        if local is not None:
            start = 0
            for piece in rows:
                size = piece.stop - piece.start
                whole.narrow(dim, piece.start, size).copy_(local.narrow(dim, start, size))
                start += size
        dist.all_reduce(whole, group=self.group)
        return whole

    def _read(self, name: str, whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        _, dim, rows = self._rows(name, like)
        return torch.cat([whole.narrow(dim, piece.start, piece.stop - piece.start) for piece in rows], dim=dim)

    # ---- gradients ------------------------------------------------------------------------------
    def _add_last_stage_share(self, name: str, grad: torch.Tensor) -> None:
        if not self.last_backward:
            return
        if self.whole:
            share = self._read(name, self._whole(name, None, grad, torch.float32), grad)
        else:
            share = torch.zeros_like(grad, dtype=torch.float32)
            dist.all_reduce(share, group=self.group)
        grad.add_(share.to(grad.dtype))

    def after_backward(self) -> None:
        if self.is_first:
            return
        dp = self.engine.stage_plan.dp
        for name, param in self.params.items():
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            share = grad.float() / dp
            if self.whole:
                self._whole(name, share if self._writes(name) else None, share, torch.float32)
            else:
                dist.all_reduce(share, group=self.group)

    # ---- weights --------------------------------------------------------------------------------
    def after_step(self) -> None:
        """The first stage sends each updated tied weight (only that weight: a view of its resident
        bucket, or a gather of its one unit under ZeRO-3) straight into the last stage's copy."""
        if self.is_first:
            for name in self.names:
                weight = self.engine.runtime.full_parameter(name)
                weight = weight if weight.is_contiguous() else weight.contiguous()
                if self.whole:
                    mine = self.engine.coord.dp_index == 0 and self._writes(name)
                    self._whole(name, weight if mine else None, weight, weight.dtype)
                else:
                    dist.broadcast(weight, src=self.source, group=self.group)
        else:
            for name, param in self.params.items():
                if self.whole:
                    param.data.copy_(self._read(name, self._whole(name, None, param.data, param.dtype), param.data))
                else:
                    dist.broadcast(param.data, src=self.source, group=self.group)

    def local_parameters(self) -> dict[str, torch.Tensor]:
        return {name: p.detach() for name, p in self.params.items()}


def _unit_parameters(units: list[tuple[str, nn.Module]]):
    for unit_name, module in units:
        for name, param in module.named_parameters():
            yield f"{unit_name}.{name}" if unit_name else name, param
