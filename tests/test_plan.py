"""The Plan schema: round trips through JSON and YAML; every validation error names its field."""
from __future__ import annotations

import copy
import json

import pytest

from mist_compiler.ir.plan import Plan, PlanError, load_plan, save_plan


def plan_dict() -> dict:
    return {
        "model": "gpt2-1.3b", "seq_len": 2048, "global_batch": 32, "dtype": "float16", "grad_accum": 2,
        "stages": [
            {"layers": [0, 12], "nodes": 1, "gpus_per_node": 2, "micro_batch": 8, "dp": 2, "tp": 1, "zero": 1,
             "ckpt_layers": 12, "offload": {"weights": 0.0, "grads": 0.0, "opt": 0.5, "acts": 0.0}},
            {"layers": [12, 24], "nodes": 1, "gpus_per_node": 4, "micro_batch": 16, "dp": 1, "tp": 4},
        ],
    }


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_round_trip(tmp_path, suffix):
    plan = Plan.from_dict(plan_dict())
    path = str(tmp_path / f"plan{suffix}")
    save_plan(plan, path)
    assert load_plan(path) == plan
    assert Plan.from_dict(json.loads(plan.to_json())) == plan
    assert plan.pp == 2 and plan.world_size == 6 and plan.num_layers == 24
    assert plan.stages[0].offload.any and not plan.stages[1].offload.any


def _broken(edit):
    data = copy.deepcopy(plan_dict())
    edit(data)
    return data


CASES = [
    (lambda d: d.update(extra=1), r"<plan>: unknown key\(s\) \['extra'\]"),
    (lambda d: d.pop("dtype"), r"<plan>: missing key\(s\) \['dtype'\]"),
    (lambda d: d.update(dtype="int8"), "dtype: must be one of"),
    (lambda d: d.update(model=""), "model: expected a non-empty string"),
    (lambda d: d.update(seq_len=0), "seq_len: must be >= 1"),
    (lambda d: d.update(global_batch="32"), "global_batch: expected an integer"),
    (lambda d: d.update(stages=[]), "stages: expected a non-empty list"),
    (lambda d: d["stages"][0].update(layers=[0]), r"stages\[0\].layers: expected \[start, end\]"),
    (lambda d: d["stages"][0].update(layers=[3, 3]), r"stages\[0\].layers: need 0 <= start < end"),
    (lambda d: d["stages"][1].update(layers=[13, 24]), r"stages\[1\].layers: .*expected start 12"),
    (lambda d: d["stages"][0].update(zero=4), r"stages\[0\].zero: ZeRO level must be 0..3"),
    (lambda d: d["stages"][0].update(dp=1), r"stages\[0\].dp: dp \* tp = 1 \* 1 = 1 must equal"),
    (lambda d: d["stages"][0].update(ckpt_layers=13), r"stages\[0\].ckpt_layers: 13 checkpointed layers"),
    (lambda d: d["stages"][0]["offload"].update(opt=1.5), r"stages\[0\].offload.opt: must be in \[0, 1\]"),
    (lambda d: d["stages"][0]["offload"].update(disk=0.1), r"stages\[0\].offload: unknown key"),
    (lambda d: d["stages"][1].update(micro_batch=4), r"stages\[1\].micro_batch: .* must equal global_batch = 32"),
    (lambda d: d["stages"][1].update(tp=True), r"stages\[1\].tp: expected an integer"),
]


@pytest.mark.parametrize("edit, message", CASES)
def test_each_validation_error_names_its_field(edit, message):
    with pytest.raises(PlanError, match=message):
        Plan.from_dict(_broken(edit))


def test_plan_against_model_and_files(tmp_path):
    plan = Plan.from_dict(plan_dict())
    plan.check_against_model(24, max_seq=2048)
    with pytest.raises(PlanError, match="stages: the plan covers 24 layers but model 'gpt2-1.3b' has 32"):
        plan.check_against_model(32)
    with pytest.raises(PlanError, match="seq_len: 2048 exceeds the model's maximum 1024"):
        plan.check_against_model(24, max_seq=1024)
    with pytest.raises(PlanError, match="does not exist"):
        load_plan(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(PlanError, match="cannot be parsed"):
        load_plan(str(bad))
