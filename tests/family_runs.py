"""One family of the Hugging Face matrix on two local ranks (``tests/test_hf_models.py``).

:func:`run_family` captures the model once per rank, tunes it for the two ranks (rank 0, as
``mistc tune`` does), then trains a data-parallel, a tensor-parallel and a pipeline plan from that
one capture and judges each with ``--check``'s comparison against one-process training. A plan the
pre-launch check refuses comes back with the refusal instead of a verdict.
"""
from __future__ import annotations

import time

from tests.plan_runs import LR, SEQ, plan_dict, stage, train_engine_and_check

GLOBAL_BATCH = 4


def family_plans(model: str, dtype: str = "float32", zero: int = 0) -> dict[str, dict]:
    """DP=2, TP=2 and PP=2 plans of a 3-layer model on two ranks."""
    return {"dp": plan_dict(model, GLOBAL_BATCH, 1, [stage((0, 3), dp=2, zero=zero)], dtype=dtype),
            "tp": plan_dict(model, GLOBAL_BATCH, 2, [stage((0, 3), tp=2, zero=zero)], dtype=dtype),
            "pp": plan_dict(model, GLOBAL_BATCH, 2, [stage((0, 1), zero=zero), stage((1, 3), zero=zero)], dtype=dtype)}


def run_family(rank: int, world: int, model: str, plans: dict[str, dict], tune: bool, steps: int) -> dict:
    """On every rank: (rank 0) tune, then train each plan; rank 0 returns what happened, by plan."""
    from mist_compiler import driver
    from mist_compiler.ir.plan import Plan, PlanError
    from mist_compiler.runtime.optimizer import AdamWConfig
    from mist_compiler.verify.check import vocab_size

    dtype = next(iter(plans.values()))["dtype"]
    started = time.perf_counter()
    program = driver.capture(model, dtype=dtype, seq_len=SEQ, analyse=tune and rank == 0)
    outcome: dict = {"seconds": {"capture": time.perf_counter() - started}}
    if tune and rank == 0:
        started = time.perf_counter()
        tuned = driver.compile_model(model, program=program, hardware="cpu", nodes=1, gpus_per_node=world,
                                     global_batch=GLOBAL_BATCH, seq_len=SEQ, dtype=dtype, until="plan")
        outcome["tune"] = {"world": tuned.plan.world_size, "layers": tuned.plan.num_layers,
                           "tp_granularity": tuned.cost_model.tp_granularity,
                           "tp": program.model_graph.tp.supported, "reason": program.model_graph.tp.reason}
        outcome["seconds"]["tune"] = time.perf_counter() - started
    for name, data in plans.items():
        outcome["seconds"][name] = -time.perf_counter()
        plan = Plan.from_dict(data)
        try:
            compiled = driver.compile_model(model, plan=plan, program=program, optimizer=AdamWConfig(**LR),
                                            timeout_s=90)
        except PlanError as refusal:  # both ranks refuse the same plan before any collective
            outcome[name] = {"ok": False, "refused": str(refusal)}
            outcome["seconds"][name] += time.perf_counter()
            continue
        verdict = train_engine_and_check(compiled.engine, plan, vocab_size(program), rank, steps=steps)
        if verdict is not None:
            outcome[name] = {"ok": verdict.ok, "line": verdict.line(), "ratio": verdict.worst_ratio,
                             "worst": verdict.details}
        outcome["seconds"][name] += time.perf_counter()
    return outcome
