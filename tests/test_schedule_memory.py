"""What a rank running several chunks (interleaved, ZB-V) holds, and how the cost model prices it."""
from __future__ import annotations

import gc
import weakref

import numpy as np
import torch

from mist_compiler.cost.schedule_memory import ChunkMemory, group_peaks
from mist_compiler.ir.plan import Plan
from mist_compiler.ir.schedule import build_schedule
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


# ----------------------------------------------------------------------------- the walk over a schedule's actions

def _memory(virtual: int, **values) -> ChunkMemory:
    """Every part zero but those given (per virtual stage, one candidate); ``working``: every backward's."""
    parts = {name: np.zeros((virtual, 1)) for name in ("static", "first", "middle", "last", "input_half",
                                                       "weight_half", "held", "stash", "accumulators", "reduced")}
    for name, per_stage in values.items():
        for part in (("first", "middle", "last") if name == "working" else (name,)):
            parts[part] = np.asarray(per_stage, dtype=float).reshape(virtual, 1)
    return ChunkMemory(**parts)


def test_one_chunk_walk_is_the_1f1b_rule():
    """1F1B: the peak at one micro-batch in flight plus what the other min(S - s, G) - 1 keep."""
    schedule = build_schedule("1f1b", 4, 1, 8)
    memory = _memory(4, static=[100, 90, 80, 70], working=[10, 11, 12, 13], held=[5, 6, 7, 8])
    peaks = group_peaks(schedule, memory, np.zeros((4, 1)))[:, 0]
    expected = [static + working + (min(4 - s, 8) - 1) * held
                for s, (static, working, held) in enumerate(zip([100, 90, 80, 70], [10, 11, 12, 13], [5, 6, 7, 8]))]
    np.testing.assert_allclose(peaks, expected)


def test_each_chunk_keeps_its_own_micro_batches_from_forward_to_backward():
    """Interleaved, 2 stages, 2 chunks, 4 micro-batches: stage 0 runs F0.0 F0.1 F1.0 F1.1 F0.2 B1.0 F0.3
    ... so it holds four of its first chunk's micro-batches and one of its second's (not 2.5 of both)."""
    schedule = build_schedule("interleaved", 2, 2, 4)
    assert [f"{a.kind}{a.chunk}.{a.micro}" for a in schedule.compute(0)][:7] == \
        ["F0.0", "F0.1", "F1.0", "F1.1", "F0.2", "B1.0", "F0.3"]
    held = [10.0, 1.0, 1.0, 1.0]  # virtual stages 0 and 2 on stage 0, 1 and 3 on stage 1
    peaks = group_peaks(schedule, _memory(4, held=held), np.zeros((2, 1)))[:, 0]
    assert peaks[0] == 4 * 10 + 1


def test_another_chunks_gradients_count_from_its_first_backward():
    """A chunk's accumulators exist from its first backward, what it keeps for the step from its last:
    stage 1 of the interleaved schedule peaks in its second chunk's last backward with the first chunk
    still accumulating."""
    schedule = build_schedule("interleaved", 2, 2, 4)
    memory = _memory(4, static=[0, 3, 0, 4], working=[0, 0, 0, 100], accumulators=[0, 20, 0, 0], reduced=[0, 5, 0, 0])
    peaks = group_peaks(schedule, memory, np.zeros((2, 1)))[:, 0]
    assert peaks[1] == 3 + 4 + 20 + 100  # B1.3 runs after B0.0 and before B0.3
    step = np.array([[0.0], [1000.0]])
    assert group_peaks(schedule, memory, step)[1, 0] == 1000.0  # the optimizer step's point, where it is higher


def test_a_weight_half_keeps_its_stash_from_input_half_to_weight_half():
    """ZB-H1's last stage runs F0 I0 F1 I1 W0 ...: two micro-batches' stashes at once."""
    schedule = build_schedule("zb-h1", 2, 1, 4)
    assert [f"{a.kind}{a.micro}" for a in schedule.compute(1)][:5] == ["F0", "I0", "F1", "I1", "W0"]
    memory = _memory(2, held=[1, 1], stash=[10, 10], weight_half=[10, 10])  # (working 0: the stash alone)
    peaks = group_peaks(schedule, memory, np.zeros((2, 1)))[:, 0]
    assert peaks[1] == 10 + 10
    assert peaks[0] == 1 + 10  # stage 0: F0 F1 I0 W0 ...: one stash and one micro-batch's activations


def test_a_backward_is_priced_by_its_place_in_the_step():
    """1F1B over 2 micro-batches, stage 0 runs F0 F1 B0 B1: its first backward (no accumulators yet)
    beside the second micro-batch, its last one (gradients reduced) alone."""
    schedule = build_schedule("1f1b", 2, 1, 2)
    memory = _memory(2, held=[3, 3], first=[5, 5], last=[12, 12])
    assert group_peaks(schedule, memory, np.zeros((2, 1)))[0, 0] == 12  # not 3 + 12


def test_price_plan_walks_each_chunk(gpt_tiny_program):
    """A 1F1B plan keeps the stage model's rule; a two-chunk group is priced per chunk: more than
    either chunk alone, each chunk's weights and states counted once."""
    from mist_compiler.cost.hardware import load_profile
    from mist_compiler.cost.schedule import price_plan
    from mist_compiler.cost.stage_model import build_stage_cost_model

    model = build_stage_cost_model(gpt_tiny_program, load_profile("cpu"), seq_len=32)
    one = Plan.from_dict(plan_dict("gpt-tiny", 8, 4, [stage((0, 2)), stage((2, 4))], seq=32))
    price = price_plan(model, one)
    slope = []
    for group in range(2):
        at = [model.evaluate(_candidates_of(one, group, inflight)).peak_memory_bytes[0] for inflight in (1, 2)]
        slope.append(at[0] + (2 - group - 1) * (at[1] - at[0]))
    np.testing.assert_allclose(price.peak_memory_bytes, slope, rtol=1e-9)
    two = Plan.from_dict({**plan_dict("gpt-tiny", 8, 4, [stage((i, i + 1)) for i in range(4)], seq=32),
                          "schedule": "interleaved", "virtual_stages": 2})
    price = price_plan(model, two)
    for group in range(2):
        chunks = two.chunks(group)
        own = [float(price.chunks.peak_memory_bytes[j]) for j in chunks]
        assert price.peak_memory_bytes[group] > max(own)


def _candidates_of(plan: Plan, group: int, inflight: int):
    """The group of devices ``group`` of a one-chunk plan as the stage model's candidate."""
    from mist_compiler.cost.schedule import _candidates, group_stages

    groups, pre, post = group_stages(plan)
    candidates = _candidates(plan, [groups[group]], [pre[group]], [post[group]])
    candidates.inflight = np.array([inflight])
    return candidates
