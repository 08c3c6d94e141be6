"""End to end with the real cost model: mistc tune / explain on gpt-tiny over a small L4 cluster.

The stage cost model is built once (capture + analysis takes seconds) and handed to the commands
by patching ``build_stage_cost_model``; everything else is the real code path.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

import pytest

from mist_compiler.cli import explain as explain_command
from mist_compiler.cli import tune as tune_command
from mist_compiler import driver
from mist_compiler.cost.analyze import analyze
from mist_compiler.cost.hardware import load_profile
from mist_compiler.ir.plan import load_plan
from mist_compiler.tuner.api import tune
from mist_compiler.tuner.baselines import tune_baseline
from mist_compiler.tuner.space import Cluster, SearchSpace, TuneError

MODEL, HARDWARE, SEQ = "gpt-tiny", "l4", 128


@pytest.fixture(scope="module")
def cost_model():
    from mist_compiler.cost import stage_model

    _, model = driver.price(MODEL, HARDWARE, seq_len=SEQ)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stage_model, "build_stage_cost_model", lambda *args, **kwargs: model)
        yield model


def run_command(module, argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return module.run(parser.parse_args(argv))


def test_tune_writes_a_plan_that_analyze_accepts(cost_model, tmp_path, capsys):
    plan_path = str(tmp_path / "plan.json")
    code = run_command(tune_command, [MODEL, "--hardware", HARDWARE, "--nodes", "2", "--gpus-per-node", "2",
                                      "--global-batch", "16", "--seq", str(SEQ), "-o", plan_path, "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    plan = load_plan(plan_path)
    assert plan.to_dict() == out["plan"]
    assert plan.world_size == 4 and plan.global_batch == 16 and plan.num_layers == 4
    assert 0 < out["mfu"] < 1
    estimate = analyze(None, plan, HARDWARE, cost_model=cost_model)
    assert estimate.fits
    assert estimate.iteration_time_s == pytest.approx(out["predicted_time_s"], rel=1e-9)
    assert os.path.isfile(str(tmp_path / "plan.frontiers.json"))


def test_tune_table_shows_time_mfu_and_memory(cost_model, capsys):
    code = run_command(tune_command, [MODEL, "--hardware", HARDWARE, "--nodes", "1", "--gpus-per-node", "4",
                                      "--global-batch", "8", "--seq", str(SEQ), "--quiet"])
    assert code == 0
    text = capsys.readouterr().out
    assert "predicted iteration" in text and "MFU" in text and "peak GB" in text


@pytest.fixture(scope="module")
def work():
    return driver.workload(driver.capture(MODEL, seq_len=SEQ), 16, SEQ)


def test_tune_is_deterministic_with_the_real_model(cost_model, work):
    first = tune(cost_model, work, Cluster(2, 2))
    second = tune(cost_model, work, Cluster(2, 2))
    assert first.plan.to_dict() == second.plan.to_dict()


def test_tuned_plan_never_worse_than_baselines(cost_model, work):
    full = tune(cost_model, work, Cluster(1, 4))
    for name in ("megatron", "zero3", "mist-paper"):
        baseline = tune_baseline(name, cost_model, work, Cluster(1, 4))
        assert full.predicted_time_s <= baseline.predicted_time_s * (1 + 1e-9), name


def test_too_little_memory_names_the_memory_that_would_fit(cost_model, work, tmp_path):
    profile = dataclasses.replace(load_profile(HARDWARE), device_memory=1e5, memory_headroom=0.0)
    small = dataclasses.replace(cost_model, hardware=profile)
    with pytest.raises(TuneError, match=r"no plan fits in 0\.00 GB per device: the smallest memory that would fit"):
        tune(small, work, Cluster(1, 4))


def test_more_gpus_per_node_than_the_profile_is_rejected(cost_model, work):
    with pytest.raises(TuneError, match=r"gpus_per_node = 16 exceeds the hardware profile's 8 GPUs per node"):
        tune(cost_model, work, Cluster(1, 16))


def test_bad_offload_grid_flag_is_named(cost_model):
    with pytest.raises(ValueError, match="--offload-grid"):
        run_command(tune_command, [MODEL, "--hardware", HARDWARE, "--nodes", "1", "--gpus-per-node", "2",
                                   "--global-batch", "8", "--offload-grid", "0,x"])


def test_bad_gap_flag_is_named(cost_model):
    with pytest.raises(ValueError, match="--gap"):
        run_command(tune_command, [MODEL, "--hardware", HARDWARE, "--nodes", "1", "--gpus-per-node", "2",
                                   "--global-batch", "8", "--gap", "1.5"])


def test_tune_table_reports_the_certified_gap(cost_model, capsys):
    run_command(tune_command, [MODEL, "--hardware", HARDWARE, "--nodes", "1", "--gpus-per-node", "2",
                               "--global-batch", "8", "--seq", str(SEQ), "--gap", "0", "--quiet"])
    out = capsys.readouterr().out
    assert "OPTIMAL (lower bound" in out and "gap 0.00%" in out


def test_explain_writes_trace_and_pictures(cost_model, tmp_path, capsys):
    plan_path = str(tmp_path / "plan.json")
    run_command(tune_command, [MODEL, "--hardware", HARDWARE, "--nodes", "1", "--gpus-per-node", "4",
                               "--global-batch", "16", "--seq", str(SEQ), "--max-stages", "4", "-o", plan_path,
                               "--quiet", "--space", "megatron"])
    capsys.readouterr()
    out_dir = str(tmp_path / "explain")
    assert run_command(explain_command, [plan_path, "--hardware", HARDWARE, "-o", out_dir]) == 0
    text = capsys.readouterr().out
    plan = load_plan(plan_path)
    assert "stage 0: layers 0.." in text and f"by simulating the {plan.schedule} schedule" in text
    with open(os.path.join(out_dir, "timeline.json")) as handle:
        trace = json.load(handle)
    slots = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(slots) == plan.pp * (2 * plan.grad_accum + 1)
    assert all({"name", "ts", "dur", "pid", "tid"} <= set(e) for e in slots)
    for name in ("timeline.png", "frontiers.png"):
        with open(os.path.join(out_dir, name), "rb") as handle:
            assert handle.read(8) == b"\x89PNG\r\n\x1a\n"


def test_explain_without_timing_source_still_describes(tmp_path, capsys):
    plan_path = tmp_path / "p.json"
    plan_path.write_text(json.dumps({"model": MODEL, "seq_len": SEQ, "global_batch": 8, "dtype": "float16",
                                     "grad_accum": 2, "stages": [{"layers": [0, 4], "nodes": 1, "gpus_per_node": 2,
                                                                  "micro_batch": 2, "dp": 2, "tp": 1}]}))
    assert run_command(explain_command, [str(plan_path)]) == 0
    assert "no timing" in capsys.readouterr().out


def test_space_flags_restrict(cost_model, work):
    space = SearchSpace(offload_weights=False, offload_grads=False, offload_opt=False, offload_acts=False)
    result = tune(cost_model, dataclasses.replace(work, global_batch=8), Cluster(1, 2), space=space)
    assert not any(stage.offload.any for stage in result.plan.stages)


def _random_candidates(rng, count: int):
    import numpy as np

    from mist_compiler.cost.stage_api import StageCandidates

    layers = rng.integers(1, 5, count)
    tp = rng.choice([1, 2], count)
    dp = rng.choice([1, 2], count)
    return StageCandidates(
        num_layers=layers, has_pre=rng.random(count) < 0.5, has_post=rng.random(count) < 0.5, nodes=1,
        gpus_per_node=tp * dp, micro_batch=rng.choice([1, 2, 4], count), dp=dp, tp=tp, zero=rng.integers(0, 4, count),
        ckpt_layers=(rng.random(count) * (layers + 1)).astype(int).clip(0, layers),
        offload_weights=rng.choice([0.0, 0.5], count), offload_grads=rng.choice([0.0, 0.5], count),
        offload_opt=rng.choice([0.0, 0.5], count), offload_acts=rng.choice([0.0, 0.5], count),
        inflight=rng.integers(1, 4, count))


def test_real_model_has_the_properties_the_intra_stage_shortcuts_use(cost_model):
    """What intra_stage relies on (its docstring): more checkpointing or offload never makes the
    steady state faster (checkpointing excepted when activations are offloaded), never uses more
    memory (weights offload excepted: its prefetch buffer), memory grows with the in-flight count;
    offload families that lower delta are detected as trade-offs."""
    import dataclasses as dc

    import numpy as np

    from mist_compiler.tuner.knobs import _trade_families
    from mist_compiler.tuner.space import Cluster, SearchSpace, Workload
    from mist_compiler.tuner.stage_configs import enumerate_bases

    rng = np.random.default_rng(0)
    base = _random_candidates(rng, 400)
    before = cost_model.evaluate(base)
    layers = base.num_layers
    lowers_delta = set()
    for name, step in (("ckpt_layers", None), ("offload_weights", 0.5), ("offload_grads", 0.5),
                       ("offload_opt", 0.5), ("offload_acts", 0.5)):
        if step is None:
            changed = dc.replace(base, ckpt_layers=np.minimum(base.ckpt_layers + 1, layers))
        else:
            changed = dc.replace(base, **{name: getattr(base, name) + step})
        after = cost_model.evaluate(changed)
        timed = base.offload_acts == 0 if name == "ckpt_layers" else np.ones(len(base), dtype=bool)
        assert (after.stable_s >= before.stable_s * (1 - 1e-9))[timed].all(), name
        if (after.delta_s < before.delta_s * (1 - 1e-9)).any():
            lowers_delta.add(name.replace("offload_", ""))
        if name != "offload_weights":
            assert (after.peak_memory_bytes <= before.peak_memory_bytes * (1 + 1e-9)).all(), name
    assert "ckpt_layers" not in lowers_delta
    more = cost_model.evaluate(dc.replace(base, inflight=base.inflight + 1))
    assert (more.peak_memory_bytes >= before.peak_memory_bytes * (1 - 1e-9)).all()
    assert np.allclose(more.stable_s, before.stable_s) and np.allclose(more.delta_s, before.delta_s)
    # optimizer offload (knobs.py solves its ratio in closed form): it never changes stable, and
    # memory is convex in it (a maximum of affine terms), so the line between none and all bounds it
    no_opt, all_opt = dc.replace(base, offload_opt=np.zeros(len(base))), dc.replace(base, offload_opt=np.ones(len(base)))
    half = cost_model.evaluate(dc.replace(base, offload_opt=np.full(len(base), 0.5)))
    ends = cost_model.evaluate(no_opt), cost_model.evaluate(all_opt)
    assert np.allclose(half.stable_s, ends[0].stable_s) and np.allclose(ends[1].stable_s, ends[0].stable_s)
    midpoint = (ends[0].peak_memory_bytes + ends[1].peak_memory_bytes) / 2
    assert (half.peak_memory_bytes <= midpoint * (1 + 1e-9)).all()
    space = SearchSpace()
    bases, shapes = enumerate_bases(Workload(4, 4, 16, SEQ), Cluster(1, 4), space, 2, 4)
    trade = _trade_families(cost_model, bases, shapes, space, space.offload_combos(), np.zeros(len(bases), int))
    names = {("weights", "grads", "opt", "acts")[f] for f in trade}
    assert lowers_delta <= names | {"weights", "opt", "acts"} and ("grads" in names) == ("grads" in lowers_delta)
