"""The tuner's search logic against brute force, on an analytic test-double cost model.

These tests check the Pareto filter, the intra-stage shortcuts and the inter-stage partition DP: for a
tiny problem every plan is enumerated independently and the tuner must find the best one.
They use ``tests/test_tuner_double.py`` (a closed-form stand-in for the real cost model).
"""
from __future__ import annotations

import itertools
import math
import sys
import os

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_tuner_double import AnalyticStageModel  # noqa: E402

from mist_compiler.cost.stage_api import StageCandidates, pipeline_iteration_time  # noqa: E402
from mist_compiler.tuner.api import tune  # noqa: E402
from mist_compiler.tuner.intra_stage import pareto_mask  # noqa: E402
from mist_compiler.tuner.space import Cluster, SearchSpace, TuneError, Workload  # noqa: E402


def naive_pareto(group, stable, delta):
    keep = np.ones(len(group), dtype=bool)
    for i in range(len(group)):
        for j in range(len(group)):
            if i == j or group[i] != group[j]:
                continue
            dominates = stable[j] <= stable[i] and delta[j] <= delta[i] and (stable[j] < stable[i] or delta[j] < delta[i])
            tie_first = stable[j] == stable[i] and delta[j] == delta[i] and j < i
            if dominates or tie_first:
                keep[i] = False
    return keep


def test_pareto_mask_matches_naive():
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = 60
        group = rng.integers(0, 4, n)
        stable = rng.integers(0, 8, n).astype(float)
        delta = rng.integers(0, 8, n).astype(float)
        got = pareto_mask(group, stable, delta, np.arange(n).astype(float))
        want = naive_pareto(group, stable, delta)
        assert (got == want).all()


def small_model(memory: float = 1.0e8) -> AnalyticStageModel:
    return AnalyticStageModel(hidden=256, ffn=1024, vocab=2048, seq_len=256, device_memory_bytes=memory,
                              peak_flops=2e12, intra_bw=20e9, inter_bw=2e9, pcie_bw=8e9)


WORK = Workload(num_layers=4, heads=4, global_batch=8, seq_len=256, model_name="toy")
# the partition search by 1F1B's closed form (``stats["closed_form_s"]``) against brute force; the plans
# the tuner returns are priced by simulating their schedule (checked in test_tuner_schedules.py)
SPACE = SearchSpace(offload_grid=(0.0, 1.0), schedules=("1f1b",))
SIMULATION = 0.02  # how far a simulated 1F1B iteration may sit from the closed form (unequal stages)


def brute_force_best(model, work: Workload, nodes: int, gpus: int, space: SearchSpace) -> float:
    """Every layer split, device assignment, G and per-stage configuration; exact memory check."""
    world = nodes * gpus
    shapes = space.device_shapes(nodes, gpus)
    combos = space.offload_combos()
    best = math.inf
    for stages in range(1, work.num_layers + 1):
        for cuts in itertools.combinations(range(1, work.num_layers), stages - 1):
            bounds = (0,) + cuts + (work.num_layers,)
            layers = [bounds[i + 1] - bounds[i] for i in range(stages)]
            for shape_pick in itertools.product(shapes, repeat=stages):
                if sum(s.count for s in shape_pick) != world:
                    continue
                for g in space.grad_accum_options(work.global_batch):
                    fronts = []
                    for i in range(stages):
                        fronts.append(_stage_points(model, work, space, combos, layers[i], i, stages, shape_pick[i], g))
                        if not fronts[-1]:
                            break
                    else:
                        for pick in itertools.product(*fronts):
                            value = pipeline_iteration_time([p[0] for p in pick], [p[1] for p in pick], g)
                            best = min(best, value)
    return best


