"""analyze() and `mistc analyze`: per-stage estimates, not-fitting plans, errors naming the field."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import yaml

from mist_compiler.cli import analyze as analyze_command
from mist_compiler import analyze
from mist_compiler.cost.hardware import load_profile
from mist_compiler.cost.stage_api import pipeline_iteration_time
from mist_compiler.ir.plan import Plan, PlanError

TWO_STAGES = {
    "model": "gpt-tiny", "seq_len": 128, "global_batch": 16, "dtype": "float32", "grad_accum": 4,
    "stages": [
        {"layers": [0, 2], "nodes": 1, "gpus_per_node": 2, "micro_batch": 2, "dp": 2, "tp": 1, "zero": 1, "ckpt_layers": 1},
        {"layers": [2, 4], "nodes": 1, "gpus_per_node": 2, "micro_batch": 4, "dp": 1, "tp": 2,
         "offload": {"opt": 0.5}},
    ],
}


def write(tmp_path, name, data) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data) if name.endswith(".json") else yaml.safe_dump(data))
    return str(path)


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    analyze_command.add_arguments(parser)
    return analyze_command.run(parser.parse_args(list(argv)))


def test_analyze_two_stage_plan():
    estimate = analyze("gpt-tiny", Plan.from_dict(TWO_STAGES), "l4")
    assert len(estimate.stages) == 2 and estimate.fits
    stable = np.array([s.stable_s for s in estimate.stages])
    delta = np.array([s.delta_s for s in estimate.stages])
    # the schedule is simulated (transfers on their channels); 1F1B stays within a few percent of the closed form
    assert estimate.iteration_time_s == pytest.approx(pipeline_iteration_time(stable, delta, 4), rel=0.03)
    first, last = estimate.stages
    assert first.exposed_comm_s > 0 and last.exposed_comm_s > 0  # DP sync / TP all-reduces
    assert all(s.peak_memory_mb == pytest.approx(sum(s.memory_mb.values())) for s in estimate.stages)
    for stage in estimate.stages:  # idle time: what the stage's own work leaves of the iteration
        assert 0 < stage.bubble_s < estimate.iteration_time_s - 4 * stage.stable_s * 0.9 - stage.delta_s


def test_cli_table_and_json(tmp_path, capsys):
    plan = write(tmp_path, "plan.json", TWO_STAGES)
    assert run_cli("gpt-tiny", "--plan", plan, "--hardware", "l4") == 0
    table = capsys.readouterr().out
    assert "iteration time" in table and "peak MB" in table
    assert run_cli("gpt-tiny", "--plan", plan, "--hardware", "l4", "--json", "--attention", "math") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["iteration_time_s"] > 0 and len(data["stages"]) == 2
    assert all(stage["peak_memory_mb"] > 0 for stage in data["stages"]) and data["fits"]


def test_plan_that_does_not_fit_reports_missing_memory(tmp_path, capsys):
    profile = load_profile("l4").to_dict()
    profile["device_memory_gb"] = 0.002
    profile.pop("memory_headroom_gb", None)  # the whole 2 MB usable
    hardware = write(tmp_path, "small.yaml", profile)
    plan = write(tmp_path, "plan.json", TWO_STAGES)
    estimate = analyze("gpt-tiny", plan, hardware)
    assert not estimate.fits and all(m > 0 for m in estimate.missing_mb)
    assert estimate.stages[0].missing_mb == pytest.approx(estimate.stages[0].peak_memory_mb - 2.0)
    assert run_cli("gpt-tiny", "--plan", plan, "--hardware", hardware) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_bad_plan_names_the_field(tmp_path):
    wrong_layers = dict(TWO_STAGES, stages=[dict(TWO_STAGES["stages"][0], layers=[0, 3])])
    wrong_layers["global_batch"] = 16
    with pytest.raises(PlanError, match="stages"):
        run_cli("gpt-tiny", "--plan", write(tmp_path, "a.json", wrong_layers), "--hardware", "l4")
    with pytest.raises(PlanError, match="model"):
        run_cli("llama-tiny", "--plan", write(tmp_path, "b.json", TWO_STAGES), "--hardware", "l4")
    too_wide = json.loads(json.dumps(TWO_STAGES))
    too_wide["stages"][1].update(gpus_per_node=16, dp=1, tp=16)
    with pytest.raises(PlanError, match=r"stages\[1\].gpus_per_node"):
        run_cli("gpt-tiny", "--plan", write(tmp_path, "c.json", too_wide), "--hardware", "l4")
    odd_tp = json.loads(json.dumps(TWO_STAGES))
    odd_tp["stages"][1].update(gpus_per_node=3, dp=1, tp=3)
    with pytest.raises(PlanError, match=r"stages\[1\].tp: tp=3 does not divide the model's split sizes"):
        run_cli("gpt-tiny", "--plan", write(tmp_path, "e.json", odd_tp), "--hardware", "l4")
    with pytest.raises(PlanError, match="micro_batch"):
        bad = json.loads(json.dumps(TWO_STAGES))
        bad["stages"][0]["micro_batch"] = 3
        run_cli("gpt-tiny", "--plan", write(tmp_path, "d.json", bad), "--hardware", "l4")


def test_bad_profile_names_the_field(tmp_path):
    plan = write(tmp_path, "plan.json", TWO_STAGES)
    with pytest.raises(ValueError, match="unknown hardware"):
        run_cli("gpt-tiny", "--plan", plan, "--hardware", "no-such-gpu")
    profile = load_profile("l4").to_dict()
    profile["memory_bandwidth_gbps"] = -1
    with pytest.raises(ValueError, match="memory_bandwidth_gbps"):
        run_cli("gpt-tiny", "--plan", plan, "--hardware", write(tmp_path, "bad.yaml", profile))


def test_through_mistc_main(tmp_path, capsys):
    """The real entry point (needs every sub-command module of the merged package)."""
    cli = pytest.importorskip("mist_compiler.cli")
    for module_name, _ in cli.COMMANDS.values():
        pytest.importorskip(module_name)
    plan = write(tmp_path, "plan.json", TWO_STAGES)
    assert cli.main(["analyze", "gpt-tiny", "--plan", plan, "--hardware", "l4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stages"][0]["peak_memory_mb"] > 0
    bad = json.loads(json.dumps(TWO_STAGES))
    bad["stages"][0]["zero"] = 7
    assert cli.main(["analyze", "gpt-tiny", "--plan", write(tmp_path, "bad.json", bad), "--hardware", "l4"]) == 2
    assert "stages[0].zero" in capsys.readouterr().err


def test_memory_limit_option_replaces_the_usable_memory(tmp_path, capsys):
    plan = write(tmp_path, "plan.json", TWO_STAGES)
    assert run_cli("gpt-tiny", "--plan", plan, "--hardware", "l4", "--json", "--memory-limit", "3MB") == 1
    data = json.loads(capsys.readouterr().out)
    assert not data["fits"]
    assert run_cli("gpt-tiny", "--plan", plan, "--hardware", "l4", "--memory-limit", "20GiB") == 0
    assert f"{20 * 2 ** 30 / 1e6:,.0f}" in capsys.readouterr().out
    default = analyze("gpt-tiny", plan, "l4")
    l4 = load_profile("l4")
    assert default.stages[0].memory_limit_mb == pytest.approx((l4.device_memory - l4.memory_headroom) / 1e6)
