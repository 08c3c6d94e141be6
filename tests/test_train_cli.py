"""``mistc train`` as a user types it (the venv's console script, a fresh process each time)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.dist_utils import descendants, free_port
from tests.train_runs import plan, stage


def _mistc(*argv: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    command = [os.path.join(os.path.dirname(sys.executable), "mistc"), *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def _launch(*argv: str) -> list[str]:
    return [*argv, "--master-port", str(free_port()), "--timeout", "60"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """gpt-tiny out of the box (bundled text, default plan) on 2 ranks: 4 steps, saves at 2 and 4."""
    root = tmp_path_factory.mktemp("train")
    result = _mistc("train", *_launch("gpt-tiny", "--steps", "4", "--nproc-per-node", "2", "--metrics",
                                      str(root / "m.jsonl"), "--save-dir", str(root / "ck"), "--save-every", "2",
                                      "--export", str(root / "model.pt")))
    return root, result


@pytest.mark.distributed
def test_mistc_train_out_of_the_box_logs_metrics_checkpoints_and_exports(trained):
    root, result = trained
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "Traceback" not in output
    lines = [line for line in result.stdout.splitlines() if line.startswith("mist: step ")]
    assert [line.split()[2] for line in lines] == ["1/4:", "2/4:", "3/4:", "4/4:"], output[-3000:]
    assert all("loss" in line and "lr" in line and "grad norm" in line and "tokens/s" in line for line in lines)
    rows = [json.loads(line) for line in (root / "m.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert all({"loss", "lr", "grad_norm", "tokens_per_s"} <= set(row) for row in rows)
    assert (root / "ck" / "latest").read_text().strip() == "step-000004"
    assert sorted(os.listdir(root / "ck")) == ["latest", "step-000002", "step-000004"]
    state = torch.load(root / "model.pt", weights_only=True)
    assert state["embed.weight"].shape == (512, 64) and len(state) > 10


@pytest.mark.distributed
def test_mistc_train_resume_exact_appends_the_remaining_steps(trained):
    root, first = trained
    assert first.returncode == 0
    result = _mistc("train", *_launch("gpt-tiny", "--steps", "6", "--nproc-per-node", "2", "--resume",
                                      str(root / "ck"), "--resume-exact", "--metrics", str(root / "m.jsonl")))
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "resumed at step 4" in result.stdout
    rows = [json.loads(line) for line in (root / "m.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]


@pytest.mark.distributed
def test_killing_every_rank_during_a_save_resumes_from_the_last_complete_checkpoint(tmp_path):
    save_dir = tmp_path / "ck"
    env = {**os.environ, "MIST_CHECKPOINT_STALL": "4:120"}  # step 4's save is written, then stalls before publishing
    command = [os.path.join(os.path.dirname(sys.executable), "mistc"), "train",
               *_launch("gpt-tiny", "--steps", "6", "--nproc-per-node", "2", "--save-dir", str(save_dir),
                        "--save-every", "2")]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    deadline = time.monotonic() + 120
    while not (save_dir / "step-000004.tmp" / ".metadata").exists():
        assert process.poll() is None and time.monotonic() < deadline, "the stalled save never appeared"
        time.sleep(0.2)
    for pid in reversed([process.pid, *descendants(process.pid)]):  # every rank, torchrun, the launcher
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.communicate(timeout=30)
    assert (save_dir / "latest").read_text().strip() == "step-000002"
    result = _mistc("train", *_launch("gpt-tiny", "--steps", "6", "--nproc-per-node", "2", "--resume", str(save_dir),
                                      "--save-dir", str(save_dir), "--save-every", "2"))
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "resumed at step 2" in result.stdout
    assert (save_dir / "latest").read_text().strip() == "step-000006"
    assert sorted(os.listdir(save_dir)) == ["latest", "step-000002", "step-000004", "step-000006"]  # stale .tmp gone


def _error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode != 0
    assert "Traceback" not in result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mistc train: error: "), result.stderr
    return lines[0]


def test_missing_and_short_data_are_refused_before_launching(tmp_path):
    line = _error_line(_mistc("train", "gpt-tiny", "--steps", "2", "--data", str(tmp_path / "nope.bin")))
    assert "does not exist" in line
    short = tmp_path / "short.txt"
    short.write_text("too short for a batch")
    line = _error_line(_mistc("train", "gpt-tiny", "--steps", "2", "--data", str(short)))
    assert "fewer than one global batch" in line


@pytest.mark.distributed
def test_checkpoint_of_another_model_and_exact_resume_on_another_world_are_refused(trained, tmp_path):
    root, first = trained
    assert first.returncode == 0
    line = _error_line(_mistc("train", "llama-tiny", "--steps", "8", "--resume", str(root / "ck")))
    assert "saved for model 'gpt-tiny'" in line
    one_rank = tmp_path / "plan.json"
    one_rank.write_text(json.dumps(plan([stage((0, 4))])))
    line = _error_line(_mistc("train", "gpt-tiny", "--steps", "8", "--plan", str(one_rank), "--resume",
                              str(root / "ck"), "--resume-exact"))
    assert "--resume-exact" in line and "another plan" in line
