"""``mistc run`` as a user types it: torchrun launch of the worker, --check against one-process training."""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import pytest

from mist_compiler.cli import run as run_command
from tests.dist_utils import free_port

PLAN = {"model": "gpt-tiny", "seq_len": 16, "global_batch": 4, "dtype": "float32", "grad_accum": 2,
        "stages": [{"layers": [0, 2], "nodes": 1, "gpus_per_node": 1, "micro_batch": 2, "dp": 1, "tp": 1, "zero": 0},
                   {"layers": [2, 4], "nodes": 1, "gpus_per_node": 1, "micro_batch": 2, "dp": 1, "tp": 1,
                    "ckpt_layers": 1}]}


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    run_command.add_arguments(parser)
    return parser.parse_args(list(argv))


def _plan_file(tmp_path, plan=PLAN) -> str:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    return str(path)


def _mistc() -> list[str]:
    """The console script the install put next to this interpreter, as a user would type it."""
    return [os.path.join(os.path.dirname(sys.executable), "mistc")]


@pytest.mark.distributed
def test_mistc_run_trains_and_checks_against_one_process(tmp_path):
    argv = ["run", "--nproc-per-node", "2", "--master-port", str(free_port()), "gpt-tiny",
            "--plan", _plan_file(tmp_path), "--steps", "2", "--check", "--timeout", "60"]
    result = subprocess.run(_mistc() + argv, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert re.search(r"^mist: check: OK: largest difference", result.stdout, re.M), output[-3000:]
    steps = re.findall(r"^mist: step (\d)/2: loss ([0-9.]+)", result.stdout, re.M)
    assert [s for s, _ in steps] == ["1", "2"], output[-3000:]
    assert "Traceback" not in output


def test_mistc_run_rejects_a_plan_for_another_world_before_launching(tmp_path):
    plan = _plan_file(tmp_path)
    with pytest.raises(run_command.RunArgumentError, match="needs 2 ranks but --nnodes 1 x --nproc-per-node 4 launches 4"):
        run_command.run(_args("--nproc-per-node", "4", "gpt-tiny", "--plan", plan))
    with pytest.raises(ValueError, match="unknown model"):
        run_command.run(_args("--nproc-per-node", "2", "no-such-model", "--plan", plan))


def test_torchrun_command_names_the_worker_and_rendezvous(tmp_path):
    args = _args("--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                 "--master-port", "1234", "gpt-tiny", "--plan", _plan_file(tmp_path), "--check")
    command = run_command.torchrun_command(args, 1234)
    assert command[1:3] == ["-m", "mist_compiler.launch.agent"]  # torchrun, with mist's SIGTERM/SIGINT handling
    for flag in ("--nproc-per-node=2", "--nnodes=2", "--node-rank=1", "--master-addr=10.0.0.1", "--master-port=1234"):
        assert flag in command
    assert "mist_compiler.launch.worker" in command and "--check" in command
