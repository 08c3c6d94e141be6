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

Usage: ``PYTHONPATH=. python benchmarks/checkpoint.py [--models gpt-small,llama-350m] [--out FILE.md]``
"""
from __future__ import annotations

import argparse
import os
import statistics
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt-small,llama-350m")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--out", default=None, help="also write the table (markdown) here")
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
