"""Pipeline transfers never depend on tags: every rank's exchanges, replayed under NCCL's rules
(in-order matching per pair, one batch at a time), match the right tensors and finish."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from mist_compiler.ir.plan import Plan
from mist_compiler.ir.schedule import BACKWARD, FORWARD, build_schedule
from mist_compiler.ir.topology import Topology
from mist_compiler.runtime.pipeline import ExchangeError, check_exchanges, exchange_plan

SCHEDULES = ("1f1b", "gpipe", "zb-h1")  # one virtual stage per group of devices


@dataclass(frozen=True)
class Value:
    batched: bool = True
    floating: bool = True

    @property
    def needs_grad(self) -> bool:
        return self.batched and self.floating

    dtype = torch.float32

    def shape(self, batch: int) -> tuple[int, ...]:
        return (batch, 4) if self.batched else (4,)


HIDDEN = [Value()]
MIXED = [Value(), Value(batched=False), Value(floating=False)]  # hidden states, a table, token ids


def topology(global_batch: int, grad_accum: int, stages: list[tuple[int, int, int]]) -> Topology:
    """``stages``: (dp, tp, micro_batch or 0 for global_batch / (G * dp))."""
    layers = [[i, i + 1] for i in range(len(stages))]
    return Topology(Plan.from_dict({
        "model": "gpt-tiny", "seq_len": 16, "global_batch": global_batch, "dtype": "float32",
        "grad_accum": grad_accum,
        "stages": [{"layers": layers[i], "nodes": 1, "gpus_per_node": dp * tp, "dp": dp, "tp": tp,
                    "micro_batch": mb or global_batch // (grad_accum * dp)} for i, (dp, tp, mb) in enumerate(stages)],
    }))


def plans_of(topo: Topology, schedule: str, values=HIDDEN) -> dict[int, list]:
    """Every rank's exchanges, each virtual stage passing ``values`` on."""
    plan = topo.plan
    built = build_schedule(schedule, plan.pp, plan.virtual_stages, plan.grad_accum)
    result = {}
    for rank in range(topo.world_size):
        chunks = built.chunks(topo.coord(rank).stage)
        interfaces = [(values if j > 0 else [], values if j < built.num_virtual - 1 else []) for j in chunks]
        result[rank] = exchange_plan(topo, rank, built, interfaces)
    return result


SHAPES = {
    "2 stages": [(1, 1, 0), (1, 1, 0)],
    "3 stages": [(1, 1, 0)] * 3,
    "4 stages": [(1, 1, 0)] * 4,
    "dp 2 -> tp 2": [(2, 1, 0), (1, 2, 0)],
    "tp 2 -> dp 2": [(1, 2, 0), (2, 1, 0)],
    "dp 2, dp 1, dp 4 (micro-batches 2, 4, 1)": [(2, 1, 0), (1, 1, 0), (4, 1, 0)],
    "dp 2 x tp 2 -> tp 4 -> dp 3": [(2, 2, 0), (1, 4, 0), (2, 1, 0)],
    "4 stages, mixed": [(2, 1, 0), (1, 2, 0), (2, 2, 0), (1, 1, 0)],
}


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("grad_accum", [1, 2, 3, 8])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_exchanges_match_and_finish_under_nccl_rules(shape, grad_accum, schedule):
    stages = SHAPES[shape]
    dp_lcm = 12  # every stage's dp divides the per-micro-batch sample count
    topo = topology(dp_lcm * grad_accum, grad_accum, stages)
    check_exchanges(plans_of(topo, schedule))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_unbatched_and_integer_values_travel_once(schedule):
    topo = topology(8, 2, [(2, 1, 0), (1, 2, 0), (2, 1, 0)])
    plans = plans_of(topo, schedule, MIXED)
    check_exchanges(plans)
    # stage 1, tp index 1 (rank 3) receives the unbatched value of each micro-batch once, from one sender
    received = [t for exchange in plans[3] for t in exchange
                if not t.send and t.direction == FORWARD and t.value == 1]
    assert [t.micro for t in received] == [0, 1]
    # only the floating batched value has a gradient
    assert {t.value for exchange in plans[3] for t in exchange if t.direction == BACKWARD} == {0}


def test_a_pair_posting_in_different_orders_is_caught():
    topo = topology(8, 4, [(1, 1, 0), (1, 1, 0)])
    plans = plans_of(topo, "1f1b")
    # the receiver posts micro-batch 1's receive before micro-batch 0's (what the tag-based code did)
    first = next(i for i, ex in enumerate(plans[1]) if any(not t.send for t in ex))
    second = next(i for i, ex in enumerate(plans[1]) if i > first and any(not t.send and t.direction == FORWARD for t in ex))
    a = [t for t in plans[1][first] if not t.send]
    b = [t for t in plans[1][second] if not t.send and t.direction == FORWARD]
    plans[1][first] = [t for t in plans[1][first] if t.send] + b
    plans[1][second] = [t for t in plans[1][second] if t not in b] + a
    with pytest.raises(ExchangeError, match="sends"):
        check_exchanges(plans)


