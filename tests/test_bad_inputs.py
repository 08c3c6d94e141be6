"""Bad input, as users give it: every case ends in one or two lines naming the culprit, a non-zero exit,
no traceback. Plans, profiles, model specs, command-line arguments and torch.compile options.

Most cases call ``mistc``'s ``main`` in this process (the same code the console script runs; an
exception escaping it would fail the test); a few run the console script in a subprocess.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mist_compiler import cli

GOOD_PLAN = {"model": "gpt-tiny", "seq_len": 16, "global_batch": 4, "dtype": "float32", "grad_accum": 2,
             "stages": [{"layers": [0, 4], "nodes": 1, "gpus_per_node": 2, "micro_batch": 1, "dp": 2, "tp": 1}]}
MISTC = os.path.join(os.path.dirname(sys.executable), "mistc")


def plan_with(**changes) -> dict:
    plan = json.loads(json.dumps(GOOD_PLAN))
    stage_changes = changes.pop("stage", {})
    plan.update(changes)
    if stage_changes:
        plan["stages"][0].update(stage_changes)
    return plan


@pytest.fixture
def files(tmp_path):
    def write(name: str, content) -> str:
        path = tmp_path / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content if isinstance(content, str) else json.dumps(content))
        return str(path)

    write.dir = str(tmp_path)
    return write


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exit_:  # argparse: usage line + the option it rejects
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def assert_clean_error(code: int, output: str, *named: str) -> None:
    assert code not in (0, None), output
    assert "Traceback" not in output, output
    for text in named:
        assert text in output, f"{text!r} not named in: {output[-800:]}"
    assert len([line for line in output.strip().splitlines() if line.strip()]) <= 3, output


# ---- plans (read by analyze: the same loader and checks run, explain and torch.compile use) -------------

PLAN_CASES = [
    ("not JSON", "{not json", ["cannot be parsed"]),
    ("binary", b"\x00\xff\xfe\x00PK\x03\x04", ["cannot be parsed"]),
    ("empty", "", ["cannot be parsed"]),
    ("a list", [1, 2, 3], ["<plan>", "expected an object"]),
    ("missing stages", {k: v for k, v in GOOD_PLAN.items() if k != "stages"}, ["missing key(s) ['stages']"]),
    ("unknown key", plan_with(zero_bubble=True), ["unknown key(s) ['zero_bubble']"]),
    ("bad dtype", plan_with(dtype="int8"), ["plan field dtype"]),
    ("string seq", plan_with(seq_len="16"), ["plan field seq_len"]),
    ("zero seq", plan_with(seq_len=0), ["plan field seq_len", ">= 1"]),
    ("negative batch", plan_with(global_batch=-4), ["plan field global_batch"]),
    ("batch mismatch", plan_with(global_batch=8), ["stages[0].micro_batch", "global_batch = 8"]),
    ("empty stages", plan_with(stages=[]), ["plan field stages", "non-empty list"]),
    ("layers as string", plan_with(stage={"layers": "0-4"}), ["stages[0].layers"]),
    ("layers reversed", plan_with(stage={"layers": [4, 0]}), ["stages[0].layers", "start < end"]),
    ("layers beyond model", plan_with(stage={"layers": [0, 6]}), ["covers 6 layers", "has 4"]),
    ("layers short", plan_with(stage={"layers": [0, 3]}), ["covers 3 layers", "has 4"]),
    ("dp times tp", plan_with(stage={"dp": 3}), ["stages[0].dp", "dp * tp"]),
    ("huge dp", plan_with(stage={"dp": 10**30, "gpus_per_node": 10**30}), ["stages[0]"]),
    ("zero level", plan_with(stage={"zero": 5}), ["stages[0].zero", "0..3"]),
    ("offload ratio", plan_with(stage={"offload": {"weights": 1.5}}), ["stages[0].offload.weights"]),
    ("offload kind", plan_with(stage={"offload": {"kv_cache": 0.5}}), ["unknown key(s) ['kv_cache']"]),
    ("ckpt beyond layers", plan_with(stage={"ckpt_layers": 9}), ["stages[0].ckpt_layers"]),
    ("tp not dividing heads", plan_with(stage={"dp": 1, "tp": 2, "micro_batch": 2}),
     []),  # gpt-tiny: 4 heads, tp=2 is fine: the next case is the real one
    ("tp 8 on 4 heads", plan_with(global_batch=2, grad_accum=2, stage={"dp": 1, "tp": 8, "nodes": 4, "gpus_per_node": 2,
                                                                       "micro_batch": 1}),
     ["stages[0].tp", "tp=8"]),
    ("gpus per node beyond profile", plan_with(global_batch=32, grad_accum=1,
                                               stage={"dp": 32, "gpus_per_node": 32, "micro_batch": 1}),
     ["gpus_per_node"]),
    ("seq above positions", plan_with(seq_len=4096), ["seq_len", "4096"]),
    ("another model", plan_with(model="llama-tiny"), ["plan field model", "llama-tiny"]),
    ("yaml python tag", "!!python/object/apply:os.system ['echo hacked']", ["cannot be parsed"]),
]


@pytest.mark.parametrize("name, content, named", PLAN_CASES, ids=[c[0] for c in PLAN_CASES])
def test_bad_plans_are_named(name, content, named, files, capsys):
    suffix = ".yaml" if name == "yaml python tag" else ".json"
    path = files("plan" + suffix, content)
    code, output = run_cli(["analyze", "gpt-tiny", "--plan", path, "--hardware", "cpu"], capsys)
    if not named:  # a valid plan, kept to show the contrast: it is analysed
        assert code in (0, 1), output
        return
    assert_clean_error(code, output, *named)


def test_missing_and_directory_plan_paths(files, capsys):
    assert_clean_error(*run_cli(["analyze", "gpt-tiny", "--plan", "nope.json", "--hardware", "cpu"], capsys),
                       "nope.json", "does not exist")
    assert_clean_error(*run_cli(["analyze", "gpt-tiny", "--plan", files.dir, "--hardware", "cpu"], capsys),
                       "does not exist")


# ---- hardware profiles ---------------------------------------------------------------------------------

PROFILE_CASES = [
    ("unknown name", None, ["a100-12gb"]),
    ("not yaml", "{{{", ["profile"]),
    ("binary", b"\x00\x01\x02", ["profile"]),
    ("a list", "- 1\n- 2\n", ["profile"]),
    ("missing fields", "name: x\n", ["profile"]),
]


@pytest.mark.parametrize("name, content, named", PROFILE_CASES, ids=[c[0] for c in PROFILE_CASES])
def test_bad_profiles_are_named(name, content, named, files, capsys):
    plan = files("plan.json", GOOD_PLAN)
    hardware = "a100-12gb" if content is None else files("profile.yaml", content)
    code, output = run_cli(["analyze", "gpt-tiny", "--plan", plan, "--hardware", hardware], capsys)
    assert_clean_error(code, output, *named)


# ---- model specs ---------------------------------------------------------------------------------------

FACTORIES = '''
import torch
from torch import nn
def raises():
    raise RuntimeError("the factory broke")
def needs_argument(width):
    return nn.Linear(width, width)
def not_a_module():
    return 42
def not_a_language_model():
    return nn.Linear(4, 4)
class NoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)
    def forward(self, input_ids, labels):
        return nn.functional.cross_entropy(self.head(self.embed(input_ids)).view(-1, 16), labels.view(-1))
def no_layers():
    return NoLayers()
'''

MODEL_CASES = [
    ("unknown zoo name", "gpt5-tiny", ["unknown model 'gpt5-tiny'"]),
    ("hf missing file", "hf:/no/such/config.json", ["/no/such/config.json", "does not exist"]),
    ("hf bad json", "hf:{bad}", ["not valid JSON"]),
    ("hf unknown type", "hf:{unknown}", ["hf:"]),
    ("missing module", "no_such_package_xyz:build", ["no_such_package_xyz"]),
    ("missing function", "bad_factories:absent", ["absent"]),
    ("factory raises", "bad_factories:raises", ["bad_factories:raises", "the factory broke"]),
    ("factory needs argument", "bad_factories:needs_argument", ["bad_factories:needs_argument", "without arguments"]),
    ("factory returns int", "bad_factories:not_a_module", ["bad_factories:not_a_module", "not an nn.Module"]),
    ("not a language model", "bad_factories:not_a_language_model", ["not_a_language_model"]),
    ("no layer list", "bad_factories:no_layers", ["ModuleList"]),
]


@pytest.mark.parametrize("name, spec, named", MODEL_CASES, ids=[c[0] for c in MODEL_CASES])
def test_bad_model_specs_are_named(name, spec, named, files, capsys, monkeypatch):
    files("bad_factories.py", FACTORIES)
    monkeypatch.syspath_prepend(files.dir)
    monkeypatch.delitem(sys.modules, "bad_factories", raising=False)
    spec = spec.replace("{bad}", files("bad.json", "{oops")).replace(
        "{unknown}", files("unknown.json", {"model_type": "no-such-architecture"}))
    code, output = run_cli(["tune", spec, "--hardware", "cpu", "--nodes", "1", "--gpus-per-node", "1",
                            "--global-batch", "4", "--seq", "16", "--quiet"], capsys)
    assert_clean_error(code, output, *named)


# ---- command-line arguments ----------------------------------------------------------------------------

def _cli_cases(plan: str, out_dir: str) -> list[tuple[str, list[str], list[str]]]:
    tune = ["tune", "gpt-tiny", "--hardware", "cpu", "--quiet"]
    run = ["run", "gpt-tiny", "--plan", plan]
    return [
        ("tune nodes 0", tune + ["--nodes", "0", "--gpus-per-node", "1", "--global-batch", "4"], ["--nodes"]),
        ("tune gpus -1", tune + ["--nodes", "1", "--gpus-per-node", "-1", "--global-batch", "4"], ["--gpus-per-node"]),
        ("tune batch 0", tune + ["--nodes", "1", "--gpus-per-node", "1", "--global-batch", "0"], ["--global-batch"]),
        ("tune seq 0", tune + ["--nodes", "1", "--gpus-per-node", "1", "--global-batch", "4", "--seq", "0"], ["--seq"]),
        ("tune seq beyond positions", tune + ["--nodes", "1", "--gpus-per-node", "1", "--global-batch", "4",
                                              "--seq", "100000"], ["--seq", "100000"]),
        ("tune batch not divisible", tune + ["--nodes", "1", "--gpus-per-node", "2", "--global-batch", "3",
                                             "--seq", "16", "--space", "zero3"], ["global batch 3"]),
        ("tune dtype int8", tune + ["--nodes", "1", "--gpus-per-node", "1", "--global-batch", "4", "--dtype", "int8"],
         ["--dtype"]),
        ("tune unknown space", tune + ["--nodes", "1", "--gpus-per-node", "1", "--global-batch", "4",
                                       "--space", "magic"], ["--space"]),
        ("tune bad offload grid", tune + ["--nodes", "1", "--gpus-per-node", "1", "--global-batch", "4",
                                          "--offload-grid", "a,b"], ["--offload-grid"]),
        ("tune max stages 0", tune + ["--nodes", "1", "--gpus-per-node", "1", "--global-batch", "4",
                                      "--max-stages", "0"], ["--max-stages"]),
        ("tune output is a directory", tune + ["--nodes", "1", "--gpus-per-node", "1", "--global-batch", "4",
                                               "-o", out_dir], ["-o", "is a directory"]),
        ("tune output in a missing directory", tune + ["--nodes", "1", "--gpus-per-node", "1", "--global-batch", "4",
                                                       "-o", "/no/such/dir/plan.json"], ["-o", "does not exist"]),
        ("tune bad memory limit", tune + ["--nodes", "1", "--gpus-per-node", "1", "--global-batch", "4",
                                          "--memory-limit", "lots"], ["memory"]),
        ("run steps 0", run + ["--nproc-per-node", "2", "--steps", "0"], ["--steps"]),
        ("run timeout 0", run + ["--nproc-per-node", "2", "--timeout", "0"], ["--timeout"]),
        ("run port 99999", run + ["--nproc-per-node", "2", "--master-port", "99999"], ["--master-port", "99999"]),
        ("run nproc 0", run + ["--nproc-per-node", "0"], ["--nproc-per-node"]),
        ("run node rank", run + ["--nproc-per-node", "2", "--node-rank", "3"], ["--node-rank"]),
        ("run world mismatch", run + ["--nproc-per-node", "3"], ["needs 2 ranks", "launches 3"]),
        ("run negative lr", run + ["--nproc-per-node", "2", "--lr", "-1"], ["--lr"]),
        ("run other model", ["run", "llama-tiny", "--plan", plan, "--nproc-per-node", "2"], ["plan field model"]),
        ("run missing plan", ["run", "gpt-tiny", "--nproc-per-node", "2"], ["--plan"]),
        ("analyze missing plan", ["analyze", "gpt-tiny", "--hardware", "cpu"], ["--plan"]),
        ("explain output is a file", ["explain", plan, "-o", plan], ["-o", "is a file"]),
        ("explain hardware unknown", ["explain", plan, "--hardware", "tpu-v9"], ["tpu-v9"]),
        ("ir micro-batch 0", ["ir", "gpt-tiny", "--micro-batch", "0"], ["--micro-batch"]),
        ("ir lowering pass without plan", ["ir", "gpt-tiny", "--after", "partition"], ["--plan"]),
        ("ir unknown pass", ["ir", "gpt-tiny", "--after", "fusion"], ["--after"]),
        ("profile output is a directory", ["profile", "-o", out_dir], ["-o"]),
        ("demo nproc 0", ["demo", "--nproc", "0"], ["--nproc"]),
        ("unknown command", ["train-fast"], ["train-fast"]),
    ]


def test_bad_command_lines_are_named(files, capsys):
    plan = files("plan.json", GOOD_PLAN)
    out_dir = files.dir
    failures = []
    for name, argv, named in _cli_cases(plan, out_dir):
        code, output = run_cli(argv, capsys)
        try:
            assert_clean_error(code, output, *named)
        except AssertionError as error:
            failures.append(f"{name}: {error}")
    assert not failures, "\n".join(failures)
    assert len(_cli_cases(plan, out_dir)) >= 30


# ---- torch.compile options -----------------------------------------------------------------------------

OPTION_CASES = [
    ({"plan": "missing.json"}, ["missing.json"]),
    ({"plan": 42}, ["'plan'"]),
    ({"zero_level": 3, "plan": "x.json"}, ["zero_level"]),
    ({"timeout_s": 5}, ["global_batch", "hardware"]),
    ({"hardware": "cpu", "global_batch": 0}, ["global_batch"]),
    ({"hardware": "cpu", "global_batch": 8, "nodes": -1}, ["nodes"]),
]


@pytest.mark.parametrize("options, named", OPTION_CASES, ids=[str(sorted(o)) for o, _ in OPTION_CASES])
def test_bad_torch_compile_options_are_named(options, named):
    from mist_compiler.torch_compile.plan_runtime import parse_options

    with pytest.raises(ValueError) as error:
        parse_options(options)
    for text in named:
        assert text in str(error.value)


# ---- as typed, in a subprocess -------------------------------------------------------------------------

@pytest.mark.parametrize("argv, named", [
    (["tune", "gpt-tiny", "--hardware", "cpu", "--nodes", "1", "--gpus-per-node", "1", "--global-batch", "0"],
     ["--global-batch"]),
    (["run", "gpt-tiny", "--plan", "nope.json", "--nproc-per-node", "2"], ["nope.json"]),
    (["analyze", "nope-model", "--plan", "nope.json", "--hardware", "cpu"], ["nope.json"]),
])
def test_the_console_script_prints_one_line(argv, named):
    result = subprocess.run([MISTC, *argv], capture_output=True, text=True, timeout=120)
    assert_clean_error(result.returncode, result.stdout + result.stderr, *named)


# ---- the held-out sweep's last failures, and more of their kind -----------------------------------------

OUT_OF_RANGE_PLANS = [
    ("seq 10**30", plan_with(seq_len=10**30), ["plan field seq_len", "at most 2147483647"]),
    ("global batch 10**30", plan_with(global_batch=10**30, stage={"micro_batch": 10**30 // 4}),
     ["plan field global_batch", "at most"]),
    ("layers to 10**30", plan_with(stage={"layers": [0, 10**30]}), ["stages[0].layers", "<= 2147483647"]),
    ("tp 2**40", plan_with(stage={"tp": 2**40, "dp": 1}), ["stages[0].tp", "at most"]),
    ("seq infinite", '{"model": "gpt-tiny", "seq_len": 1e999, "global_batch": 4, "dtype": "float32", "grad_accum": 2, '
                     '"stages": [{"layers": [0, 4], "nodes": 1, "gpus_per_node": 2, "micro_batch": 1, "dp": 2, "tp": 1}]}',
     ["plan field seq_len", "expected an integer, got inf"]),
    ("offload NaN", '{"model": "gpt-tiny", "seq_len": 16, "global_batch": 4, "dtype": "float32", "grad_accum": 2, '
                    '"stages": [{"layers": [0, 4], "nodes": 1, "gpus_per_node": 2, "micro_batch": 1, "dp": 2, "tp": 1, '
                    '"offload": {"acts": NaN}}]}', ["stages[0].offload.acts", "[0, 1]"]),
]


@pytest.mark.parametrize("name, content, named", OUT_OF_RANGE_PLANS, ids=[c[0] for c in OUT_OF_RANGE_PLANS])
def test_out_of_range_numbers_in_a_plan_are_named(name, content, named, files, capsys):
    path = files("plan.json", content)
    assert_clean_error(*run_cli(["analyze", "gpt-tiny", "--plan", path, "--hardware", "cpu"], capsys), *named)


BROKEN_FACTORIES = {
    "does_not_parse.py": "import torch\ndef build(:\n    return None\n",
    "raises_on_import.py": "import torch\nraise RuntimeError('needs a GPU at import time')\n",
}
HF_IMPOSSIBLE = {
    "zero layers": ({"num_hidden_layers": 0}, "num_hidden_layers = 0"),
    "no vocabulary": ({"vocab_size": 0}, "vocab_size = 0"),
    "no heads": ({"num_attention_heads": 0}, "num_attention_heads = 0"),
    "kv heads not dividing": ({"num_key_value_heads": 3}, "num_key_value_heads = 3: must divide"),
    "hidden not dividing": ({"hidden_size": 30}, "hidden_size = 30: must be a multiple"),
    "negative epsilon": ({"rms_norm_eps": -1e-6}, "rms_norm_eps = -1e-06"),
    "no positions": ({"max_position_embeddings": 0}, "max_position_embeddings = 0"),
    "unknown activation": ({"hidden_act": "swishy"}, "hidden_act = 'swishy'"),
    "layers as text": ({"num_hidden_layers": "two"}, "num_hidden_layers = 'two'"),
    "dropout above 1": ({"attention_dropout": 1.5}, "attention_dropout = 1.5"),
}


@pytest.mark.parametrize("spec, named", [
    ("does_not_parse:build", ["does_not_parse:build", "does_not_parse.py line 2 does not parse"]),
    ("raises_on_import:build", ["raises_on_import:build", "RuntimeError: needs a GPU at import time"]),
], ids=["syntax error", "import raises"])
def test_factory_modules_that_do_not_import_are_named(spec, named, files, capsys, monkeypatch):
    for name, text in BROKEN_FACTORIES.items():
        files(name, text)
    monkeypatch.syspath_prepend(files.dir)
    monkeypatch.delitem(sys.modules, spec.split(":")[0], raising=False)
    code, output = run_cli(["ir", spec], capsys)
    assert_clean_error(code, output, *named)


@pytest.mark.parametrize("change, named", list(HF_IMPOSSIBLE.values()), ids=list(HF_IMPOSSIBLE))
def test_impossible_hugging_face_config_values_are_named(change, named, files, capsys):
    pytest.importorskip("transformers")
    config = {"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
    path = files("config.json", {**config, **change})
    code, output = run_cli(["ir", f"hf:{path}"], capsys)
    assert_clean_error(code, output, f"hf:{path}", "config field", named)


MORE_OPTION_CASES = [
    ({"timeout_s": "ten"}, ["'timeout_s'", "seconds"]),
    ({"hardware": "cpu", "global_batch": "8"}, ["'global_batch'", "integer"]),
    ({"hardware": "cpu", "global_batch": 8, "seq_len": 2**40}, ["'seq_len'", "2147483647"]),
    ({"hardware": "cpu", "global_batch": 8, "dtype": "int8"}, ["'dtype'", "bfloat16"]),
    ({"hardware": "cpu", "global_batch": 8, "attention": "sparse"}, ["'attention'", "flash"]),
    ({"hardware": "cpu", "global_batch": 8, "device": "gpu:zero"}, ["'device'", "torch device"]),
    ({"hardware": 3.5, "global_batch": 8}, ["'hardware'", "profile"]),
    ({"hardware": "cpu", "global_batch": 8, "timeout_s": float("inf")}, ["'timeout_s'"]),
]


@pytest.mark.parametrize("options, named", MORE_OPTION_CASES, ids=[str(o) for o, _ in MORE_OPTION_CASES])
def test_torch_compile_option_values_are_named(options, named):
    from mist_compiler.torch_compile.plan_runtime import parse_options

    with pytest.raises(ValueError) as error:
        parse_options(options)
    for text in named:
        assert text in str(error.value), str(error.value)


def test_a_torch_compile_plan_for_another_model_is_refused():
    from mist_compiler.ir.plan import Plan, PlanError
    from mist_compiler.models import build_model
    from mist_compiler.torch_compile.option_checks import check_plan_model

    module = build_model("gpt-tiny")
    check_plan_model(Plan.from_dict(GOOD_PLAN), module)  # a zoo plan for this very model
    check_plan_model(Plan.from_dict(plan_with(model=type(module).__name__)), module)  # tuned by the backend
    with pytest.raises(PlanError, match=r"plan field model: the plan was made for 'llama-tiny', which this "
                                        r"\w+ is not: .* there, .* here"):
        check_plan_model(Plan.from_dict(plan_with(model="llama-tiny")), module)
    with pytest.raises(PlanError, match=r"made for 'LlamaForCausalLM', not for this"):
        check_plan_model(Plan.from_dict(plan_with(model="LlamaForCausalLM")), module)


def test_an_indivisible_global_batch_is_not_called_a_memory_problem(capsys):
    code, output = run_cli(["tune", "gpt-tiny", "--hardware", "cpu", "--nodes", "1", "--gpus-per-node", "2",
                            "--global-batch", "3", "--seq", "16", "--space", "zero3", "--quiet"], capsys)
    assert_clean_error(code, output, "global batch 3 cannot be split", "divisible by 2")
    assert "fits in" not in output and "memory" not in output


@pytest.mark.parametrize("side, named", [
    ("{not json", ["frontiers side file", "cannot be read as JSON"]),
    ({"stage_estimates": [{"stable_s": "fast", "delta_s": 0.1}]}, ["stage_estimates[0].stable_s", "'fast'"]),
    ({"stage_estimates": [{"stable_s": 0.1, "delta_s": -1}]}, ["stage_estimates[0].delta_s", "-1"]),
    ({"stage_estimates": {"0": 1}}, ["stage_estimates: expected a list"]),
    ([1, 2], ["frontiers side file", "expected an object"]),
], ids=["not json", "text time", "negative time", "not a list", "a list"])
def test_explain_side_files_are_named(side, named, files, capsys):
    plan = files("plan.json", {**GOOD_PLAN, "grad_accum": 4, "stages": [{**GOOD_PLAN["stages"][0], "dp": 1,
                                                                          "gpus_per_node": 1}]})
    files("plan.frontiers.json", side)  # what mistc tune -o plan.json writes beside it
    assert_clean_error(*run_cli(["explain", plan], capsys), *named)


def test_out_of_range_command_line_numbers_are_named(files, capsys):
    huge = str(10**30)
    cases = [
        (["tune", "gpt-tiny", "--hardware", "cpu", "--nodes", "1", "--gpus-per-node", "1", "--global-batch", huge],
         ["--global-batch", "1048575"]),
        (["tune", "gpt-tiny", "--hardware", "cpu", "--nodes", huge, "--gpus-per-node", "1", "--global-batch", "4"],
         ["--nodes"]),
        (["ir", "gpt-tiny", "--seq", huge], ["--seq"]),
        (["ir", "gpt-tiny", "--seq", "100000"], ["--seq", "100000", "positions"]),
        (["ir", "gpt-tiny", "--micro-batch", huge], ["--micro-batch"]),
        (["train", "gpt-tiny", "--steps", huge], ["--steps"]),
        (["train", "gpt-tiny", "--steps", "2", "--clip", "-1"], ["--clip", "-1"]),
        (["train", "gpt-tiny", "--steps", "2", "--clip", "nan"], ["--clip", "nan"]),
        (["train", "gpt-tiny", "--steps", "2", "--weight-decay", "inf"], ["--weight-decay"]),
        (["train", "gpt-tiny", "--steps", "2", "--min-lr", "nan"], ["--min-lr"]),
        (["train", "gpt-tiny", "--steps", "2", "--min-lr", "1", "--lr", "0.1"], ["--min-lr", "above --lr"]),
        (["train", "gpt-tiny", "--steps", "2", "--peak-tflops", "-1"], ["--peak-tflops"]),
        (["train", "gpt-tiny", "--steps", "2", "--seed", "-1"], ["--seed"]),
        (["train", "gpt-tiny", "--steps", "2", "--max-bad-steps", "0"], ["--max-bad-steps"]),
        (["train", "gpt-tiny", "--steps", "2", "--keep-last", "2"], ["--keep-last needs --save-dir"]),
        (["train", "gpt-tiny", "--steps", "2", "--metrics", files.dir], ["--metrics", "is a directory"]),
        (["run", "gpt-tiny", "--plan", files("plan.json", GOOD_PLAN), "--nproc-per-node", "2", "--timeout", "inf"],
         ["--timeout"]),
        (["run", "gpt-tiny", "--plan", files("plan.json", GOOD_PLAN), "--nproc-per-node", "2", "--lr", "inf"], ["--lr"]),
    ]
    failures = []
    for argv, named in cases:
        code, output = run_cli(argv, capsys)
        try:
            assert_clean_error(code, output, *named)
        except AssertionError as error:
            failures.append(f"{' '.join(argv)}: {error}")
    assert not failures, "\n".join(failures)
