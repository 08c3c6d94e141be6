"""What a rank running several chunks (interleaved, ZB-V) holds, and how the cost model prices it."""
from __future__ import annotations

import gc
import weakref

import torch

from mist_compiler.ir.plan import Plan
from mist_compiler.ir.topology import RankCoord
from mist_compiler.lowering.lower import lower
from mist_compiler.lowering.materialize import ModuleTensors
from mist_compiler.models import build_model
from tests.plan_runs import plan_dict, stage


def test_a_rank_of_two_chunks_lets_the_model_go_once_its_weights_are_made(gpt_tiny_program):
    """Each chunk's table of parameters still to make is the rank's: once the runtime has made them
    all, nothing keeps the weight source (here the whole model) alive."""
    data = plan_dict("gpt-tiny", 8, 4, [stage((i, i + 1)) for i in range(4)])
    plan = Plan.from_dict({**data, "schedule": "interleaved", "virtual_stages": 2})
    model = build_model("gpt-tiny", seq_len=plan.seq_len)
    gone = weakref.ref(next(model.parameters()))
    built = lower(gpt_tiny_program, plan, RankCoord(0, 0, 0), ModuleTensors(model), device=torch.device("cpu"))
    assert len(built.chunk_programs) == 2
    for _, unit in built.units:
        for param in unit.parameters():
            built.initial_value(param)  # what the runtime does as it lays each unit out
    del model
    gc.collect()
    assert all(not chunk.deferred for chunk in built.chunk_programs)
    assert gone() is None
