"""Pipeline schedules as data (ir/schedule.py), their simulation (cost/schedule.py), the plan keys
that name them, the backward split (passes/weight_gradients.py, lowering/split_backward.py) and the
tuner's schedule search."""
from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from mist_compiler.cost.schedule import ChunkCosts, chunk_costs, held_activations, least_iteration_s, simulate
from mist_compiler.ir.plan import Plan, PlanError
from mist_compiler.ir.schedule import (B, I, W, SCHEDULES, ScheduleError, build_schedule, check_schedule,
                                       exchange_plan, placement)
from mist_compiler.lowering.split_backward import (SplitBackward, WeightGradQueue, lift_parameters,
                                                   split_unit_graph)

CASES = [("1f1b", 1), ("gpipe", 1), ("zb-h1", 1), ("interleaved", 2), ("interleaved", 3), ("zbv", 2)]


def schedules():
    for name, v in CASES:
        for pp in (1, 2, 3, 4):
            for g in (1, 2, 3, 4, 6, 8, 12):
                try:
                    yield build_schedule(name, pp, v, g)
                except ScheduleError:
                    continue


def test_every_action_runs_once_and_after_what_it_needs():
    for schedule in schedules():
        seen = {}
        for stage in range(schedule.stages):
            kinds = {a.kind for a in schedule.compute(stage)}
            assert (B in kinds) != (I in kinds and W in kinds) or not kinds  # whole or split backwards, never both
            for position, action in enumerate(schedule.compute(stage)):
                key = (action.kind, schedule.virtual_stage(stage, action.chunk), action.micro)
                assert key not in seen
                seen[key] = (stage, position)
            assert schedule.actions[stage][-1].kind == "STEP"
        halves = (I, W) if schedule.split_backward else (B,)
        expected = {(kind, j, m) for kind in ("F",) + halves for j in range(schedule.num_virtual)
                    for m in range(schedule.micro_batches)}
        assert set(seen) == expected, schedule.name
        for (kind, j, m), (stage, position) in seen.items():  # on one stage: after its own forward / input half
            own = [("F", j, m)] if kind in ("B", "I") else [("I", j, m)] if kind == "W" else []
            for other in own:
                assert seen[other][0] == stage and seen[other][1] < position


def test_exchanges_complete_for_every_schedule():
    for schedule in schedules():
        assert check_schedule(schedule) is None, (schedule.name, schedule.stages, schedule.virtual, schedule.micro_batches)


def test_a_channel_receives_in_the_order_its_sender_sends():
    schedule = build_schedule("interleaved", 2, 2, 4)  # the second stage wraps back to the first
    plan = exchange_plan(schedule)
    sent = [p.message for exchange in plan[1] for p in exchange if p.send and p.peer == 0]
    received = [p.message for exchange in plan[0] for p in exchange if not p.send and p.peer == 1]
    assert sent == received and len(sent) > 0


def test_placements():
    assert placement("interleaved", 3, 2) == (0, 1, 2, 0, 1, 2)
    assert placement("zbv", 3, 2) == (0, 1, 2, 2, 1, 0)
    with pytest.raises(ScheduleError, match="multiple of the 3 stages"):
        build_schedule("interleaved", 3, 2, 4)
    with pytest.raises(ScheduleError, match="runs 2 virtual stage"):
        build_schedule("zbv", 2, 3, 4)


def unit_costs(schedule, forward=1.0, backward=2.0, weight=0.7, transfer=0.0, stash=0.6):
    count = schedule.num_virtual
    column = lambda value: np.full((count, 1), value)  # noqa: E731
    return ChunkCosts(column(forward / schedule.virtual), column(backward / schedule.virtual),
                      column(weight / schedule.virtual if schedule.split_backward else 0.0), column(transfer),
                      column(1.0 / schedule.virtual), column(stash / schedule.virtual if schedule.split_backward else 0.0))


