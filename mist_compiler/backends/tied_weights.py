"""Weights tied across the pipeline (embedding on the first stage, head on the last).

See :class:`TiedWeights`. Per step it moves one gradient all-reduce and one weight broadcast per
tied weight over the group joining the first and last stages; it never gathers a whole stage.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from mist_compiler.ir.model_graph import PARAMETER

from .device import DTYPES

if TYPE_CHECKING:
    from .engine import Engine


class TiedWeights:
    """A weight shared by the first stage (embedding) and the last (head) of a pipeline.

    The first stage owns it (its runtime shards and updates it); the last stage keeps a plain
    copy outside its runtime. Gradients: the last stage accumulates its share over the
    micro-batches and, after its schedule, all-reduces ``sum(h_r) / dp_last`` over the tied group;
    the first stage takes part in that all-reduce from the gradient transform of its *last*
    micro-batch (the last stage is then done with backward, so nobody waits on anybody) and adds
    it to its own gradient. After the step the first stage broadcasts the updated weight, and
    nothing else of its stage.
    """

    def __init__(self, engine: "Engine", names: list[str]) -> None:
        self.engine = engine
        self.names = names  # tied parameter names present in this stage program
        self.is_first = engine.coord.stage == 0
        self.group = engine.groups.tied
        self.source = engine.topology.rank_of(0, 0, engine.coord.tp_index)
        self.last_backward = False
        self.params: dict[str, nn.Parameter] = {}  # on the last stage: the tied copies, kept out of its runtime
        if not self.is_first:
            for name, param in _unit_parameters(engine.program.units):
                if name in names:
                    self.params[name] = param

    @classmethod
    def create(cls, engine: "Engine") -> "TiedWeights | None":
        if engine.coord.stage not in (0, engine.plan.pp - 1):
            return None
        local = {name for name, _ in _unit_parameters(engine.program.units)}
        names = sorted(local & engine.tied_names)
        return cls(engine, names) if names else None

    def attach(self, runtime: Any) -> None:
        if self.is_first:
            for name in self.names:
                runtime.register_grad_transform(name, self._add_last_stage_share)
        else:
            dtype = DTYPES[self.engine.plan.dtype]
            for param in self.params.values():
                param.data = param.data.to(self.engine.device, dtype)

    def begin_iteration(self) -> None:
        for param in self.params.values():
            param.grad = None

    def _add_last_stage_share(self, grad: torch.Tensor) -> None:
        if not self.last_backward:
            return
        share = torch.zeros_like(grad, dtype=torch.float32)
        dist.all_reduce(share, group=self.group)
        grad.add_(share.to(grad.dtype))

    def after_backward(self) -> None:
        if self.is_first:
            return
        dp = self.engine.stage_plan.dp
        for param in self.params.values():
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            share = grad.float() / dp
            dist.all_reduce(share, group=self.group)

    def after_step(self) -> None:
        """The first stage broadcasts each updated tied weight (only that weight: a view of its resident
        bucket, or a gather of its one unit under ZeRO-3) straight into the last stage's copy."""
        if self.is_first:
            for name in self.names:
                weight = self.engine.runtime.full_parameter(name)
                dist.broadcast(weight if weight.is_contiguous() else weight.contiguous(), src=self.source,
                               group=self.group)
        else:
            for param in self.params.values():
                dist.broadcast(param.data, src=self.source, group=self.group)

    def local_parameters(self) -> dict[str, torch.Tensor]:
        return {name: p.detach() for name, p in self.params.items()}


def _unit_parameters(units: list[tuple[str, nn.Module]]):
    for unit_name, module in units:
        for name, param in module.named_parameters():
            yield f"{unit_name}.{name}" if unit_name else name, param


def tied_parameters(graph) -> set[str]:
    """Names (in the model) of the parameters both the pre part (embedding) and the post part (head)
    of a captured model graph read: the weights a pipeline must keep tied."""
    by_name = graph._by_name()

    def read_by(nodes: tuple[str, ...]) -> set[str]:
        return {a.name for n in nodes for a in by_name[n].all_input_nodes
                if graph.tensors.get(a.name, ("", ""))[0] == PARAMETER}

    return {graph.tensors[p][1] for p in read_by(graph.pre) & read_by(graph.post)}
