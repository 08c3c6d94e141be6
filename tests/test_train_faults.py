"""``mistc train`` under the faults of a multi-day job, as a user (or a scheduler) meets them: the
console script in a fresh process, 2 gloo ranks of gpt-tiny.

- preemption: SIGTERM to every process (as a scheduler sends it), SIGTERM to the launcher, Ctrl-C:
  the step finishes, a checkpoint of it is written, exit 75, and ``--resume`` continues;
- a second run into a directory in use, and a rerun without ``--resume``, are refused;
- divergence stops the run in one line, writes no NaN checkpoint, no export, valid JSON metrics;
- damaged checkpoints, unwritable or full save directories, uint32 tokens read as uint16 and a
  tokenizer without network are named in one line before any rank starts;
- a frozen rank (SIGSTOP) is reported within ``--timeout``; nodes launched with different options
  are refused naming the option (both ``heavy``: over a minute each).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tests.dist_utils import descendants, free_port

MISTC = os.path.join(os.path.dirname(sys.executable), "mistc")
PREEMPTED = 75


def _args(*argv: str, timeout: str = "60") -> list[str]:
    return [MISTC, "train", "gpt-tiny", "--nproc-per-node", "2", "--master-port", str(free_port()),
            "--timeout", timeout, *argv]


def _mistc(*argv: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(_args(*argv), capture_output=True, text=True, timeout=timeout, env=env)


def _one_error_line(result: subprocess.CompletedProcess, *named: str) -> str:
    output = result.stdout + result.stderr
    assert result.returncode not in (0, None) and "Traceback" not in output, output[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mistc train: error: "), result.stderr[-3000:]
    for text in named:
        assert text in lines[0], lines[0]
    return lines[0]


def _strict_rows(path) -> list[dict]:
    return [json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in {path}"))
            for line in open(path).read().splitlines()]


class Job:
    """A ``mistc train`` running in the background, its output collected line by line."""

    def __init__(self, argv: list[str], env: dict | None = None) -> None:
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                        start_new_session=True)
        self.out: list[str] = []
        self.err: list[str] = []
        self.readers = [threading.Thread(target=lambda s=s, k=k: k.extend(s), daemon=True)
                        for s, k in ((self.process.stdout, self.out), (self.process.stderr, self.err))]
        for reader in self.readers:
            reader.start()

    def wait_for_step(self, at_least: int, timeout_s: float = 240) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.process.poll() is None:
            steps = [int(line.split()[2].split("/")[0]) for line in list(self.out) if line.startswith("mist: step ")]
            if steps and steps[-1] >= at_least:
                return steps[-1]
            time.sleep(0.1)
        self.kill()
        raise AssertionError(f"no step {at_least}: {''.join(self.out)[-2000:]} {''.join(self.err)[-2000:]}")

    def signal(self, sig: int, every_process: bool = False) -> None:
        for pid in [self.process.pid, *(descendants(self.process.pid) if every_process else [])]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def finish(self, timeout_s: float = 120) -> int:
        try:
            code = self.process.wait(timeout=timeout_s)
        finally:
            self.kill()
        for reader in self.readers:
            reader.join(5)
        return code

    def kill(self) -> None:
        for pid in [*descendants(self.process.pid), self.process.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _preempted_line(job: Job, save_dir) -> int:
    """The step the launcher's one preemption line names (its checkpoint must be ``latest``)."""
    lines = [line for line in job.err if "preempted by" in line]
    assert len(lines) == 1 and "error" not in "".join(job.err), "".join(job.err)
    step = int(lines[0].split("after step ")[1].split(":")[0])
    assert f"saved {save_dir}/step-{step:06d}" in lines[0] and f"--resume {save_dir}" in lines[0], lines[0]
    assert (save_dir / "latest").read_text().strip() == f"step-{step:06d}"
    return step


