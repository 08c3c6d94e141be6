"""End-to-end: plans executed on gloo ranks give the losses and weights of one-process training."""
from __future__ import annotations

import os

import pytest
import torch

from mist_compiler.ir.plan import Plan
from tests.plan_runs import assert_all_pass, run_plans

SEQ = 16
LR = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": float(os.environ.get("MIST_TEST_EPS", "1e-6")), "weight_decay": 0.1}


def stage(layers, dp=1, tp=1, micro_batch=None, **extra):
    return {"layers": list(layers), "nodes": 1, "gpus_per_node": dp * tp, "micro_batch": micro_batch, "dp": dp,
            "tp": tp, **extra}


def plan_dict(model, global_batch, grad_accum, stages):
    for s in stages:
        if s["micro_batch"] is None:
            s["micro_batch"] = global_batch // (grad_accum * s["dp"])
    return {"model": model, "seq_len": SEQ, "global_batch": global_batch, "dtype": "float32",
            "grad_accum": grad_accum, "stages": stages}


def offload(**ratios):
    return {"weights": 0.0, "grads": 0.0, "opt": 0.0, "acts": 0.0, **ratios}


def matrix_plans(world):
    """One plan per feature the backend implements, on ``world`` ranks (gpt-tiny / llama-tiny)."""
    dp = world
    plans = [
        plan_dict("gpt-tiny", 8, 2, [stage((0, 4), dp=dp)]),                                    # DP
        plan_dict("gpt-tiny", 8, 2, [stage((0, 4), dp=dp, zero=1)]),                            # ZeRO-1
        plan_dict("llama-tiny", 8, 2, [stage((0, 4), dp=dp, zero=2)]),                          # ZeRO-2
        plan_dict("gpt-tiny", 8, 2, [stage((0, 4), dp=dp, zero=3)]),                            # ZeRO-3
        plan_dict("llama-tiny", 8, 2, [stage((0, 4), dp=world // 2, tp=2)]),                    # TP=2
        plan_dict("gpt-tiny", 8, 4, [stage((0, 2), dp=world // 2), stage((2, 4), dp=world // 2)]),  # PP=2
        plan_dict("gpt-tiny", 8, 2, [stage((0, 4), dp=dp, ckpt_layers=3)]),                     # checkpointing
    ]
    for kind in ("weights", "grads", "opt", "acts"):                                             # each offload kind
        plans.append(plan_dict("gpt-tiny", 8, 2, [stage((0, 4), dp=dp, zero=2, offload=offload(**{kind: 0.5}))]))
    return plans


def mixed_plan():
    """PP=2 x DP=2 with ZeRO-2, some checkpointed layers and partial offload (4 ranks)."""
    return plan_dict("llama-tiny", 8, 2, [
        stage((0, 2), dp=2, zero=2, ckpt_layers=1, offload=offload(weights=0.5, opt=0.25, acts=0.5)),
        stage((2, 4), dp=2, zero=2, ckpt_layers=2, offload=offload(grads=0.5)),
    ])


def report(results):
    for r in results:
        print(r["line"], r["stages"])


def assert_all_match(results):
    assert_all_pass(results)


@pytest.mark.distributed
def test_every_plan_kind_matches_single_process_on_two_ranks():
    results = run_plans(2, matrix_plans(2))
    report(results)
    assert_all_match(results)


@pytest.mark.distributed
def test_mixed_and_heterogeneous_plans_match_single_process_on_four_ranks():
    plans = [
        mixed_plan(),
        # stages differ in dp, tp and micro_batch
        plan_dict("llama-tiny", 8, 2, [stage((0, 1), dp=2, tp=1), stage((1, 4), dp=1, tp=2)]),
        # tied embedding/head across stages
        plan_dict("tests.test_backend_engine:tied_gpt", 8, 2, [stage((0, 2), dp=2), stage((2, 4), dp=2)]),
        # ... and in one ZeRO-3 stage: the head's unit, owning no parameter, borrows the embedding's
        plan_dict("tests.test_backend_engine:tied_gpt", 8, 2, [stage((0, 4), dp=4, zero=3, ckpt_layers=2)]),
    ]
    results = run_plans(4, plans)
    report(results)
    assert_all_match(results)


@pytest.mark.distributed
@pytest.mark.heavy
def test_every_plan_kind_matches_single_process_on_four_ranks():
    plans = matrix_plans(4) + [
        plan_dict("gpt-tiny", 8, 2, [stage((0, 3), dp=1, tp=2), stage((3, 4), dp=2, tp=1)]),
        plan_dict("gpt-tiny", 8, 2, [stage((0, 1)), stage((1, 2)), stage((2, 3)), stage((3, 4))]),
    ]
    results = run_plans(4, plans, timeout_s=600)
    report(results)
    assert_all_match(results)


def tied_gpt():
    """gpt-tiny with the head tied to the token embedding (for the tied-weights plans)."""
    from dataclasses import replace

    from mist_compiler.models import TransformerLM, zoo_config

    torch.manual_seed(0)
    return TransformerLM(replace(zoo_config("gpt-tiny"), tied_head=True))


