"""The predicted 1F1B timeline: schedule order, dependencies and agreement with the tuner's formula."""
from __future__ import annotations

import pytest

from mist_compiler.cost.stage_api import pipeline_iteration_time
from mist_compiler.tuner.timeline import chrome_trace, iteration_time, one_f_one_b_order, simulate


def test_one_f_one_b_order_warms_up_then_alternates():
    assert one_f_one_b_order(0, 3, 4) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)]
    assert one_f_one_b_order(2, 3, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]


def test_single_stage_is_g_micro_batches_plus_step():
    slots = simulate([1.0], [2.0], [0.5], 4)
    assert iteration_time(slots) == pytest.approx(4 * 3.0 + 0.5)


@pytest.mark.parametrize("stages,micro_batches", [(2, 4), (4, 8), (4, 2), (3, 3)])
def test_equal_stages_match_the_formula(stages, micro_batches):
    forward, backward, delta = 1.0, 2.0, 0.7
    slots = simulate([forward] * stages, [backward] * stages, [delta] * stages, micro_batches)
    formula = pipeline_iteration_time([forward + backward] * stages, [delta] * stages, micro_batches)
    assert iteration_time(slots) == pytest.approx(formula)


def test_dependencies_hold():
    slots = simulate([1.0, 0.5, 2.0], [1.5, 1.0, 3.0], [0.1, 0.1, 0.1], 5)
    end = {(s.kind, s.stage, s.micro_batch): s for s in slots}
    for s in slots:
        if s.kind == "F" and s.stage > 0:
            assert s.start_s >= end[("F", s.stage - 1, s.micro_batch)].end_s - 1e-12
        if s.kind == "B" and s.stage < 2:
            assert s.start_s >= end[("B", s.stage + 1, s.micro_batch)].end_s - 1e-12
    for stage in range(3):
        own = sorted((s for s in slots if s.stage == stage), key=lambda s: s.start_s)
        assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(own, own[1:]))


def test_chrome_trace_events_are_complete_slots():
    trace = chrome_trace(simulate([1.0, 1.0], [2.0, 2.0], [0.5, 0.5], 2))
    slots = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(slots) == 2 * (2 * 2 + 1)
    assert all(e["dur"] > 0 and e["ts"] >= 0 for e in slots)
