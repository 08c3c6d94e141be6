"""Every entry point as a user reaches it, in a fresh process: the README's commands and API snippet,
``torch.compile(backend="mist")`` without importing the package first, and plans that name code.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
MISTC = os.path.join(os.path.dirname(sys.executable), "mistc")
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, re.S)


def fenced_blocks(language: str) -> list[str]:
    """The fenced blocks opened by exactly ```language (a closing fence never opens one)."""
    found, inside, keep, lines = [], False, False, []
    for line in README.splitlines():
        if line.startswith("```"):
            if inside and keep:
                found.append("\n".join(lines))
            inside, keep, lines = not inside, line[3:].strip() == language, []
        elif inside:
            lines.append(line)
    return found


def shell(command: str, cwd, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(command, shell=True, cwd=str(cwd), capture_output=True, text=True, timeout=timeout, env=ENV)


COMPILE_SNIPPET = """
import torch{imports}
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
run = torch.compile(lambda x: model(x).sum(), backend="mist")
x = torch.randn(4, 8)
assert torch.allclose(run(x), model(x).sum())
print("ok")
"""


@pytest.mark.parametrize("imports", ["", "\nimport mist_compiler", "\nimport mist_compiler.torch_compile.backend as b"
                                                                     "\nb.register()"])
def test_the_backend_registers_once_however_it_is_reached(imports, tmp_path):
    result = subprocess.run([sys.executable, "-c", COMPILE_SNIPPET.format(imports=imports)], capture_output=True,
                            text=True, timeout=300, cwd=str(tmp_path), env=ENV)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_install_and_run_the_main_job(tmp_path):
    (install,) = [b for b in blocks("bash") if "mistc demo" in b]
    assert install.strip() == "pip install torch==2.13.0 && pip install -e . && mistc demo"
    result = shell(f"{MISTC} demo --out {tmp_path / 'demo'}", tmp_path)  # the install already happened
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "check: OK" in result.stdout and (tmp_path / "demo" / "plan.json").is_file()


def test_the_python_api_snippet_runs_as_written(tmp_path):
    (snippet,) = blocks("python")
    result = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=900,
                            cwd=str(tmp_path), env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "s per step" in result.stdout


SMALL = [("gpt2-22b", "gpt-tiny"), ("gpt2-7b", "gpt-tiny"), ("--hardware l4", "--hardware cpu"),
         ("--nodes 4 --gpus-per-node 8 --global-batch 512", "--nodes 1 --gpus-per-node 2 --global-batch 8 --seq 32")]


def test_the_commands_block_on_a_tiny_model(tmp_path):
    (commands,) = [b for b in fenced_blocks("") if "mistc tune" in b]
    ran = 0
    for line in [line for line in commands.splitlines() if line.startswith("mistc")]:
        command = line.split("  #")[0].strip()
        if "--nnodes" in command:
            continue  # a multi-node launch: shown for the syntax, needs the nodes
        for big, small in SMALL:
            command = command.replace(big, small)
        if command.startswith("mistc profile"):
            command += " --quick"
        if "tiny.json" in command and not (tmp_path / "tiny.json").exists():
            shutil.copy(tmp_path / "plan.json", tmp_path / "tiny.json")
        result = shell(command.replace("mistc", MISTC, 1), tmp_path)
        assert result.returncode == 0, f"{command}\n{(result.stdout + result.stderr)[-2500:]}"
        ran += 1
    assert ran >= 7
    assert json.loads((tmp_path / "plan.json").read_text())["model"] == "gpt-tiny"


EVIL = "import pathlib\npathlib.Path({marker!r}).write_text('imported')\ndef build():\n    raise SystemExit('ran')\n"


def test_a_plan_naming_importable_code_never_imports_it(tmp_path):
    marker = tmp_path / "IMPORTED"
    (tmp_path / "evil_plan_module.py").write_text(EVIL.format(marker=str(marker)))
    plan = {"model": "evil_plan_module:build", "seq_len": 16, "global_batch": 4, "dtype": "float32",
            "grad_accum": 2, "stages": [{"layers": [0, 4], "nodes": 1, "gpus_per_node": 2, "micro_batch": 1,
                                         "dp": 2, "tp": 1}]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), ENV["PYTHONPATH"]])}
    for argv in (["explain", "plan.json", "--hardware", "cpu"], ["analyze", "gpt-tiny", "--plan", "plan.json",
                                                                 "--hardware", "cpu"],
                 ["run", "gpt-tiny", "--plan", "plan.json", "--nproc-per-node", "2"],
                 ["ir", "gpt-tiny", "--plan", "plan.json", "--after", "partition"]):
        result = subprocess.run([MISTC, *argv], capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                                env=env)
        assert result.returncode != 0 and "evil_plan_module:build" in result.stderr, (argv, result.stderr[-800:])
        assert not marker.exists(), f"mistc {argv[0]} imported the module a plan names"
