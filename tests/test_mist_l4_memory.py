"""benchmarks/mist_l4_memory.py: Mist's published L4 plans priced by our cost model. Compiled units save what
Mist's fused kernels save, so its LLaMA plans fit an L4 again, within a few percent of what Mist measured;
priced as eager autograd saves (two fp32 copies per RMSNorm, silu(gate)) the first stage does not fit."""
from __future__ import annotations

from benchmarks.mist_l4_memory import MIB, PLANS, compare


def test_the_table_holds_mists_ten_published_l4_plans():
    assert len(PLANS) == 10
    for plan in PLANS:
        built = plan.plan()  # global batch = micro-batch x DP x G on every stage, layers contiguous
        assert len(built.stages) == len(plan.measured_mib) and "Dazz993/Mist" in plan.source
        assert built.num_layers == {"gpt2-1.3b": 24, "gpt2-2.7b": 32, "gpt2-7b": 32, "llama-1.3b": 24,
                                    "llama-2.7b": 32, "llama-7b": 32}[plan.model]


def test_a_llama_plan_fits_compiled_and_not_eager():
    plan = next(p for p in PLANS if p.name == "llama-1.3b flash")
    compiled = compare([plan], compiled=True)
    assert all(row.fits for row in compiled)
    assert max(abs(row.error) for row in compiled) < 0.05, [(row.predicted / MIB, row.measured / MIB) for row in compiled]
    eager = compare([plan], compiled=False)
    assert not eager[0].fits and eager[0].error > 0.15
