"""Mist's base case (FACTS.md): our prediction of its plan stays within 3% of what Mist's runtime
measured, and the same cost-model formulas match our runtime on a CPU-sized copy of the plan."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIST_MEASURED_MB = 19_273.83


def test_mistc_analyze_predicts_the_base_case_within_3_percent_of_mist():
    plan = os.path.join(ROOT, "benchmarks", "plans", "mist-base-case.json")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "mist_compiler.cli", "analyze", "gpt2-1.3b", "--plan", plan,
                           "--hardware", "l4", "--attention", "math", "--json"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]  # 0: it fits in an L4
    [stage] = json.loads(proc.stdout)["stages"]
    assert stage["peak_memory_mb"] <= MIST_MEASURED_MB * 1.03, stage
    parts = stage["memory_mb"]  # what Mist keeps: fp16 weights and gradients, 12 bytes of optimizer per 2 ranks
    assert parts["params"] == pytest.approx(parts["grads"], rel=1e-3)
    assert parts["opt"] == pytest.approx(3 * parts["params"], rel=1e-3)


@pytest.mark.distributed
def test_the_base_case_in_miniature_runs_as_predicted():
    """The base plan's shape on 2 gloo ranks (bf16, DP 2, ZeRO-1, every layer checkpointed, math
    attention, 2 micro-batches, low-precision gradients): measured peak within 1% of the model's."""
    from benchmarks.prediction_accuracy import PlanConfig, StageSpec, measure_plan, predict_plan
    from mist_compiler.cost.hardware import load_profile
    import dataclasses

    config = PlanConfig("gpt-small", 256, 16, 2, (StageSpec(4, dp=2, zero=1, ckpt=4),), "math", dtype="bfloat16",
                        grad_dtype="bfloat16")
    measured = measure_plan(config, timed_steps=0, measure_memory=True)
    predicted = predict_plan(config, dataclasses.replace(load_profile("cpu"), gpus_per_node=2))
    assert predicted.peak_bytes / measured.peak_bytes == pytest.approx(1.0, abs=0.01)


@pytest.mark.parametrize("grad_dtype", ["float32", "float16"])
def test_tuned_plan_is_no_slower_than_mists_tuned_plan(grad_dtype):
    """`mistc tune` on the case against Mist's own tuned plan (2 stages of 12 layers, G=16,
    micro-batch 2, 5 checkpointed layers in stage 0), both priced by our model with the same
    gradient dtype (Mist keeps fp16 gradients: --grad-dtype float16 is its setting)."""
    import mist_compiler
    from mist_compiler.ir.plan import Plan

    with open(os.path.join(ROOT, "benchmarks", "plans", "mist-tuned.json")) as handle:
        data = json.load(handle)
    data["grad_dtype"] = grad_dtype
    mist = mist_compiler.analyze("gpt2-1.3b", Plan.from_dict(data), "l4", attention="math")
    assert mist.fits
    ours = mist_compiler.tune("gpt2-1.3b", "l4", nodes=1, gpus_per_node=2, global_batch=32, seq_len=2048,
                              attention="math", dtype="float16", grad_dtype=grad_dtype)
    assert ours.plan.grad_dtype == grad_dtype
    assert ours.predicted_time_s <= mist.iteration_time_s
