"""Checkpoint cost on CPU gloo ranks: save and load time, and how long a training step stalls for an
asynchronous save against a blocking one.

For each model (``gpt-small`` and the larger zoo ``llama-350m`` by default), 2 ranks train under a
data-parallel ZeRO-1 plan (each rank owns half the optimizer state, so both write):

- ``step``: a training step without saving (median of 3 after a warm-up);
- ``blocking stall``: a step followed by a blocking save (staging + DCP write + publish) minus ``step``;
- ``async stall``: what the step waits for with an asynchronous save (staging to CPU; the write runs in
  a background thread), and ``async write``: that background write, start to rename;
- ``next step (async)``: the step that runs while the background write is in flight (on two cores
  the writer competes with the ranks for CPU);
- ``load``: resuming from the checkpoint (DCP read + resharding into the buffers + weight rebuild);
- ``size``: bytes on disk (fp32 masters and both Adam moments).

Integrity (``--integrity``, :mod:`mist_compiler.training.integrity`), blocking saves and resumes of the
same state, medians of ``--repeat`` (wall and CPU seconds of rank 0; the overheads use the CPU seconds,
which the load of a shared machine changes least):

- ``save``: a blocking save as shipped (torch.save's record CRC-32s + the manifest) against the same
  save without the manifest (what saves cost before it), and with torch's record CRCs off too (no
  checksum computed at all: what computing them costs);
- ``resume``: loading (DCP read + resharding + weight rebuild) alone against this rank's share of the
  data-file check followed by the load, as if run serially; the trainer runs the check on a thread
  while the model compiles, so ``resume, as run`` (Trainer construction with ``resume``: compile,
  check, load) against the same construction with the check skipped is what a resumed job pays.

Preemption (``--preempt``): ``mistc train MODEL --nproc-per-node 2`` is sent SIGTERM (to the launcher)
after a few steps; from the signal to the launcher's exit (finishing the step, a synchronous save,
every process gone), with the save's own time from its line.

Usage: ``PYTHONPATH=. python benchmarks/checkpoint.py [--models gpt-small,llama-350m] [--integrity]
[--preempt] [--out FILE.md]``
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mist_compiler.launch.local_ranks import run_ranks  # noqa: E402


def _plan(model: str, seq: int) -> dict:
    return {"model": model, "seq_len": seq, "global_batch": 4, "dtype": "float32", "grad_accum": 1,
            "stages": [{"layers": [0, _layers(model)], "nodes": 1, "gpus_per_node": 2, "micro_batch": 2, "dp": 2,
                        "tp": 1, "zero": 1}]}


def _layers(model: str) -> int:
    from mist_compiler.models.zoo import zoo_config

    return zoo_config(model).layers


def _measure(rank: int, world: int, model: str, seq: int, root: str) -> dict:
    import torch.distributed as dist

    from mist_compiler.training.checkpoint import load_state
    from mist_compiler.training.trainer import TrainConfig, Trainer

    config = TrainConfig.from_dict({"steps": 1000, "save_dir": root, "timeout_s": 600})
    trainer = Trainer(model, _plan(model, seq), config, say=lambda line: None)
    checkpointer = trainer.checkpointer
    trainer.train_step()  # warm-up
    steps = []
    for _ in range(3):
        steps.append(trainer.train_step()["step_time_s"])
    step = statistics.median(steps)

    checkpointer.blocking = True
    dist.barrier()
    started = time.perf_counter()
    trainer.train_step()
    checkpointer.save(trainer.step, trainer._meta())
    blocking = time.perf_counter() - started - step

    checkpointer.blocking = False
    dist.barrier()
    trainer.train_step()
    timing = checkpointer.save(trainer.step, trainer._meta())
    during = trainer.train_step()["step_time_s"]
    checkpointer.wait()
    path = os.path.join(root, f"step-{timing.step:06d}")

    dist.barrier()
    started = time.perf_counter()
    load_state(trainer.engine, trainer.optimizer.views, path, same_world=True, group=trainer.group)
    dist.barrier()
    load = time.perf_counter() - started
    size = sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))
    params = sum(view.bucket.layout.numel for view in trainer.optimizer.views)  # one stage: the whole model
    trainer.close()
    return {"model": model, "params": params, "step": step, "blocking": blocking, "async": timing.stage_s,
            "write": timing.write_s, "during": during, "load": load, "size": size}


@contextlib.contextmanager
def _without(manifest: bool = False, record_crcs: bool = False):
    """Switch off, for a measurement, what the integrity checks cost: the manifest, torch.save's record CRCs."""
    import torch.utils.serialization

    from mist_compiler.training import checkpoint

    build, crcs = checkpoint.build_manifest, torch.utils.serialization.config.save.compute_crc32
    if manifest:
        checkpoint.build_manifest = lambda path, record_crcs: {}
    if record_crcs:
        torch.utils.serialization.config.save.compute_crc32 = False
    try:
        yield
    finally:
        checkpoint.build_manifest, torch.utils.serialization.config.save.compute_crc32 = build, crcs


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds, all threads) of ``fn``, between barriers. The CPU time
    is what a shared machine's load changes least: the overheads below are computed from it."""
    import torch.distributed as dist

    dist.barrier()
    started, cpu = time.perf_counter(), time.process_time()
    fn()
    cpu = time.process_time() - cpu
    dist.barrier()
    return time.perf_counter() - started, cpu