@pytest.mark.distributed
def test_preempted_by_sigterm_to_every_process_saves_the_step_and_resumes(tmp_path):
    save_dir, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    env = {**os.environ, "MIST_CHECKPOINT_STALL": "10:30"}  # step 10's save is still being written at the signal
    job = Job(_args("--steps", "100000", "--save-dir", str(save_dir), "--save-every", "5", "--metrics", str(metrics)),
              env=env)
    job.wait_for_step(11)
    second = _mistc("--steps", "20", "--save-dir", str(save_dir))  # a second run into the directory in use
    _one_error_line(second, "in use by another run", f"pid {job.process.pid}")
    started = time.monotonic()
    job.signal(signal.SIGTERM, every_process=True)  # launcher, torchrun and both ranks, as a scheduler does
    assert job.finish() == PREEMPTED, "".join(job.out[-5:] + job.err)
    stop_s = time.monotonic() - started
    step = _preempted_line(job, save_dir)
    assert step >= 11 and stop_s < 60, (step, stop_s)
    assert not descendants(job.process.pid)
    listing = os.listdir(save_dir)
    assert "step-000010" in listing and not [name for name in listing if name.endswith(".tmp")], listing

    rerun = _mistc("--steps", "20", "--save-dir", str(save_dir))  # the same command without --resume
    _one_error_line(rerun, "already holds checkpoints", f"latest: step-{step:06d}", "--resume", "--overwrite")
    resumed = _mistc("--steps", str(step + 2), "--save-dir", str(save_dir), "--resume", str(save_dir),
                     "--metrics", str(metrics))
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert f"resumed at step {step}" in resumed.stdout
    assert [row["step"] for row in _strict_rows(metrics)] == list(range(1, step + 3))  # appended, not truncated
    assert (save_dir / "latest").read_text().strip() == f"step-{step + 2:06d}"


@pytest.mark.heavy
@pytest.mark.distributed
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_a_signal_to_the_launcher_saves_the_step_in_flight(tmp_path, sig):
    save_dir = tmp_path / "ck"
    job = Job(_args("--steps", "100000", "--save-dir", str(save_dir), "--save-every", "1000"))
    job.wait_for_step(3)
    job.signal(sig)
    assert job.finish() == PREEMPTED, "".join(job.err)
    assert any(f"mistc train: {signal.Signals(sig).name}: finishing the current step" in line for line in job.err)
    assert _preempted_line(job, save_dir) >= 3


@pytest.mark.distributed
def test_divergence_stops_in_one_line_without_nan_checkpoints_or_export(tmp_path):
    save_dir, metrics, export = tmp_path / "ck", tmp_path / "m.jsonl", tmp_path / "model.pt"
    result = _mistc("--steps", "20", "--lr", "1e30", "--clip", "0", "--save-dir", str(save_dir), "--save-every", "1",
                    "--metrics", str(metrics), "--export", str(export))
    line = _one_error_line(result, "training diverged: steps 2-4 (3 in a row, --max-bad-steps 3)",
                           f"the last checkpoint is {save_dir}/step-000001")
    assert result.returncode == 1, line
    assert sorted(os.listdir(save_dir)) == ["latest", "step-000001"] and not export.exists()
    rows = _strict_rows(metrics)
    assert [row["step"] for row in rows] == [1, 2, 3, 4] and all(row["loss"] is None for row in rows[1:])


