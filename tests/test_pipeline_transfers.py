"""Pipelines train correctly on gloo with every point-to-point tag forced to 0, where gloo, like
NCCL, matches a pair's messages in posting order: tags cannot tell tensors apart."""
from __future__ import annotations

import contextlib

import pytest

from mist_compiler.ir.plan import Plan
from tests.dist_utils import run_ranks
from tests.plan_runs import train_engine_and_check
from tests.test_backend_engine import LR, assert_all_match, plan_dict, report, stage


@contextlib.contextmanager
def equal_tags():
    """Every isend/irecv (direct or through ``batch_isend_irecv``) is posted with tag 0."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    originals = {name: getattr(c10d, name) for name in ("isend", "irecv", "send", "recv")}

    def tagless(function):
        def wrapper(*args, **kwargs):
            kwargs["tag"] = 0
            return function(*args, **kwargs)
        return wrapper

    patched = {name: tagless(function) for name, function in originals.items()}
    try:
        for name, function in patched.items():
            setattr(c10d, name, function)
            setattr(dist, name, function)
        yield
    finally:
        for name, function in originals.items():
            setattr(c10d, name, function)
            setattr(dist, name, function)


def _train_with_equal_tags(rank, world, cases):
    """Each case is (plan dict, schedule name); rank 0 judges the run against one-process training."""
    from mist_compiler import compile as compile_plan
    from mist_compiler.models import build_model
    from mist_compiler.runtime.optimizer import AdamWConfig
    from mist_compiler.verify.check import vocab_size

    results = []
    with equal_tags():
        for data, schedule in cases:
            plan = Plan.from_dict(data)
            engine = compile_plan(plan.model, plan, optimizer=AdamWConfig(**LR), timeout_s=60)
            engine.set_schedule(schedule)
            verdict = train_engine_and_check(engine, plan, vocab_size(build_model(plan.model)), rank, LR)
            if verdict is not None:
                results.append({"stages": data["stages"], "schedule": schedule, "ok": verdict.ok,
                                "line": verdict.line()})
    return results


def run_cases(world, cases, timeout_s=300):
    results = run_ranks(_train_with_equal_tags, world=world, args=(cases,), timeout_s=timeout_s)[0]
    report(results)
    assert_all_match(results)


def pipeline(model, grad_accum, *stages_):
    return plan_dict(model, 8, grad_accum, list(stages_))


@pytest.mark.distributed
def test_two_stages_every_schedule_with_equal_tags():
    plan = pipeline("gpt-tiny", 4, stage((0, 2)), stage((2, 4)))
    run_cases(2, [(plan, "1f1b"), (plan, "gpipe")])


@pytest.mark.distributed
def test_three_stages_with_equal_tags():
    """The issue's case: a 3-stage pipeline of a small GPT (the tag-based code of 446fe97 trains this
    plan to a relative weight difference of 0.26 under equal tags)."""
    plan = pipeline("gpt-tiny", 4, stage((0, 1)), stage((1, 3)), stage((3, 4)))
    run_cases(3, [(plan, "1f1b"), (plan, "gpipe")])


@pytest.mark.distributed
def test_four_stages_and_mixed_dp_tp_stages_with_equal_tags():
    cases = [
        (pipeline("gpt-tiny", 4, stage((0, 1)), stage((1, 2)), stage((2, 3)), stage((3, 4))), "1f1b"),
        # stages differ in dp, tp and micro-batch
        (pipeline("llama-tiny", 2, stage((0, 2), dp=2), stage((2, 4), tp=2)), "1f1b"),
        (pipeline("llama-tiny", 2, stage((0, 1), tp=2), stage((1, 3), dp=1), stage((3, 4), dp=1)), "gpipe"),
        # tied embedding/head across stages, the first stage's weights sharded (ZeRO-3)
        (pipeline("tests.test_backend_engine:tied_gpt", 2, stage((0, 2), dp=2, zero=3), stage((2, 4), dp=2)), "1f1b"),
    ]
    run_cases(4, cases)