def _integrity(rank: int, world: int, model: str, seq: int, root: str, repeat: int) -> dict:
    from mist_compiler.training import trainer as trainer_module
    from mist_compiler.training.checkpoint import load_state
    from mist_compiler.training.integrity import verify_data_files
    from mist_compiler.training.save_dir import read_meta
    from mist_compiler.training.trainer import TrainConfig, Trainer

    config = {"steps": 1000, "save_dir": f"{root}/ck", "timeout_s": 600, "blocking_save": True}
    trainer = Trainer(model, _plan(model, seq), TrainConfig.from_dict(config), say=lambda line: None)
    trainer.train_step()
    saves: dict[str, list[tuple[float, float]]] = {"shipped": [], "no manifest": [], "no checksums": []}
    kinds = [("shipped", {}), ("no manifest", {"manifest": True}), ("no checksums", {"manifest": True, "record_crcs": True})]
    trainer.checkpointer.save(99, trainer._meta())  # warm-up
    step = 100
    for i in range(repeat):
        for kind, switches in (kinds if i % 2 == 0 else kinds[::-1]):  # alternate: a loaded machine drifts
            step += 1
            with _without(**switches):
                saves[kind].append(_timed(lambda: trainer.checkpointer.save(step, trainer._meta())))
    trainer.checkpointer.save(1000, trainer._meta())  # as shipped: the one resumed from
    path = f"{root}/ck/step-001000"
    meta = read_meta(path)
    loads, checks = [], []
    for _ in range(repeat):
        loads.append(_timed(lambda: load_state(trainer.engine, trainer.optimizer.views, path, same_world=True,
                                               group=trainer.group)))
        checks.append(_timed(lambda: verify_data_files(path, meta, rank, world)))
    trainer.close()
    resumed: dict[str, list[tuple[float, float]]] = {"checked": [], "unchecked": []}
    resume_config = TrainConfig.from_dict({**config, "save_dir": None, "blocking_save": False, "resume": path})
    original = trainer_module.BackgroundVerification
    Trainer(model, _plan(model, seq), resume_config, say=lambda line: None).close()  # warm-up (compile caches)
    for i in range(repeat):
        for kind in (("checked", "unchecked") if i % 2 == 0 else ("unchecked", "checked")):
            trainer_module.BackgroundVerification = _NoCheck if kind == "unchecked" else original
            started, cpu = time.perf_counter(), time.process_time()
            again = Trainer(model, _plan(model, seq), resume_config, say=lambda line: None)
            resumed[kind].append((time.perf_counter() - started, time.process_time() - cpu))
            trainer_module.BackgroundVerification = original
            again.close()
    def median(pairs: list[tuple[float, float]]) -> tuple[float, float]:
        return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)

    return {"model": model, "size": sum(e["bytes"] for e in meta["files"].values()),
            **{f"save {k}": median(v) for k, v in saves.items()}, "load": median(loads), "check": median(checks),
            **{f"resume {k}": median(v) for k, v in resumed.items()}}


class _NoCheck:
    """BackgroundVerification that checks nothing (the resume without integrity checks)."""

    def __init__(self, *args) -> None:
        pass

    def problems(self) -> list[str]:
        return []


def _preempt(model: str, root: str) -> dict:
    """Signal to exit of a preempted ``mistc train`` (2 ranks): when the checkpoint was written, when every
    process was gone."""
    import threading

    from mist_compiler.launch.local_ranks import free_port

    mistc = os.path.join(os.path.dirname(sys.executable), "mistc")
    command = [mistc, "train", model, "--nproc-per-node", "2", "--steps", "100000", "--save-dir", f"{root}/pre",
               "--save-every", "100000", "--master-port", str(free_port()), "--timeout", "600"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.perf_counter(), line) for line in process.stdout),
                              daemon=True)
    reader.start()
    while not any(line.startswith("mist: step 4/") for _, line in list(lines)):
        if process.poll() is not None:
            raise RuntimeError(f"mistc train ended early: {process.stderr.read()[-2000:]}")
        time.sleep(0.05)
    step_s = float(re.search(r"([0-9.]+) s/step", [line for _, line in lines if "step 4/" in line][0]).group(1))
    started = time.perf_counter()
    process.send_signal(signal.SIGTERM)
    err = process.stderr.read()  # stdout is the reader's
    process.wait(timeout=1200)
    exit_s = time.perf_counter() - started
    reader.join(5)
    saved = [(at, line) for at, line in lines if line.startswith("mist: saved")]
    save_s = float(re.search(r" in ([0-9.]+) s\)", saved[-1][1]).group(1)) if saved else float("nan")
    return {"model": model, "code": process.returncode, "step_s": step_s, "exit_s": exit_s, "save_s": save_s,
            "saved_s": saved[-1][0] - started if saved else float("nan"), "stderr": err.strip().splitlines()[-1:]}


