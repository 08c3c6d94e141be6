"""The Trainer under the faults of a long job, on one gloo rank (the code every rank runs):
divergence (NaN loss) never updates weights or writes a non-finite checkpoint, a damaged checkpoint
is named on resume, and a full disk mid-run ends the run naming the cause while the previous
checkpoint stays resumable."""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from tests.dist_utils import run_ranks

PLAN = {"model": "gpt-tiny", "seq_len": 16, "global_batch": 4, "dtype": "float32", "grad_accum": 1,
        "stages": [{"layers": [0, 4], "nodes": 1, "gpus_per_node": 1, "micro_batch": 4, "dp": 1, "tp": 1}]}


def _trainer(config: dict):
    from mist_compiler.training.trainer import TrainConfig, Trainer

    return Trainer("gpt-tiny", PLAN, TrainConfig.from_dict({"timeout_s": 60, **config}), say=lambda line: None)


def _weights(trainer) -> dict:
    return {name: tensor.clone() for name, tensor in trainer.engine.gather_full_state().items()}


def _diverge_then_resume_damaged(rank: int, world: int, root: str) -> dict:
    import torch

    from mist_compiler.training.integrity import CheckpointError
    from mist_compiler.training.trainer import DivergenceError

    out: dict = {}
    trainer = _trainer({"steps": 8, "save_dir": f"{root}/ck", "save_every": 1, "metrics": f"{root}/m.jsonl",
                        "max_bad_steps": 2, "optim": {"lr": 1e30, "min_lr": 1e29, "clip": 0.0}})
    before = _weights(trainer)
    after: dict[int, dict] = {}
    train_step = trainer.train_step

    def step_and_keep(*args, **kwargs):
        row = train_step(*args, **kwargs)
        after[row["step"]] = _weights(trainer)
        return row

    trainer.train_step = step_and_keep
    try:
        trainer.fit()
    except DivergenceError as error:
        out["error"] = str(error)
    out["changed_by_step_1"] = any(not torch.equal(before[n], after[1][n]) for n in before)
    out["unchanged_after"] = [step for step in (2, 3) if all(torch.equal(after[1][n], after[step][n]) for n in before)]
    trainer.checkpointer.wait()

    # a non-finite value never reaches a checkpoint, nor an export
    part, _ = next(trainer.optimizer.views[0].bucket.master.overlapping(0, 1))
    part.fill_(float("nan"))
    trainer.checkpointer.blocking = True
    try:
        trainer.checkpointer.save(99, trainer._meta())
    except CheckpointError as error:
        out["nan_save"] = str(error)
    try:
        trainer.export(f"{root}/model.pt")
    except ValueError as error:
        out["nan_export"] = str(error)
    out["listing"] = sorted(os.listdir(f"{root}/ck"))
    trainer.close()

    # resuming a checkpoint whose shard has 16 values overwritten names the file and the tensor
    damaged = f"{root}/damaged/step-000001"
    shutil.copytree(f"{root}/ck/step-000001", damaged)
    shard = os.path.join(damaged, "__0_0.distcp")
    with open(shard, "r+b") as handle:
        handle.seek(os.path.getsize(shard) // 2)
        handle.write(bytes(64))
    try:
        _trainer({"steps": 4, "resume": damaged}).close()
    except CheckpointError as error:
        out["damaged"] = str(error)
    return out


@pytest.mark.distributed
def test_divergence_updates_nothing_and_stops_and_damage_is_named_on_resume(tmp_path):
    out = run_ranks(_diverge_then_resume_damaged, world=1, args=(str(tmp_path),), timeout_s=300)[0]
    assert out["changed_by_step_1"] and out["unchanged_after"] == [2, 3], out
    assert out["error"].startswith("training diverged: steps 2-3 (2 in a row, --max-bad-steps 2) had a non-finite loss")
    assert f"the last checkpoint is {tmp_path}/ck/step-000001" in out["error"]
    assert "inf or NaN" in out["nan_save"] and "not written" in out["nan_save"]
    assert "--export" in out["nan_export"] and "not written" in out["nan_export"] and not (tmp_path / "model.pt").exists()
    assert out["listing"] == [".lock", "latest", "step-000001"]  # the diverged steps and the NaN state: never saved
    assert sorted(os.listdir(tmp_path / "ck")) == ["latest", "step-000001"]  # the run released its directory
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step-000001"
    rows = [json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c}"))
            for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"] is None, r.get("diverged", False)) for r in rows] == \
        [(1, False, False), (2, True, True), (3, True, True)]
    assert "checkpoint" in out["damaged"] and "__0_0.distcp is damaged in the record of" in out["damaged"], out


def _fill_the_disk(rank: int, world: int, save_dir: str) -> dict:
    from mist_compiler.training.integrity import CheckpointError

    trainer = _trainer({"steps": 6, "save_dir": save_dir, "save_every": 1})
    out = {}
    try:
        trainer.fit()
    except CheckpointError as error:
        out["error"] = str(error)
    out["step"] = trainer.step
    trainer.engine.close()
    return out


@pytest.fixture
def small_disk(tmp_path):
    """A 5 MB tmpfs: one gpt-tiny checkpoint (3.5 MB) fits, a second does not (needs root to mount)."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(mount)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {result.stderr.decode().strip()}")
    yield str(mount)
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.distributed
def test_a_full_disk_mid_run_stops_naming_the_cause_and_keeps_the_last_checkpoint(small_disk):
    out = run_ranks(_fill_the_disk, world=1, args=(f"{small_disk}/ck",), timeout_s=300)[0]
    assert "No space left on device" in out["error"] and f"{small_disk}/ck/step-000002.tmp" in out["error"], out
    assert out["step"] <= 3  # the next step boundary stops the run
    assert open(f"{small_disk}/ck/latest").read().strip() == "step-000001"
    from mist_compiler.training.integrity import check_manifest, verify_data_files
    from mist_compiler.training.save_dir import read_meta

    meta = read_meta(f"{small_disk}/ck/step-000001")
    check_manifest(f"{small_disk}/ck/step-000001", meta)
    assert verify_data_files(f"{small_disk}/ck/step-000001", meta) == []
