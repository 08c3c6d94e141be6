"""Baselines in the same cost model, each expressed as restrictions of the search space.

- ``megatron``: uniform DP x TP x PP (equal devices and, within one layer, equal layers per
  stage; one TP degree for all stages), full or no activation checkpointing for every stage,
  ZeRO-1, no offload; micro-batch and G searched (Megatron-LM's usual grid).
- ``zero3``: ZeRO-3 / FSDP only: one stage, no TP, ZeRO-3, checkpoint all or none, no offload.
- ``mist-paper``: the Mist paper's own space: micro-batch 1/2/4, one TP degree and equal devices
  for all stages, layers within +-2 of an even split; ZeRO, checkpointing and offloading tuned.

Every baseline pipelines with 1F1B only (the full space also tries the other schedules).

A baseline is a list of spaces (a "uniform" choice such as one TP degree for every stage is one
space per value); its result is the best over them. Every space is a subset of
``SearchSpace()``, which is why the full search is never worse than a baseline (tested).
"""
from __future__ import annotations

from typing import Callable

from .api import TuneResult, tune
from .space import Cluster, SearchSpace, TuneError, Workload

NO_OFFLOAD = dict(offload_weights=False, offload_grads=False, offload_opt=False, offload_acts=False)
ONE_F_ONE_B = ("1f1b",)
PAPER = dict(sequence_parallel=False, per_tensor=False)  # the baselines' spaces as published
TP_DEGREES = (1, 2, 4, 8, 16)


def megatron_spaces() -> list[SearchSpace]:
    return [SearchSpace(name=f"megatron tp{tp} ckpt-{ckpt}", tp_degrees=(tp,), zero_levels=(1,), ckpt=ckpt,
                        uniform_devices=True, layer_slack=0, schedules=ONE_F_ONE_B, **NO_OFFLOAD, **PAPER)
            for tp in TP_DEGREES for ckpt in ("none", "all")]


def zero3_spaces() -> list[SearchSpace]:
    return [SearchSpace(name=f"zero3 ckpt-{ckpt}", stage_counts=(1,), tp_degrees=(1,), zero_levels=(3,), ckpt=ckpt,
                        schedules=ONE_F_ONE_B, **NO_OFFLOAD, **PAPER) for ckpt in ("none", "all")]


def mist_paper_spaces() -> list[SearchSpace]:
    return [SearchSpace(name=f"mist-paper tp{tp}", micro_batches=(1, 2, 4), tp_degrees=(tp,), uniform_devices=True,
                        layer_slack=2, schedules=ONE_F_ONE_B, **PAPER) for tp in TP_DEGREES]


BASELINE_SPACES: dict[str, Callable[[], list[SearchSpace]]] = {
    "megatron": megatron_spaces,
    "zero3": zero3_spaces,
    "mist-paper": mist_paper_spaces,
}


def tune_baseline(name: str, cost_model, work: Workload, cluster: Cluster, *, progress=None,
                  space_override: SearchSpace | None = None, model_config: object = None) -> TuneResult:
    """The best plan of one baseline (its spaces tried in turn, sharing one cost model)."""
    if name not in BASELINE_SPACES:
        raise ValueError(f"unknown baseline {name!r}; known: {sorted(BASELINE_SPACES)}")
    best: TuneResult | None = None
    errors = []
    for space in BASELINE_SPACES[name]():
        if space_override is not None:
            space = _merge(space, space_override)
        try:
            result = tune(cost_model, work, cluster, space=space, progress=progress, model_config=model_config)
        except TuneError as error:
            errors.append(f"{space.name}: {error}")
            continue
        if best is None or result.predicted_time_s < best.predicted_time_s:
            best = result
    if best is None:
        raise TuneError(f"baseline {name} has no feasible plan: {errors[0] if errors else 'no space'}")
    best.stats["baseline"] = name
    return best


def _merge(space: SearchSpace, override: SearchSpace) -> SearchSpace:
    """Apply the search settings of ``override`` (target gap, stage cap) to a baseline space."""
    return space.restrict(gap=override.gap, max_stages=override.max_stages or space.max_stages)