def _least_opt_rows(model, arr, layers, index, stages, shape, g):
    """The search space's optimizer-offload ratios are continuous: per row the least ratio that fits
    (memory is linear in it: the analytic model's optimizer states are static)."""
    def memory(opt):
        rows = arr.copy()
        rows[:, 7] = opt
        return model.evaluate(StageCandidates(
            num_layers=layers, has_pre=index == 0, has_post=index == stages - 1, nodes=shape.nodes,
            gpus_per_node=shape.gpus, micro_batch=rows[:, 2].astype(int), dp=rows[:, 1].astype(int),
            tp=rows[:, 0].astype(int), zero=rows[:, 3].astype(int), ckpt_layers=rows[:, 4].astype(int),
            offload_weights=rows[:, 5], offload_grads=rows[:, 6], offload_opt=rows[:, 7], offload_acts=rows[:, 8],
            inflight=min(stages - index, g))).peak_memory_bytes

    plain, offloaded = memory(0.0), memory(1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        least = (plain - model.device_memory_bytes) / (plain - offloaded)
    useful = (least > 0) & (least < 1)
    extra = arr[useful].copy()
    extra[:, 7] = np.minimum(1.0, np.ceil(least[useful] * 1e6) / 1e6)
    return extra


def _stage_points(model, work, space, combos, layers, index, stages, shape, g):
    rows = []
    for tp in space.tp_options(shape, work.heads):
        dp = shape.count // tp
        if work.global_batch % (dp * g):
            continue
        for zero in space.zero_levels:
            for ckpt in space.ckpt_options(layers):
                for combo in combos:
                    rows.append((tp, dp, work.global_batch // (dp * g), zero, ckpt, *combo))
    if not rows:
        return []
    arr = np.array(rows, dtype=float)
    arr = np.concatenate([arr, _least_opt_rows(model, arr, layers, index, stages, shape, g)])
    candidates = StageCandidates(
        num_layers=layers, has_pre=index == 0, has_post=index == stages - 1, nodes=shape.nodes,
        gpus_per_node=shape.gpus, micro_batch=arr[:, 2].astype(int), dp=arr[:, 1].astype(int), tp=arr[:, 0].astype(int),
        zero=arr[:, 3].astype(int), ckpt_layers=arr[:, 4].astype(int), offload_weights=arr[:, 5],
        offload_grads=arr[:, 6], offload_opt=arr[:, 7], offload_acts=arr[:, 8], inflight=min(stages - index, g),
    )
    est = model.evaluate(candidates)
    fits = est.peak_memory_bytes <= model.device_memory_bytes
    points = sorted(set(zip(est.stable_s[fits].tolist(), est.delta_s[fits].tolist())))
    front, best_delta = [], math.inf
    for stable, delta in points:
        if delta < best_delta:
            front.append((stable, delta))
            best_delta = delta
    return front


@pytest.mark.parametrize("memory", [1.0e8, 4.0e7])
def test_tuner_finds_brute_force_optimum(memory):
    model = small_model(memory)
    want = brute_force_best(model, WORK, 1, 4, SPACE)
    result = tune(model, WORK, Cluster(1, 4), space=SPACE)
    assert result.stats["closed_form_s"] == pytest.approx(want, rel=1e-9)
    assert result.predicted_time_s == pytest.approx(want, rel=SIMULATION)
    plan = result.plan
    assert plan.world_size == 4 and plan.num_layers == 4
    assert all(s.micro_batch * s.dp * plan.grad_accum == WORK.global_batch for s in plan.stages)
    assert all(report.peak_memory_bytes <= memory * (1 + 1e-9) for report in result.stages)


def test_tuner_brute_force_two_nodes_heterogeneous():
    model = small_model(6.0e7)
    space = SearchSpace(offload_grid=(0.0, 1.0), zero_levels=(0, 3), offload_grads=False, offload_weights=False,
                        schedules=("1f1b",))
    work = Workload(num_layers=5, heads=4, global_batch=8, seq_len=256, model_name="toy")
    want = brute_force_best(model, work, 2, 2, space)
    got = tune(model, work, Cluster(2, 2), space=space)
    assert got.stats["closed_form_s"] == pytest.approx(want, rel=1e-9)


def test_tune_is_deterministic():
    first = tune(small_model(4e7), WORK, Cluster(1, 4), space=SPACE)
    second = tune(small_model(4e7), WORK, Cluster(1, 4), space=SPACE)
    assert first.plan.to_dict() == second.plan.to_dict()
    assert first.predicted_time_s == second.predicted_time_s


def test_switches_restrict_the_plan():
    space = SearchSpace(offload_weights=False, offload_grads=False, offload_opt=False, offload_acts=False,
                        zero_levels=(1,), ckpt="none", stage_counts=(2,))
    result = tune(small_model(1e8), WORK, Cluster(1, 4), space=space)
    assert result.plan.pp == 2
    for stage in result.plan.stages:
        assert stage.zero == 1 and stage.ckpt_layers == 0 and not stage.offload.any


def test_restricted_space_is_never_better_than_full():
    model = small_model(4e7)
    full = tune(model, WORK, Cluster(1, 4), space=SPACE)
    for restricted in (SPACE.restrict(zero_levels=(0,)), SPACE.restrict(ckpt="all_or_none"),
                       SPACE.restrict(uniform_devices=True), SPACE.restrict(layer_slack=0, micro_batches=(1, 2))):
        try:
            other = tune(model, WORK, Cluster(1, 4), space=restricted)
        except TuneError:
            continue
        assert full.stats["closed_form_s"] <= other.stats["closed_form_s"] * (1 + 1e-9)
        assert full.predicted_time_s <= other.predicted_time_s * (1 + SIMULATION)


def test_nothing_fits_names_the_memory_needed():
    with pytest.raises(TuneError, match=r"no plan fits in 0\.00 GB per device: the smallest memory that would fit .* is \d+\.\d+ GB"):
        tune(small_model(1e5), WORK, Cluster(1, 4), space=SPACE)


def test_batch_not_divisible_names_a_batch_that_is():
    space = SearchSpace(tp_degrees=(1,), partial_node_stages=False)
    with pytest.raises(TuneError, match=r"global batch 7 cannot be split.*multiple of 2, e\.g\. 8"):
        tune(small_model(), Workload(4, 4, 7, 256), Cluster(2, 2), space=space)


def test_more_stages_than_layers_is_rejected():
    with pytest.raises(TuneError, match=r"stage_counts \[6\] all exceed the model's 4 layers.*most stages possible is 4"):
        tune(small_model(), WORK, Cluster(1, 8), space=SearchSpace(stage_counts=(6,)))


def test_more_devices_than_usable_is_rejected():
    work = Workload(num_layers=2, heads=1, global_batch=1, seq_len=256)
    with pytest.raises(TuneError, match=r"8 devices are more than this model and batch can use \(2 = "):
        tune(small_model(), work, Cluster(1, 8))


def test_bad_space_fields_are_named():
    with pytest.raises(ValueError, match="SearchSpace.ckpt"):
        SearchSpace(ckpt="some")
    with pytest.raises(ValueError, match="SearchSpace.offload_grid"):
        SearchSpace(offload_grid=(0.5,))
    with pytest.raises(ValueError, match="SearchSpace.zero_levels"):
        SearchSpace(zero_levels=(4,))


def test_full_space_never_worse_than_each_baseline():
    from mist_compiler.tuner.baselines import tune_baseline

    model = small_model(4e7)
    work = Workload(num_layers=4, heads=4, global_batch=16, seq_len=256, model_name="toy")
    full = tune(model, work, Cluster(2, 2))
    for name in ("megatron", "zero3", "mist-paper"):
        try:
            baseline = tune_baseline(name, model, work, Cluster(2, 2))
        except TuneError:
            continue
        assert full.stats["closed_form_s"] <= baseline.stats["closed_form_s"] * (1 + 1e-9), name
        assert full.predicted_time_s <= baseline.predicted_time_s * (1 + SIMULATION), name


def test_megatron_baseline_is_uniform():
    from mist_compiler.tuner.baselines import tune_baseline

    work = Workload(num_layers=4, heads=4, global_batch=16, seq_len=256, model_name="toy")
    result = tune_baseline("megatron", small_model(1e8), work, Cluster(1, 4))
    stages = result.plan.stages
    assert len({(s.dp, s.tp, s.devices, s.micro_batch) for s in stages}) == 1
    assert all(s.zero == 1 and not s.offload.any and s.ckpt_layers in (0, s.num_layers) for s in stages)
    assert max(s.num_layers for s in stages) - min(s.num_layers for s in stages) <= 1


def test_partition_alone_matches_brute_force_on_a_fixed_frontier():
    """Force the partition DP (no even-split incumbent) for every (S, G), exact target, and compare
    with enumerating every assignment of frontier rows to stages."""
    from mist_compiler.tuner.inter_stage import solve_partition
    from mist_compiler.tuner.intra_stage import build_frontiers
    from mist_compiler.tuner.space import Cluster

    model = small_model(4e7)
    cluster = Cluster(1, 4)
    for g in (1, 2, 4):
        table = build_frontiers(model, WORK, cluster, SPACE, g, 4)
        for stages in (1, 2, 3, 4):
            space = SPACE.restrict(stage_counts=(stages,), gap=0.0)
            outcome = solve_partition(table, WORK, cluster, space)
            want = _enumerate_table(table, stages, WORK, cluster)
            if outcome.solution is None:
                assert want == math.inf, (g, stages)
            else:
                assert outcome.solution.objective == pytest.approx(want, rel=1e-9), (g, stages)
                assert outcome.bound <= want * (1 + 1e-9)


def test_partition_certifies_its_gap():
    """The reported lower bound never exceeds the best plan, and with a loose target the plan is
    within that target of the exact optimum."""
    from mist_compiler.tuner.inter_stage import solve_partition
    from mist_compiler.tuner.intra_stage import build_frontiers
    from mist_compiler.tuner.space import Cluster

    model = small_model(4e7)
    cluster = Cluster(1, 4)
    for g in (2, 4):
        table = build_frontiers(model, WORK, cluster, SPACE, g, 4)
        exact = solve_partition(table, WORK, cluster, SPACE.restrict(gap=0.0))
        loose = solve_partition(table, WORK, cluster, SPACE.restrict(gap=0.05))
        assert exact.bound == pytest.approx(exact.solution.objective, rel=1e-9)
        assert loose.bound <= exact.solution.objective * (1 + 1e-9)
        assert loose.solution.objective <= exact.solution.objective * 1.05 * (1 + 1e-9)


def _enumerate_table(table, stages, work, cluster):
    from mist_compiler.tuner.stage_configs import PP_BOTH, PP_NONE, PP_POST, PP_PRE

    g = table.grad_accum
    best = math.inf
    options = []
    for i in range(stages):
        pp = PP_BOTH if stages == 1 else PP_PRE if i == 0 else PP_POST if i == stages - 1 else PP_NONE
        need = 1 if pp == PP_POST else min(stages - i, g)
        rows = [int(r) for (l, p, s, k), members in table.cells.items() if p == pp for r in members
                if table.fit_k[r] >= need]
        options.append(sorted(set(rows)))
    for pick in itertools.product(*options):
        cfg = table.configs
        if sum(int(cfg.num_layers[r]) for r in pick) != work.num_layers:
            continue
        if sum(int(cfg.nodes[r] * cfg.gpus_per_node[r]) for r in pick) != cluster.world:
            continue
        best = min(best, pipeline_iteration_time(table.stable[list(pick)], table.delta[list(pick)], g))
    return best


def test_lagrangian_partition_bounds_the_exact_one():
    """The device-priced DP (big clusters) gives a valid lower bound and a real plan: bound <= the
    exact grid DP's optimum <= its plan, on a two-node case with heterogeneous device counts."""
    from mist_compiler.tuner.inter_stage import solve_partition
    from mist_compiler.tuner.intra_stage import build_frontiers
    from mist_compiler.tuner.space import Cluster

    model = small_model(6.0e7)
    work = Workload(num_layers=6, heads=4, global_batch=16, seq_len=256, model_name="toy")
    cluster = Cluster(2, 4)
    for g in (1, 2, 4):
        table = build_frontiers(model, work, cluster, SPACE, g, 6)
        exact = solve_partition(table, work, cluster, SPACE.restrict(gap=0.0), method="grid")
        priced = solve_partition(table, work, cluster, SPACE.restrict(gap=0.0), method="lagrange")
        if exact.solution is None:
            assert priced.solution is None
            continue
        assert exact.bound == pytest.approx(exact.solution.objective, rel=1e-9)
        assert priced.bound <= exact.solution.objective * (1 + 1e-9)
        assert priced.solution.objective >= exact.solution.objective * (1 - 1e-9)
        assert priced.solution.objective <= exact.solution.objective * 1.10, g  # repairs find good plans


def test_big_cluster_is_certified_within_the_gap():
    """1,024 devices, 48 layers: the search reports a lower bound within the target gap of its plan,
    and the plan is at least as fast as the best evenly split one."""
    from mist_compiler.tuner.baselines import tune_baseline

    model = AnalyticStageModel(hidden=1024, ffn=4096, vocab=8192, seq_len=512, device_memory_bytes=2e9,
                               peak_flops=2e12, intra_bw=20e9, inter_bw=2e9, pcie_bw=8e9)
    work = Workload(num_layers=48, heads=16, global_batch=1024, seq_len=512, model_name="toy")
    space = SearchSpace(gap=0.01)
    result = tune(model, work, Cluster(128, 8), space=space)
    assert result.stats["gap"] <= 0.01 + 1e-12
    assert result.stats["bound_s"] <= result.stats["closed_form_s"] * (1 + 1e-12)
    even = tune(model, work, Cluster(128, 8), space=space.restrict(uniform_devices=True, layer_slack=0))
    assert result.stats["closed_form_s"] <= even.stats["closed_form_s"] * (1 + 1e-9)
    megatron = tune_baseline("megatron", model, work, Cluster(128, 8))
    assert result.stats["closed_form_s"] <= megatron.stats["closed_form_s"] * (1 + 1e-9)


def test_first_of_each_row_is_numpys_unique_rows():
    """The knob search's dedup (a lexicographic sort of integer columns) answers as
    ``np.unique(axis=0, return_index=True)``: the same rows, in the same order, first occurrences."""
    from mist_compiler.tuner.knobs import _first_of_each_row

    rng = np.random.default_rng(0)
    for trial in range(200):
        n = int(rng.integers(1, 300))
        columns = [rng.integers(-2 if trial % 2 else 0, int(rng.integers(1, 6)), n) for _ in range(int(rng.integers(1, 5)))]
        expected = np.unique(np.column_stack(columns), axis=0, return_index=True)[1]
        np.testing.assert_array_equal(_first_of_each_row(columns), expected)
    assert len(_first_of_each_row([np.zeros(0, dtype=int), np.zeros(0, dtype=int)])) == 0
