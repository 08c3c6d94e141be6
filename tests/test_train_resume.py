"""Checkpoint and resume: bit-exact under the same plan, within --check's tolerance under another
(dp, pp, tp, ZeRO level and offload all different), on 2 and 4 gloo ranks; clipping sees the
one-process gradient norm."""
from __future__ import annotations

import os

import pytest

from tests.dist_utils import run_ranks
from tests.train_runs import assert_within_check_tolerance, plan, reference_first_norm, run_jobs, stage

STEPS, SAVE_AT = 20, 10


def _jobs(save_dir: str, saved_under: dict, resumed_under: dict, exact: bool = True) -> list:
    base = {"steps": STEPS, "optim": {"lr": 3e-3, "min_lr": 3e-4, "warmup": 3, "weight_decay": 0.1, "clip": 1.0}}
    step_dir = os.path.join(save_dir, f"step-{SAVE_AT:06d}")
    return [
        (saved_under, {**base, "save_dir": save_dir, "save_every": SAVE_AT}),       # uninterrupted, saves at 10 and 20
        *([(saved_under, {**base, "resume": step_dir, "resume_exact": True})] if exact else []),  # same plan: bit for bit
        (resumed_under, {**base, "resume": step_dir}),                              # another plan: resharded
        (resumed_under, {**base}),                                                  # another plan from scratch: the noise
    ]


def _check(results: list[dict], first_norm: float) -> None:
    full, *exact, other, other_full = results
    assert len(full["loss"]) == STEPS and other["start"] == SAVE_AT
    for run in exact:
        assert run["start"] == SAVE_AT
        assert run["loss"] == full["loss"][SAVE_AT:], "the same plan must resume bit for bit"
        assert run["grad_norm"] == full["grad_norm"][SAVE_AT:]
    assert other["lr"] == full["lr"][SAVE_AT:]
    assert_within_check_tolerance(other["loss"], full["loss"][SAVE_AT:], other_full["loss"][SAVE_AT:])
    for run in (full, other_full):  # global clipping sees one process's norm, whatever the plan
        assert abs(run["grad_norm"][0] - first_norm) <= 1e-5 * first_norm, (run["grad_norm"][0], first_norm)
    assert full["loss"][-1] < full["loss"][0] - 0.3  # it learns


TIED = "tests.test_backend_engine:tied_gpt"  # head tied to the embedding: across the pipeline under plan B


@pytest.mark.distributed
def test_resume_on_2_ranks_under_another_dp_pp_and_zero(tmp_path):
    saved_under = plan([stage((0, 4), dp=2, zero=1)], model=TIED)
    resumed_under = plan([stage((0, 2), zero=3, offload={"opt": 0.5}), stage((2, 4), zero=0)], grad_accum=2,
                         model=TIED)
    results = run_ranks(run_jobs, world=2, args=(_jobs(str(tmp_path / "ck"), saved_under, resumed_under),),
                        timeout_s=240)[0]
    _check(results, reference_first_norm(TIED, saved_under))


@pytest.mark.heavy  # 55-70 s on two cores
@pytest.mark.distributed
def test_resume_on_4_ranks_under_another_tp_dp_pp_zero_and_offload(tmp_path):
    saved_under = plan([stage((0, 4), dp=2, tp=2, zero=2)])
    resumed_under = plan([stage((0, 1), dp=2, zero=3, offload={"weights": 0.5, "opt": 0.5}),
                          stage((1, 4), tp=2, zero=0)], grad_accum=2)
    # (bit-exact resumption is the 2-rank test's: this one keeps under a minute on 2 cores)
    results = run_ranks(run_jobs, world=4, args=(_jobs(str(tmp_path / "ck"), saved_under, resumed_under, exact=False),),
                        timeout_s=300)[0]
    _check(results, reference_first_norm("gpt-tiny", saved_under))