# ---- refused before any rank starts ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint as the trainer lays it out (DCP files, mist.json with its manifest), written in this process:
    the launcher checks it before any rank starts."""
    import torch
    import torch.distributed.checkpoint as dcp

    from mist_compiler.training.integrity import build_manifest

    path = tmp_path_factory.mktemp("ck") / "ck" / "step-000002"
    dcp.save({"model.embed.weight": torch.randn(512, 64)}, storage_writer=dcp.FileSystemWriter(str(path)),
             no_dist=True)
    meta = {"model": "gpt-tiny", "plan": {}, "world": 2, "step": 2, "optimizer_steps": 2,
            "files": build_manifest(str(path), record_crcs=True)}
    (path / "mist.json").write_text(json.dumps(meta))
    return path


@pytest.fixture(scope="module")
def real_checkpoint(tmp_path_factory):
    """A real 2-rank checkpoint (step 2)."""
    root = tmp_path_factory.mktemp("real")
    result = _mistc("--steps", "2", "--save-dir", str(root / "ck"), "--save-every", "2")
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return root / "ck" / "step-000002"


def _damaged(checkpoint, tmp_path, damage) -> str:
    copy = tmp_path / "ck" / "step-000002"
    shutil.copytree(checkpoint, copy)
    damage(copy)
    return str(tmp_path / "ck")


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["truncated shard", "broken mist.json", "missing key", "missing shard"])
def test_damaged_checkpoints_are_named_before_launching(checkpoint, tmp_path, case):
    def damage(path):
        if case == "truncated shard":
            os.truncate(path / "__0_0.distcp", 1000)
        elif case == "missing shard":
            os.unlink(path / "__0_0.distcp")
        elif case == "broken mist.json":
            (path / "mist.json").write_text((path / "mist.json").read_text()[:-40])
        else:
            meta = json.loads((path / "mist.json").read_text())
            del meta["step"]
            (path / "mist.json").write_text(json.dumps(meta))

    where = _damaged(checkpoint, tmp_path, damage)
    named = {"truncated shard": ["__0_0.distcp has 1000 bytes", "truncated"],
             "missing shard": ["__0_0.distcp is missing"],
             "broken mist.json": ["mist.json is not valid JSON"],
             "missing key": ["mist.json has no ['step']"]}[case]
    _one_error_line(_mistc("--steps", "4", "--resume", where), "step-000002", *named)


@pytest.mark.heavy
@pytest.mark.distributed
def test_a_bit_flipped_shard_is_named_by_the_ranks(real_checkpoint, tmp_path):
    def flip(path):
        shard = path / "__1_0.distcp"
        with open(shard, "r+b") as handle:
            handle.seek(os.path.getsize(shard) // 2)
            byte = handle.read(1)
            handle.seek(-1, os.SEEK_CUR)
            handle.write(bytes([byte[0] ^ 0x10]))

    where = _damaged(real_checkpoint, tmp_path, flip)
    _one_error_line(_mistc("--steps", "4", "--resume", where), "step-000002 is damaged: __1_0.distcp is damaged in the "
                                                                "record of")


def test_unwritable_save_dir_and_export_are_named_before_launching(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    _one_error_line(_mistc("--steps", "2", "--save-dir", str(blocker / "ck")), "--save-dir", "not writable")
    _one_error_line(_mistc("--steps", "2", "--export", str(blocker / "out" / "model.pt")), "--export", "not writable")


@pytest.fixture
def tiny_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {result.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_save_dir_without_room_for_one_checkpoint_is_named_before_launching(tiny_disk):
    _one_error_line(_mistc("--steps", "2", "--save-dir", str(tiny_disk / "ck")), "--save-dir", "free, but one checkpoint "
                    "needs about", "no space left on device")


def test_uint32_tokens_read_as_uint16_and_an_offline_tokenizer_are_named_quickly(tmp_path):
    ids = np.random.default_rng(0).integers(1, 500, 8192)
    ids.astype("<u4").tofile(tmp_path / "tokens.bin")
    _one_error_line(_mistc("--steps", "2", "--data", str(tmp_path / "tokens.bin")), "uint32 tokens read as uint16",
                    "--data-dtype uint32")
    (tmp_path / "text.txt").write_text("some text to tokenise " * 200)
    env = {**os.environ, "HF_HOME": str(tmp_path / "empty-cache"), "HF_ENDPOINT": "http://127.0.0.1:9"}
    env.pop("HF_HUB_OFFLINE", None)
    started = time.monotonic()
    result = _mistc("--steps", "2", "--data", str(tmp_path / "text.txt"), "--tokenizer", "gpt2", env=env)
    _one_error_line(result, "--tokenizer 'gpt2'", "cannot be reached")
    assert time.monotonic() - started < 45  # was ~55 s of hub retries before the error


@pytest.mark.heavy
@pytest.mark.distributed
def test_a_stopped_rank_is_reported_within_the_timeout(tmp_path):
    job = Job(_args("--steps", "100000", timeout="20"))
    job.wait_for_step(3)
    launcher_children = descendants(job.process.pid)
    ranks = [pid for pid in launcher_children if "mist_compiler.training.worker" in open(f"/proc/{pid}/cmdline").read()]
    stopped = ranks[-1]
    os.kill(stopped, signal.SIGSTOP)
    started = time.monotonic()
    try:
        while time.monotonic() - started < 60 and not any("stalled" in line for line in job.out + job.err):
            time.sleep(0.2)
        reported_s = time.monotonic() - started
    finally:
        os.kill(stopped, signal.SIGCONT)
    code = job.finish(timeout_s=60)
    assert code == 1 and reported_s < 20, (reported_s, "".join(job.err), "".join(job.out[-5:]))
    line = "".join(job.err)
    assert "stops because rank" in line and "stalled: no heartbeat for" in line and "--timeout 20" in line, line


@pytest.mark.heavy
@pytest.mark.distributed
def test_nodes_launched_with_different_options_are_refused(tmp_path):
    port = str(free_port())
    common = [MISTC, "run", "gpt-tiny", "--nproc-per-node", "1", "--nnodes", "2", "--master-port", port,
              "--timeout", "60", "--steps", "2"]
    plan = {"model": "gpt-tiny", "seq_len": 16, "global_batch": 4, "dtype": "float32", "grad_accum": 1,
            "stages": [{"layers": [0, 4], "nodes": 2, "gpus_per_node": 1, "micro_batch": 2, "dp": 2, "tp": 1}]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    node0 = Job([*common, "--plan", str(tmp_path / "plan.json"), "--node-rank", "0", "--check"])
    node1 = Job([*common, "--plan", str(tmp_path / "plan.json"), "--node-rank", "1"])
    codes = [node0.finish(240), node1.finish(240)]
    assert codes == [1, 1], (node0.err, node1.err)
    for job in (node0, node1):
        assert any("--check is True on rank 0 (node 0) but False on rank 1 (node 1)" in line for line in job.err), job.err