def test_waiting_for_a_gradient_before_sending_its_activations_deadlocks():
    """Stage 0 waits for micro-batch 1's gradient before the forward that sends micro-batch 1's
    activations: nothing can ever produce that gradient."""
    from dataclasses import replace

    topo = topology(8, 4, [(1, 1, 0), (1, 1, 0)])
    plans = plans_of(topo, "1f1b")
    stage0 = plans[0]
    forward = next(i for i, ex in enumerate(stage0) if any(t.send and t.direction == FORWARD and t.micro == 1 for t in ex))
    waiting = forward - 1  # the exchange before the forward of micro-batch 1
    for index, exchange in enumerate(stage0):  # micro-batches 0 and 1's gradients posted there, still in order
        moved = [t for t in exchange if not t.send and t.direction == BACKWARD and t.micro <= 1]
        if moved:
            stage0[index] = [t for t in exchange if t not in moved]
            stage0[waiting] = stage0[waiting] + [replace(t, needed_by=waiting) if t.micro == 1 else t for t in moved]
    with pytest.raises(ExchangeError, match="deadlock"):
        check_exchanges(plans)


def test_one_f_one_b_order():
    order = [str(a) for a in build_schedule("1f1b", 3, 1, 4).actions[0]]
    assert order == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3", "STEP"]
    assert [str(a) for a in build_schedule("1f1b", 3, 1, 2).actions[2]] == ["F0", "B0", "F1", "B1", "STEP"]


VIRTUAL = {"1f1b": (1,), "gpipe": (1,), "zb-h1": (1,), "interleaved": (2, 3), "zbv": (2,)}


def random_pipeline(rng) -> tuple[Topology, str]:
    """A small pipeline: a random schedule over 1-4 stages of random dp (1, 2, 3) and tp (1, 2),
    the micro-batch count random (a multiple of the stages for interleaved)."""
    schedule = rng.choice(sorted(VIRTUAL))
    v = rng.choice(VIRTUAL[schedule])
    pp = rng.randint(1, 4)
    grad_accum = rng.randint(1, 9) if schedule != "interleaved" else pp * rng.randint(1, 3)
    per_micro = 6  # every dp below divides it
    groups = [(rng.choice((1, 2, 3)), rng.choice((1, 2))) for _ in range(pp)]
    where = [j % pp for j in range(pp * v)] if schedule != "zbv" else [j if j < pp else 2 * pp - 1 - j for j in range(2 * pp)]
    stages = []
    for j, stage in enumerate(where):
        dp, tp = groups[stage]
        stages.append({"layers": [j, j + 1], "nodes": 1, "gpus_per_node": dp * tp, "dp": dp, "tp": tp,
                       "micro_batch": per_micro // dp})
    data = {"model": "m", "seq_len": 16, "global_batch": per_micro * grad_accum, "dtype": "float32",
            "grad_accum": grad_accum, "stages": stages, "schedule": schedule, "virtual_stages": v}
    return Topology(Plan.from_dict(data)), schedule


@pytest.mark.parametrize("seed", range(12))
def test_random_pipelines_exchange_without_mismatch_or_deadlock(seed):
    import random

    rng = random.Random(seed)
    for _ in range(10):
        topo, schedule = random_pipeline(rng)
        check_exchanges(plans_of(topo, schedule, MIXED))


@pytest.mark.parametrize("schedule, virtual", [("interleaved", 2), ("interleaved", 3), ("zbv", 2)])
@pytest.mark.parametrize("shape", ["2 stages", "3 stages", "dp 2 -> tp 2", "dp 2 x tp 2 -> tp 4 -> dp 3"])
def test_virtual_stage_schedules_match_and_finish(schedule, virtual, shape):
    groups = SHAPES[shape]
    pp = len(groups)
    where = [j % pp for j in range(pp * virtual)] if schedule != "zbv" else \
        [j if j < pp else 2 * pp - 1 - j for j in range(2 * pp)]
    grad_accum = 2 * pp
    stages = [{"layers": [j, j + 1], "nodes": 1, "gpus_per_node": groups[s][0] * groups[s][1], "dp": groups[s][0],
               "tp": groups[s][1], "micro_batch": 12 // groups[s][0]} for j, s in enumerate(where)]
    topo = Topology(Plan.from_dict({"model": "m", "seq_len": 16, "global_batch": 12 * grad_accum, "dtype": "float32",
                                    "grad_accum": grad_accum, "stages": stages, "schedule": schedule,
                                    "virtual_stages": virtual}))
    check_exchanges(plans_of(topo, schedule, MIXED))