def _integrity_table(rows: list[dict]) -> str:
    """Each cell: wall seconds / CPU seconds of rank 0 (medians); overheads from the CPU seconds."""
    lines = ["| model | checkpoint (MB) | save, no checksums | save, before the manifest | save, shipped | save "
             "overhead | load | data check, this rank's share | overhead if run before the load | resume as run, "
             "unchecked | resume as run, checked | resume overhead |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def cell(pair: tuple[float, float]) -> str:
        return f"{pair[0]:.3f} / {pair[1]:.3f}"

    for r in rows:
        save_over = r["save shipped"][1] / r["save no manifest"][1] - 1
        resume_over = r["resume checked"][1] / r["resume unchecked"][1] - 1
        lines.append(f"| {r['model']} | {r['size'] / 1e6:.1f} | {cell(r['save no checksums'])} | "
                     f"{cell(r['save no manifest'])} | {cell(r['save shipped'])} | {100 * save_over:+.1f}% | "
                     f"{cell(r['load'])} | {cell(r['check'])} | {100 * r['check'][1] / r['load'][1]:+.1f}% | "
                     f"{cell(r['resume unchecked'])} | {cell(r['resume checked'])} | {100 * resume_over:+.1f}% |")
    return "\n".join(lines)


def _preempt_table(rows: list[dict]) -> str:
    lines = ["| model | exit code | step (s) | SIGTERM to checkpoint written (s) | the save itself (s) | "
             "SIGTERM to every process gone (s) |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['code']} | {r['step_s']:.2f} | {r['saved_s']:.2f} | {r['save_s']:.2f} | "
                     f"{r['exit_s']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt-small,llama-350m")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--out", default=None, help="also write the table (markdown) here")
    parser.add_argument("--integrity", action="store_true", help="only the save/resume cost of the integrity checks")
    parser.add_argument("--preempt", action="store_true", help="only preemption-to-exit through mistc train")
    parser.add_argument("--repeat", type=int, default=3, help="measurements per median (--integrity)")
    args = parser.parse_args(argv)
    if args.integrity or args.preempt:
        return _reliability(args)
    rows = []
    for model in args.models.split(","):
        with tempfile.TemporaryDirectory(prefix="mist-ckpt-bench-") as root:
            rows.append(run_ranks(_measure, world=2, args=(model, args.seq, root), timeout_s=3000,
                                  collective_timeout_s=600)[0])
    lines = ["| model | params | ranks | step (s) | blocking save stall (s) | async save stall (s) | async write, "
             "background (s) | next step during write (s) | load (s) | size (MB) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.1f}M | 2 | {r['step']:.3f} | {r['blocking']:.3f} | "
                     f"{r['async']:.3f} | {r['write']:.3f} | {r['during']:.3f} | {r['load']:.3f} | "
                     f"{r['size'] / 1e6:.1f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as handle:
            handle.write(f"# Checkpoint cost on CPU (2 gloo ranks, dp=2 ZeRO-1, fp32, sequence {args.seq})\n\n"
                         f"Generated by `python benchmarks/checkpoint.py` on {os.cpu_count()} CPU cores.\n\n"
                         f"{table}\n")
    return 0


def _reliability(args: argparse.Namespace) -> int:
    tables = []
    for model in args.models.split(","):
        with tempfile.TemporaryDirectory(prefix="mist-ckpt-bench-") as root:
            if args.integrity:
                row = run_ranks(_integrity, world=2, args=(model, args.seq, root, args.repeat), timeout_s=6000,
                                collective_timeout_s=600)[0]
                tables.append(("integrity", row))
            if args.preempt:
                tables.append(("preempt", _preempt(model, root)))
    text = []
    for kind, render in (("integrity", _integrity_table), ("preempt", _preempt_table)):
        rows = [row for k, row in tables if k == kind]
        if rows:
            text.append(render(rows))
    table = "\n\n".join(text)
    print(table)
    if args.out:
        with open(args.out, "a") as handle:
            handle.write(f"\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
