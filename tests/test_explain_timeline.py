"""The predicted timeline: every schedule's actions in order, dependencies held, 1F1B agreeing with
the tuner's closed form on equal stages."""
from __future__ import annotations

import numpy as np
import pytest

from mist_compiler.cost.schedule import ChunkCosts, simulate
from mist_compiler.cost.stage_api import pipeline_iteration_time
from mist_compiler.ir.schedule import build_schedule
from mist_compiler.tuner.timeline import chrome_trace, iteration_time, timeline_slots


def slots_of(name: str, stages: int, virtual: int, micro_batches: int, forward=1.0, backward=2.0, weight=0.6,
             delta=0.5, transfer=0.0):
    schedule = build_schedule(name, stages, virtual, micro_batches)
    count = stages * virtual
    column = lambda value: np.full((count, 1), value)  # noqa: E731
    costs = ChunkCosts(column(forward / virtual), column(backward / virtual),
                       column(weight / virtual if schedule.split_backward else 0.0), column(transfer), column(1.0),
                       column(0.5))
    simulation = simulate(schedule, costs, np.full((stages, 1), delta), spans=True)
    return schedule, timeline_slots(simulation, np.full(stages, delta))


def test_single_stage_is_g_micro_batches_plus_step():
    _, slots = slots_of("1f1b", 1, 1, 4)
    assert iteration_time(slots) == pytest.approx(4 * 3.0 + 0.5)


@pytest.mark.parametrize("stages,micro_batches", [(2, 4), (4, 8), (4, 2), (3, 3)])
def test_equal_stages_match_the_formula(stages, micro_batches):
    _, slots = slots_of("1f1b", stages, 1, micro_batches, delta=0.7)
    formula = pipeline_iteration_time([3.0] * stages, [0.7] * stages, micro_batches)
    assert iteration_time(slots) == pytest.approx(formula)


@pytest.mark.parametrize("name,virtual", [("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("zbv", 2)])
def test_every_action_in_order_and_dependencies_hold(name, virtual):
    schedule, slots = slots_of(name, 3, virtual, 6, transfer=0.05)
    end: dict = {}
    for slot in slots:
        if slot.kind != "step":
            end[(slot.kind, schedule.virtual_stage(slot.stage, slot.chunk), slot.micro_batch)] = slot
    last = schedule.num_virtual - 1
    for (kind, j, micro), slot in end.items():
        if kind == "F" and j > 0:
            assert slot.start_s >= end[("F", j - 1, micro)].end_s - 1e-12
        if kind in "BI" and j < last:
            before = end.get(("B", j + 1, micro)) or end[("I", j + 1, micro)]
            assert slot.start_s >= before.end_s - 1e-12
        if kind == "W":
            assert slot.start_s >= end[("I", j, micro)].end_s - 1e-12
    for stage in range(3):
        own = [s for s in slots if s.stage == stage]
        assert [(s.kind, s.chunk, s.micro_batch) for s in own[:-1]] == \
               [(a.kind, a.chunk, a.micro) for a in schedule.compute(stage)]
        assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(own, own[1:]))


def test_zero_bubble_beats_one_f_one_b_and_interleaving_shrinks_the_bubble():
    one = iteration_time(slots_of("1f1b", 4, 1, 8)[1])
    assert iteration_time(slots_of("zb-h1", 4, 1, 8)[1]) < one
    assert iteration_time(slots_of("zbv", 4, 2, 8)[1]) < one
    assert iteration_time(slots_of("interleaved", 4, 2, 8)[1]) < one


def test_chrome_trace_events_are_complete_slots():
    _, slots = slots_of("zb-h1", 2, 1, 2)
    trace = chrome_trace(slots)
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 2 * (3 * 2 + 1)
    assert all(e["dur"] > 0 and e["ts"] >= 0 for e in events)
    assert {e["cat"] for e in events} == {"forward", "backward (input half)", "backward (weight half)", "step"}