@pytest.mark.parametrize("pp,g", [(2, 8), (4, 8), (4, 16), (8, 16)])
def test_simulated_bubbles(pp, g):
    """1F1B matches its closed form; zero-bubble and interleaved schedules shrink the bubble."""
    times = {}
    for name, v in [("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("zbv", 2)]:
        schedule = build_schedule(name, pp, v, g)
        times[name] = float(simulate(schedule, unit_costs(schedule), np.zeros((pp, 1))).time_s[0])
    assert times["1f1b"] == pytest.approx((g + pp - 1) * 3.0)
    work = g * 3.0
    assert times["zb-h1"] < times["1f1b"] and times["zb-h1"] <= work + (pp - 1) * 3.0 * 0.75
    assert times["zbv"] < times["1f1b"] and times["interleaved"] < times["1f1b"]


def test_in_flight_activations():
    one = build_schedule("1f1b", 4, 1, 8)
    _, inflight = held_activations(one, np.ones((4, 1)), np.zeros((4, 1)))
    assert inflight[:, 0].tolist() == [4, 3, 2, 1]  # what the stage model assumes for 1F1B
    zb = build_schedule("zb-h1", 4, 1, 8)
    held, inflight = held_activations(zb, np.ones((4, 1)), np.full((4, 1), 0.5))
    assert inflight[:, 0].max() <= 4 + 1e-9  # within 1F1B's first-stage peak
    inter = build_schedule("interleaved", 4, 2, 8)
    _, inflight = held_activations(inter, np.full((8, 1), 0.5), np.zeros((8, 1)))
    assert inflight[0, 0] > 4  # interleaving keeps more in flight on the first stage


def plan_data(**changes):
    stage = lambda a, b: {"layers": [a, b], "nodes": 1, "gpus_per_node": 1, "micro_batch": 2, "dp": 1, "tp": 1}  # noqa: E731
    data = {"model": "m", "seq_len": 8, "global_batch": 8, "dtype": "float32", "grad_accum": 4,
            "stages": [stage(0, 1), stage(1, 2), stage(2, 3), stage(3, 4)]}
    data.update(changes)
    return data


def test_plan_keys_name_the_schedule_and_old_plans_mean_1f1b():
    old = Plan.from_dict(plan_data())
    assert old.schedule == "1f1b" and old.virtual_stages == 1 and "schedule" not in old.to_dict()
    plan = Plan.from_dict(plan_data(schedule="interleaved", virtual_stages=2))
    assert plan.pp == 2 and plan.world_size == 2 and plan.chunks(1) == [1, 3]
    assert Plan.from_dict(plan.to_dict()) == plan
    zbv = Plan.from_dict(plan_data(schedule="zbv", virtual_stages=2))
    assert zbv.chunks(0) == [0, 3]


@pytest.mark.parametrize("changes,field", [
    ({"schedule": "zb-h2"}, "schedule"),
    ({"schedule": "interleaved"}, "virtual_stages"),
    ({"schedule": "interleaved", "virtual_stages": 3}, "virtual_stages"),  # 4 stages are not 3 chunks each
    ({"schedule": "interleaved", "virtual_stages": 2, "grad_accum": 3, "global_batch": 6}, "grad_accum"),
    ({"virtual_stages": 0}, "virtual_stages"),
])
def test_bad_schedule_keys_are_named(changes, field):
    data = plan_data(**changes)
    if "global_batch" in changes:
        for stage in data["stages"]:
            stage["micro_batch"] = 2
    with pytest.raises(PlanError, match=f"plan field {field}"):
        Plan.from_dict(data)


def test_chunks_must_repeat_their_device_group():
    data = plan_data(schedule="interleaved", virtual_stages=2)
    data["stages"][2]["dp"], data["stages"][2]["gpus_per_node"], data["stages"][2]["micro_batch"] = 2, 2, 1
    with pytest.raises(PlanError, match=r"stages\[2\]\.(gpus_per_node|dp|micro_batch): virtual stage 2 runs on the "
                                        r"devices of stage 0"):
        Plan.from_dict(data)


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.g, self.b = torch.nn.Parameter(torch.randn(16)), torch.nn.Parameter(torch.randn(16))
        self.w1, self.w2 = torch.nn.Parameter(torch.randn(32, 16) * 0.1), torch.nn.Parameter(torch.randn(16, 32) * 0.1)

    def forward(self, x, glue):
        return x + F.linear(F.gelu(F.linear(F.layer_norm(x, (16,), self.g, self.b), self.w1)), self.w2) * glue


def split_layer(queue):
    layer = Layer()
    graph = fx.symbolic_trace(layer)
    names = [n.target for n in graph.graph.nodes if n.op == "get_attr"]
    program = fx.GraphModule(graph, lift_parameters(graph.graph, names))
    root = {name: getattr(layer, name) for name in names}
    root["split"] = SplitBackward(program, len(names), "layer", queue)
    return layer, fx.GraphModule(root, split_unit_graph(graph.graph, names))


@pytest.mark.parametrize("defer", [False, True])
def test_split_backward_gives_eager_gradients(defer):
    torch.manual_seed(0)
    queue = WeightGradQueue()
    layer, split = split_layer(queue)
    reference = copy.deepcopy(layer)
    x = torch.randn(4, 8, 16, requires_grad=True)
    glue = torch.randn(8, 16)
    x_ref = x.detach().clone().requires_grad_()
    queue.defer, queue.key = defer, (0, 3)
    split(x, glue).pow(2).sum().backward()
    assert all((p.grad is None) == defer for p in split.parameters())
    for unit, run in queue.take((0, 3)):  # the weight halves, later
        assert unit == "layer"
        run()
    reference(x_ref, glue).pow(2).sum().backward()
    assert torch.allclose(x.grad, x_ref.grad, atol=1e-6)
    for mine, theirs in zip(split.parameters(), reference.parameters()):
        assert torch.allclose(mine.grad, theirs.grad, atol=1e-6)


def test_weight_gradient_analysis_of_a_layer():
    """A GPT layer's weight half is a real share of its backward, and keeps about a micro-batch of
    activations (inputs of the weight gradients and the output gradients of the linears)."""
    from mist_compiler import driver
    from mist_compiler.cost.stage_api import StageCandidates

    program, model = driver.price("gpt-tiny", "l4", seq_len=128)
    estimates = model.evaluate(StageCandidates(
        num_layers=np.array([1, 2]), has_pre=False, has_post=False, nodes=1, gpus_per_node=1, micro_batch=4, dp=1,
        tp=np.array([1, 2]), zero=0, ckpt_layers=0, offload_weights=0.0, offload_grads=0.0, offload_opt=0.0,
        offload_acts=0.0, inflight=1))
    parts = estimates.breakdown
    assert 0.15 < parts["backward_weight"][0] / parts["backward"][0] < 0.7
    assert 0.5 < parts["weight_stash"][0] / parts["acts_per_microbatch"][0] < 2.0
    assert parts["backward_weight"][1] == 0 and parts["weight_stash"][1] == 0  # tensor-parallel units keep it whole


def test_tuner_picks_a_zero_bubble_or_interleaved_plan_where_the_bubble_dominates():
    from mist_compiler import driver
    from mist_compiler.tuner.space import SearchSpace

    program, model = driver.price("gpt2-1.3b", "l4", seq_len=2048)
    space = SearchSpace(stage_counts=(4,), tp_degrees=(1,), grad_accum=(4,), offload_weights=False,
                        offload_grads=False)
    result = driver.tune(program, model, nodes=1, gpus_per_node=4, global_batch=16, seq_len=2048, space=space)
    assert result.plan.schedule != "1f1b"
    assert result.predicted_time_s < result.stats["one_f_one_b_s"] * 0.97
    only = driver.tune(program, model, nodes=1, gpus_per_node=4, global_batch=16, seq_len=2048,
                       space=space.restrict(schedules=("1f1b",)))
    assert only.plan.schedule == "1f1b" and result.predicted_time_s < only.predicted_time_s


def test_random_schedules_simulate_and_replay():
    rng = random.Random(0)
    for _ in range(30):
        name, v = rng.choice(CASES)
        pp = rng.randint(1, 5)
        g = pp * rng.randint(1, 3) if name == "interleaved" else rng.randint(1, 10)
        schedule = build_schedule(name, pp, v, g)
        assert check_schedule(schedule) is None
        costs = unit_costs(schedule, forward=rng.uniform(0.5, 2), backward=rng.uniform(1, 4), transfer=rng.uniform(0, 0.3))
        time = float(simulate(schedule, costs, np.zeros((pp, 1))).time_s[0])
        per_stage = g * (float(costs.forward[0, 0]) + float(costs.backward[0, 0])) * v
        assert per_stage - 1e-9 <= time


def test_the_tuners_lower_bound_never_exceeds_the_simulated_time():
    """``least_iteration_s`` lets the tuner skip simulating plans that cannot win: it must stay below
    the simulation for every schedule, with stages that differ in cost, transfers and steps."""
    rng = np.random.default_rng(1)
    tight = 0
    for schedule in schedules():
        for _ in range(3):
            n = schedule.num_virtual
            forward = rng.uniform(0.2, 3.0, (n, 1))
            backward = forward * rng.uniform(1.0, 3.0, (n, 1))
            weight = backward * rng.uniform(0.1, 0.5, (n, 1)) if schedule.split_backward else np.zeros((n, 1))
            costs = ChunkCosts(forward, backward, weight, rng.uniform(0.0, 0.5, (n, 1)), np.ones((n, 1)),
                               np.zeros((n, 1)))
            delta = rng.uniform(0.0, 2.0, (schedule.stages, 1))
            simulated = float(simulate(schedule, costs, delta).time_s[0])
            bound = least_iteration_s(schedule, costs, delta)
            assert bound <= simulated * (1 + 1e-12), (schedule.name, schedule.stages, schedule.virtual, bound, simulated)
            tight += bound >= simulated * 0.9
    assert tight > 50  # a bound far below every simulation would prune nothing


def test_every_message_over_a_cut_pays_its_own_latency():
    """A middle virtual stage sends over two cuts: each message takes one message's time (its bytes and
    the link's latency), not half of the stage's two transfers (which would halve the latency)."""
    from mist_compiler.cost.stage_api import StageEstimates

    schedule = build_schedule("interleaved", 2, 2, 4)
    parts = {"forward": np.ones(4), "p2p": np.array([1.0, 2.0, 2.0, 1.0]), "p2p_message": np.full(4, 0.75)}
    costs = chunk_costs(StageEstimates(np.full(4, 5.0), np.zeros(4), np.zeros(4), parts), schedule)
    np.testing.assert_allclose(costs.transfer[:, 0], 0.75)
    np.testing.assert_allclose(costs.backward[:, 0], [3.0, 2.0, 2.0, 3.0])  # stable - p2p - forward
