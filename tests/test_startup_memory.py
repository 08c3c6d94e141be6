"""Start-up builds no weight a rank does not own, and holds at most one unit's weights in flight.

The engine is given the model by name, as ``mistc run`` does; a recording tensor source stands in
for the meta-device initialiser and notes which tensors are made, and, each time one is made, how
many bytes the stage's parameters hold then. Under ZeRO-3 a rank keeps only its shard, so its
parameters hold nothing between units. The measured figures for a gpt2-7b plan are in
``benchmarks/startup_memory.py``.
"""
from __future__ import annotations

import pytest

from mist_compiler.launch.local_ranks import run_ranks

PLAN = {"model": "gpt-tiny", "seq_len": 16, "global_batch": 4, "dtype": "float32", "grad_accum": 2,
        "stages": [{"layers": [0, 2], "nodes": 1, "gpus_per_node": 2, "micro_batch": 1, "dp": 2, "tp": 1, "zero": 3},
                   {"layers": [2, 4], "nodes": 1, "gpus_per_node": 2, "micro_batch": 2, "dp": 1, "tp": 2, "zero": 1}]}


def _start(rank: int, world: int) -> dict:
    import gc

    from torch import nn
    from torch._subclasses.fake_tensor import is_fake

    from mist_compiler.ir.model_graph import PARAMETER
    from mist_compiler.ir.plan import Plan
    from mist_compiler.lowering.materialize import InitTensors
    from mist_compiler import compile as compile_plan

    class Recording(InitTensors):
        def __init__(self, *args):
            super().__init__(*args)
            self.made: list[str] = []
            self.most_held = 0  # bytes the parameters hold when a tensor is made

        def full(self, kind, name):
            if kind == PARAMETER:
                self.made.append(name)
                storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                            for p in gc.get_objects() if type(p) is nn.Parameter and not is_fake(p) and not p.is_meta}
                self.most_held = max(self.most_held, sum(storages.values()))
            return super().full(kind, name)

    plan = Plan.from_dict(PLAN)
    source = Recording(plan.model, plan.seq_len)
    engine = compile_plan(plan.model, plan, source=source, timeout_s=60)
    stage_fqns = set(engine.program.fqn.values())
    units = {name: sum(p.numel() for p in module.parameters()) for name, module in engine.program.units}
    engine.close()
    return {"made": source.made, "stage_fqns": sorted(stage_fqns), "whole_builds": source.whole_builds,
            "most_held": source.most_held, "zero": engine.stage_plan.zero, "stage_bytes": 4 * sum(units.values())}


@pytest.mark.distributed
def test_each_rank_makes_only_its_stage_weights_one_unit_at_a_time():
    results = run_ranks(_start, world=4, timeout_s=240)
    for rank, result in enumerate(results):
        assert result["whole_builds"] == 0, f"rank {rank} built the whole model"
        assert set(result["made"]) == set(result["stage_fqns"]), f"rank {rank} made weights outside its stage"
        assert len(result["made"]) == len(set(result["made"])), f"rank {rank} made a weight twice"
        assert result["most_held"] <= result["stage_bytes"], result
        if result["zero"] == 3:  # between units a ZeRO-3 rank's parameters hold nothing (its shard is flat)
            assert result["most_held"] == 0, f"rank {rank} held {result['most_held']} bytes of weights while starting"
