"""Train plans on local gloo ranks and judge them with ``--check``'s comparison (shared by tests).

``run_plans(world, plans)`` trains each plan for ``STEPS`` steps on every rank (the model given by
name: built on the meta device and initialised shard by shard, as ``mistc run`` does) and returns,
per plan, the check's verdict against one-process training.
"""
from __future__ import annotations

from mist_compiler.launch.local_ranks import run_ranks

STEPS = 3
LR = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-6, "weight_decay": 0.1}
SEQ = 16


def stage(layers, dp=1, tp=1, micro_batch=None, **extra) -> dict:
    return {"layers": list(layers), "nodes": 1, "gpus_per_node": dp * tp, "micro_batch": micro_batch, "dp": dp,
            "tp": tp, **extra}


def plan_dict(model: str, global_batch: int, grad_accum: int, stages: list, seq: int = SEQ,
              dtype: str = "float32") -> dict:
    for s in stages:
        if s["micro_batch"] is None:
            s["micro_batch"] = global_batch // (grad_accum * s["dp"])
    return {"model": model, "seq_len": seq, "global_batch": global_batch, "dtype": dtype,
            "grad_accum": grad_accum, "stages": stages}


def train_and_check(rank: int, world: int, plans: list[dict], by_module: bool = False, sabotage=None) -> list:
    """On every rank: train each plan; rank 0 returns each verdict (as a dict)."""
    from mist_compiler import driver
    from mist_compiler.ir.plan import Plan
    from mist_compiler.models import build_model
    from mist_compiler.runtime.optimizer import AdamWConfig
    from mist_compiler.verify.check import vocab_size

    results = []
    for data in plans:
        plan = Plan.from_dict(data)
        model = build_model(plan.model, seq_len=plan.seq_len) if by_module else plan.model
        compiled = driver.compile_model(model, plan=plan, optimizer=AdamWConfig(**LR), timeout_s=90)
        engine = compiled.engine
        if sabotage is not None:
            sabotage(engine)
        verdict = train_engine_and_check(engine, plan, vocab_size(compiled.program), rank)
        if verdict is not None:
            results.append({"stages": data["stages"], "ok": verdict.ok, "line": verdict.line(),
                            "ratio": verdict.worst_ratio})
    return results


def train_engine_and_check(engine, plan, vocab: int, rank: int, lr: dict = LR, steps: int = STEPS):
    """Train ``engine`` for ``steps`` steps (first-step gradients and final weights gathered), close it;
    (``lr``: the optimizer settings it trained with) rank 0 returns ``--check``'s verdict against one-process training, the others None."""
    from mist_compiler.verify.check import Run, check_run, synthetic_batch

    batches = [synthetic_batch(vocab, plan.global_batch, plan.seq_len, s) for s in range(steps)]
    losses, gradients = [], None
    for step, batch in enumerate(batches):
        losses.append(engine.forward_backward(batch))
        if step == 0:
            gradients = engine.gather_full_gradients()
        engine.optimizer_step()
    weights = engine.gather_full_state()
    engine.close()
    return check_run(plan.model, plan, batches, Run(losses, gradients, weights), lr) if rank == 0 else None


def run_plans(world: int, plans: list[dict], timeout_s: float = 300, **options) -> list[dict]:
    return run_ranks(train_and_check, world=world, args=(plans, options.get("by_module", False),
                                                          options.get("sabotage")), timeout_s=timeout_s)[0]


def assert_all_pass(results: list[dict]) -> None:
    bad = [(r["stages"], r["line"]) for r in results if not r["ok"]]
    assert not bad, f"plans differ from one-process training beyond rounding: {bad}"
