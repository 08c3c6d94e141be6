"""The pieces a long job relies on, each fed the fault it exists for (in-process, seconds each):
metrics rows, the save-directory lock and ownership, free space and writability, keep-last,
checkpoint manifests against truncated and bit-flipped files, token widths, an offline tokenizer,
a stalled rank, stop requests and nodes launched with different options."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from mist_compiler.training import save_dir as sd
from mist_compiler.training.integrity import (CheckpointError, build_manifest, check_manifest, nonfinite_keys,
                                              verify_data_files)
from mist_compiler.training.metrics import MetricsLog, json_safe, read_metrics
from tests.dist_utils import run_ranks


def _strict(line: str):
    return json.loads(line, parse_constant=lambda name: pytest.fail(f"bare {name} in a metrics row"))


# ---- metrics -------------------------------------------------------------------------------------------

def test_metrics_rows_are_strict_json_and_a_partial_row_is_kept_apart_and_skipped(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')  # a run killed while writing row 2
    warnings: list[str] = []
    log = MetricsLog(str(path), warn=warnings.append)
    log.write({"step": 2, "loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3})
    log.close()
    assert len(warnings) == 1 and "partial row" in warnings[0]
    lines = path.read_text().splitlines()
    assert lines[0] == '{"step": 1, "loss": 2.0}' and lines[1] == '{"step": 2, "lo'  # appended, nothing truncated
    assert _strict(lines[2]) == {"step": 2, "loss": None, "grad_norm": None, "lr": 1e-3}
    skipped: list[str] = []
    rows = read_metrics(str(path), warn=skipped.append)
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["loss"] is None
    assert len(skipped) == 1 and "line 2" in skipped[0]
    assert json_safe({"a": [1.0, float("-inf")]}) == {"a": [1.0, None]}


# ---- the save directory ----------------------------------------------------------------------------------

def test_a_second_run_is_refused_while_the_first_holds_the_directory(tmp_path):
    first = sd.RunLock.acquire(str(tmp_path), command="mistc train a")
    with pytest.raises(CheckpointError, match=rf"in use by another run \(pid {os.getpid()} on {socket.gethostname()}"):
        sd.RunLock.acquire(str(tmp_path))
    first.release()
    assert not (tmp_path / sd.LOCK).exists()
    sd.RunLock.acquire(str(tmp_path)).release()


def test_stale_locks_are_taken_over_and_live_ones_on_other_hosts_are_not(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    lock = tmp_path / sd.LOCK
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "started": time.time()}))
    warnings: list[str] = []
    sd.RunLock.acquire(str(tmp_path), warn=warnings.append).release()
    assert "stale lock" in warnings[0] and f"pid {dead.pid}" in warnings[0]
    lock.write_text(json.dumps({"host": "node-elsewhere", "pid": 1, "started": time.time()}))
    with pytest.raises(CheckpointError, match="node-elsewhere"):  # refreshed just now: alive
        sd.RunLock.acquire(str(tmp_path))
    old = time.time() - 2 * sd.STALE_AFTER_S
    os.utime(lock, (old, old))
    sd.RunLock.acquire(str(tmp_path), warn=warnings.append).release()
    assert "has not refreshed it" in warnings[-1]


def _fake_checkpoint(root, step: int) -> str:
    path = os.path.join(root, f"step-{step:06d}")
    os.makedirs(path)
    for name in (".metadata", sd.META):
        with open(os.path.join(path, name), "w") as handle:
            handle.write("{}")
    return path


def test_a_directory_with_checkpoints_needs_resume_or_overwrite(tmp_path):
    root = str(tmp_path / "ck")
    sd.check_ownership(root, None, False)  # empty: fine
    _fake_checkpoint(root, 5)
    (tmp_path / "ck" / "latest").write_text("step-000005\n")
    with pytest.raises(CheckpointError, match=r"already holds checkpoints \(latest: step-000005\).*--resume.*--overwrite"):
        sd.check_ownership(root, None, False)
    sd.check_ownership(root, root, False)
    sd.check_ownership(root, os.path.join(root, "step-000005"), False)
    with pytest.raises(CheckpointError):
        sd.check_ownership(root, str(tmp_path / "elsewhere"), False)
    sd.check_ownership(root, None, True)
    sd.clear_checkpoints(root)
    assert os.listdir(root) == []


def test_keep_last_removes_old_checkpoints_and_dead_runs_leftovers_only(tmp_path):
    root = str(tmp_path)
    for step in (2, 4, 6, 8):
        _fake_checkpoint(root, step)
    os.makedirs(os.path.join(root, "step-000003.tmp"))  # a run that died while saving
    os.makedirs(os.path.join(root, "step-000010.tmp"))  # the save in flight
    (tmp_path / "latest").write_text("step-000008\n")
    removed = sd.prune(root, 2, newest=10)
    assert sorted(removed) == ["step-000002", "step-000003.tmp", "step-000004"]
    assert sorted(os.listdir(root)) == ["latest", "step-000006", "step-000008", "step-000010.tmp"]
    assert sd.prune(root, 0, newest=10) == []


def test_unwritable_and_full_directories_are_named(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError, match=r"--save-dir .*a-file/ck: not writable"):
        sd.check_writable("--save-dir", str(blocker / "ck"), 0)
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        with pytest.raises(CheckpointError, match="not writable .Permission denied"):
            sd.check_writable("--save-dir", str(locked), 0)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 2_000_000, 2_000_000))
    with pytest.raises(CheckpointError, match=r"--export .*: 2.0 MB free, but the model needs about 5.0 MB "
                                              r"\(no space left on device\)"):
        sd.check_writable("--export", str(tmp_path), 5_000_000, what="the model")


# ---- manifests: truncated, bit-flipped, broken -----------------------------------------------------------

@pytest.fixture
def checkpoint(tmp_path):
    """A DCP checkpoint of a few tensors (one process) with its manifest, as the trainer writes it."""
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "step-000004"
    state = {f"model.layers.{i}.weight": torch.randn(64, 64) for i in range(3)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path), thread_count=1), no_dist=True)
    meta = {"model": "m", "plan": {}, "world": 1, "step": 4, "optimizer_steps": 4,
            "files": build_manifest(str(path), record_crcs=True)}
    (path / sd.META).write_text(json.dumps(meta))
    return str(path), meta


def test_an_intact_checkpoint_passes_and_its_manifest_costs_no_data_pass(checkpoint):
    path, meta = checkpoint
    assert set(meta["files"]) == {".metadata", "__0_0.distcp"} and "crc32" not in meta["files"]["__0_0.distcp"]
    check_manifest(path, meta)
    assert verify_data_files(path, meta) == []
    assert sd.read_meta(path)["step"] == 4


def test_a_truncated_shard_is_named_before_loading(checkpoint):
    path, meta = checkpoint
    shard = os.path.join(path, "__0_0.distcp")
    os.truncate(shard, os.path.getsize(shard) - 100)
    with pytest.raises(CheckpointError, match=r"__0_0.distcp has \d+ bytes, the manifest says \d+ \(truncated"):
        check_manifest(path, meta)


@pytest.mark.parametrize("where", ["data", "zip header"])
def test_flipped_bytes_name_the_file_and_the_tensor(checkpoint, where):
    path, meta = checkpoint
    shard = os.path.join(path, "__0_0.distcp")
    raw = bytearray(open(shard, "rb").read())
    if where == "data":  # 16 weight values of layer 1 overwritten, as a bad disk or a stray write would
        offsets = sorted(info.offset for info in _storage(path).values())
        start = offsets[1] + (offsets[2] - offsets[1]) // 2
        raw[start:start + 64] = bytes(64)
    else:
        at = raw.index(b"PK\x03\x04", 10)
        raw[at + 1] ^= 0x40
    open(shard, "wb").write(bytes(raw))
    check_manifest(path, meta)  # same size: only the data check finds it
    problems = verify_data_files(path, meta)
    assert len(problems) == 1 and problems[0].startswith("__0_0.distcp is damaged in the record of model.layers.")


def _storage(path: str) -> dict:
    import torch.distributed.checkpoint as dcp

    return dcp.FileSystemReader(path).read_metadata().storage_data


def test_broken_or_incomplete_mist_json_and_metadata_are_named(checkpoint):
    path, meta = checkpoint
    file = os.path.join(path, sd.META)
    with open(file, "w") as handle:
        handle.write('{"model": "m", "step": ')
    with pytest.raises(CheckpointError, match=r"step-000004' is damaged: mist.json is not valid JSON"):
        sd.read_meta(path)
    with open(file, "w") as handle:
        json.dump({k: v for k, v in meta.items() if k != "optimizer_steps"}, handle)
    with pytest.raises(CheckpointError, match=r"mist.json has no \['optimizer_steps'\]"):
        sd.read_meta(path)
    with open(os.path.join(path, ".metadata"), "r+b") as handle:
        handle.seek(40)
        handle.write(b"\xff\xff")
    with pytest.raises(CheckpointError, match=r"\.metadata does not match its CRC-32"):
        check_manifest(path, meta)


def test_non_finite_values_are_found_in_tensors_and_chunks():
    class Chunks:
        chunks = {(0,): torch.tensor([1.0, float("nan")])}

    state = {"ok": torch.ones(3), "rng": torch.zeros(4, dtype=torch.uint8), "bad": Chunks(), "inf": torch.tensor([1e38]) * 10}
    assert nonfinite_keys(state) == ["bad", "inf"]


# ---- data ----------------------------------------------------------------------------------------------

def test_uint32_tokens_read_as_uint16_are_refused(tmp_path):
    from mist_compiler.training.data import DataError, TokenSampler, open_tokens

    ids = np.random.default_rng(0).integers(1, 500, 4096)
    ids.astype("<u4").tofile(tmp_path / "tokens.bin")
    ids.astype("<u2").tofile(tmp_path / "right.bin")
    wrong = TokenSampler(open_tokens(str(tmp_path / "tokens.bin")), 4, 16, path="tokens.bin")
    with pytest.raises(DataError, match=r"looks like uint32 tokens read as uint16.*--data-dtype uint32"):
        wrong.check_vocab(512)
    TokenSampler(open_tokens(str(tmp_path / "right.bin")), 4, 16).check_vocab(512)
    TokenSampler(open_tokens(str(tmp_path / "tokens.bin"), dtype="uint32"), 4, 16).check_vocab(512)


def test_a_tokenizer_name_without_network_fails_in_seconds(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from mist_compiler.training.tokenizers import TokenizerError, load_tokenizer

    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-cache"))  # nothing cached
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: no network
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    load_tokenizer.cache_clear()
    started = time.perf_counter()
    with pytest.raises(TokenizerError, match=r"--tokenizer 'gpt2' is not a local directory nor in the Hugging Face "
                                             r"cache, and http://127.0.0.1:9 cannot be reached"):
        load_tokenizer("gpt2")
    assert time.perf_counter() - started < 15


# ---- ranks: a stalled one, stop requests, options that differ --------------------------------------------

@pytest.mark.exclusive  # a 0.6 s heartbeat timeout
def test_a_stalled_rank_is_reported_by_the_rank_watching_it(monkeypatch):
    from mist_compiler.runtime import failure

    monkeypatch.setattr(failure, "HEARTBEAT_S", 0.02)
    store = dist.HashStore()
    seen: list[str] = []
    monitors = [failure.FailureMonitor(rank, 4, timeout_s=0.6, on_peer_failure=seen.append, heartbeats=True,
                                       store=store) for rank in range(4)]
    time.sleep(0.2)
    stopped_at = time.monotonic()
    monitors[2].stop()  # rank 2's process is frozen: its heartbeat thread stops with it
    while not seen and time.monotonic() - stopped_at < 5:
        time.sleep(0.02)
    elapsed = time.monotonic() - stopped_at
    watcher = "rank 1 stops because rank 2 failed: stalled: no heartbeat"
    while not any(watcher in message for message in seen) and time.monotonic() - stopped_at < 5:
        time.sleep(0.02)  # the others read rank 1's report from the store: one of them may print first
    for monitor in monitors:
        monitor.stop()
    assert any(watcher in message for message in seen), seen
    assert all("because rank 2 failed: stalled: no heartbeat" in message for message in seen), seen
    assert elapsed < 0.6, f"reported {elapsed:.2f} s after the last heartbeat; --timeout was 0.6 s"


def test_stop_requests_count_repeated_sigterms_once():
    from mist_compiler.training.preemption import StopRequest

    stop = StopRequest().install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's and the launcher's
        time.sleep(0.05)
        assert stop.requested and stop.signal_name == "SIGTERM"
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def _launched_with(rank: int, world: int) -> str:
    from mist_compiler.launch.worker import OptionMismatch, check_same_options

    os.environ["GROUP_RANK"] = str(rank)  # one rank per "node"
    try:
        check_same_options({"model": "gpt-tiny", "plan": "{...}", "check": rank == 0, "debug": rank == 1}, rank)
    except OptionMismatch as error:
        return str(error)
    return ""


def test_nodes_launched_with_different_options_are_refused_naming_the_option():
    messages = run_ranks(_launched_with, world=2, timeout_s=60)
    assert messages[0] == messages[1]
    assert "--check is True on rank 0 (node 0) but False on rank 1 (node 1)" in messages[0]
    assert "--debug" not in messages[0]


def test_describe_failure_finds_the_os_error_in_dcp_failures():
    from torch.distributed.checkpoint.api import CheckpointException

    from mist_compiler.training.checkpoint import describe_failure

    full = OSError(28, "No space left on device", "/ck/step-000004.tmp/__1_0.distcp")
    error = CheckpointException("save failed", {1: (full, None)})
    assert describe_failure(error) == "No space left on device: /ck/step-000004.tmp/__1_0.distcp"
    assert not isinstance(error, Exception)  # why the trainer catches BaseException around DCP
