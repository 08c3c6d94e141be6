"""benchmarks/gpu_check.py: its plans are valid, its tables readable, and (heavy) its dry run passes."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from mist_compiler.ir.plan import Plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "benchmarks", "gpu_check.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_plan_kind_is_a_valid_plan():
    check = _gpu_check()
    kinds = check.one_device_kinds("gpt2-1.3b", 2048, 8)
    assert {kind for kind, _ in kinds} >= {"bf16", "fp16 + loss scaling", "fp32", "ZeRO-3", "checkpointing (all)",
                                            "offload weights 50%", "offload grads 50%", "offload opt 50%",
                                            "offload acts 50%"}
    for _, data in kinds:
        assert Plan.from_dict(data).world_size == 1
    multi = check.multi_device_kinds("gpt-tiny", 16, 8, 4, "float32")
    assert [ranks for _, ranks, _ in multi] == [2, 2, 2, 4]
    for _, ranks, data in multi:
        assert Plan.from_dict(data).world_size == ranks
    assert len(check.multi_device_kinds("gpt-tiny", 16, 8, 2, "float32")) == 3


def test_extra_kinds_are_read_as_data_and_checked_before_the_run(tmp_path):
    """``--extra-kinds``: the shipped per-tensor file adds its kinds; a bad file stops the run naming the
    field, before a lent GPU's minutes go to the calibration."""
    check = _gpu_check()
    shipped = check._extra_kinds(os.path.join(ROOT, "benchmarks", "plans", "gpt2-per-tensor.json"))
    kinds = dict(check.one_device_kinds("gpt2-1.3b", 2048, 8, shipped))
    assert set(shipped) <= set(kinds) and all(k.startswith("per-tensor") for k in shipped)
    for kind in shipped:
        assert Plan.from_dict(kinds[kind]).stages[0].activations is not None
    bad = tmp_path / "bad.json"
    bad.write_text('{"x": {"activations": {"recompute": "gelu"}}}')
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--dry-run",
                             "--extra-kinds", str(bad)], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": ROOT})
    assert result.returncode != 0 and "--extra-kinds: 'x'" in result.stderr and "recompute" in result.stderr, \
        result.stderr[-2000:]


def test_tables_show_errors_as_percentages():
    check = _gpu_check()
    text = check.format_table("t", [{"kind": "bf16", "time err": -0.052, "MFU": 0.43, "measured s": 0.31,
                                     "targets met": True, "reserved MB": float("nan")}])
    assert "| bf16 | -5.2% | 43.0% | 0.31 | yes | - |" in text


def test_the_mfu_section_tunes_each_model_and_reports_both_units(monkeypatch):
    """The MFU rows' own code (tuning, FLOPs, columns) with the training run stubbed out: it called
    the tuner with an old signature once, and only the heavy dry run below would have said so."""
    import argparse

    from mist_compiler.cost.hardware import load_profile

    check = _gpu_check()
    settings = check.settings_for(argparse.Namespace(dry_run=True, hardware=None, perf_model="gpt2-1.3b", mfu_batch=16))
    runs = []

    def trained(job, world, settings):
        runs.append(job.compile_units)
        return check.Outcome(step_s=0.5, allocated=[1e8], reserved=[float("nan")], kernel="sdpa")

    monkeypatch.setattr(check, "run", trained)
    report = check.Report(settings, None, float("inf"), lambda message: None)
    check.mfu_section(settings, load_profile("cpu"), report)
    (title, rows), = report.sections
    assert [row.get("error") for row in rows] == [None] * 4, rows
    assert [(row["model"], row["units"]) for row in rows] == [("gpt-tiny", "compiled"), ("gpt-tiny", "eager"),
                                                             ("llama-tiny", "compiled"), ("llama-tiny", "eager")]
    assert runs == [None, False, None, False]
    assert all(row["MFU"] > 0 and row["predicted s"] > 0 and row["predicted MFU"] > 0 for row in rows[::2])


def test_an_unknown_section_is_refused_before_anything_runs():
    with pytest.raises(SystemExit, match="--sections: unknown section 'mfus'"):
        _gpu_check().main(["--dry-run", "--sections", "one,mfus"])


@pytest.mark.heavy
def test_dry_run_executes_every_section(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--dry-run",
                           "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    for title in ("one device: every plan kind", "MFU on one device", "gloo: DP, TP, PP and mixed plans"):
        assert title in done.stdout
    assert "| NO |" not in done.stdout, done.stdout  # every check within its tolerance


def test_an_unknown_plan_kind_is_refused_before_anything_runs():
    with pytest.raises(SystemExit, match="--trace: unknown plan kind 'ZeRO-4'"):
        _gpu_check().main(["--dry-run", "--trace", "ZeRO-4"])
    with pytest.raises(SystemExit, match="--kinds: unknown plan kind 'bf 16'"):
        _gpu_check().main(["--dry-run", "--kinds", "bf 16"])


def test_a_traced_kind_leaves_its_step_profile(tmp_path):
    """``--trace`` profiles one more step of the kind's timed run: the top ops, the runtime's own
    ranges (here the host workers' gradient accumulation of a 50% gradient offload), a Chrome trace."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--dry-run", "--sections",
                           "one", "--kinds", "offload grads 50%", "--trace", "offload grads 50%", "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    text = (tmp_path / "trace-offload-grads-50.txt").read_text()
    assert "Self CPU" in text and "mist.host_grad_accumulate" in text
    assert (tmp_path / "trace-offload-grads-50.json.gz").stat().st_size > 0
