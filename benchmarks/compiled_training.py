"""What runs is compiled: ``mistc train``'s step against the user's own ``torch.compile`` loop.

Three tables, each measured in one run (contenders alternate step by step in the same processes,
so a busy machine slows them alike; the median step of each is reported):

- **one process** (all cores): the Trainer ``mistc train`` runs (a one-stage plan, fp32, global
  batch 8, micro-batch 8, the plain head + loss the tuner picks for it, ``fused_loss: false``;
  data sampling, global-norm clipping, the LR schedule, AdamW) against the user's loop over
  ``torch.compile(model)`` with the same batches, ``torch.optim.AdamW`` (decay 0.1) and
  ``clip_grad_norm_``; for context also the eager versions of both (``--no-compile``, the user's
  plain loop). Target: mist / user compiled <= 1.05.
- **two processes, data parallel** (the cores shared): the Trainer under a DP=2 plan against the
  user's ``DistributedDataParallel(torch.compile(model))`` loop, same settings. Target <= 1.05.
- **start-up** (``--startup``): a fresh process builds the Trainer and runs its first step with an
  empty inductor cache (cold), then a second process with the cache it left (warm); the compile
  time and cache use come from the engine's ``compile_stats``. The user's ``torch.compile`` loop
  is measured the same way for comparison.

Usage: ``python benchmarks/compiled_training.py [--models llama-small,gpt-small] [--seq 256]
[--steps 8] [--startup] [--no-dp] [--threads N]``
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mist_compiler.launch.local_ranks import run_ranks  # noqa: E402

BATCH = 8
LR, WEIGHT_DECAY, CLIP, BETAS, EPS = 1e-3, 0.1, 1.0, (0.9, 0.95), 1e-8


def plan_dict(model: str, seq: int, dp: int) -> dict:
    from mist_compiler.models.zoo import zoo_config

    return {"model": model, "seq_len": seq, "global_batch": BATCH, "dtype": "float32", "grad_accum": 1,
            "fused_loss": False,
            "stages": [{"layers": [0, zoo_config(model).layers], "nodes": 1, "gpus_per_node": dp,
                        "micro_batch": BATCH // dp, "dp": dp, "tp": 1}]}


def _trainer(model: str, seq: int, dp: int, compile_units: bool):
    from mist_compiler.training.optim import OptimConfig
    from mist_compiler.training.trainer import TrainConfig, Trainer

    optim = OptimConfig(lr=LR, min_lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, clip=CLIP)
    config = TrainConfig(steps=10_000, optim=optim, compile_units=compile_units, timeout_s=1800)
    return Trainer(model, plan_dict(model, seq, dp), config, say=lambda line: None)


def _user_loop(model_name: str, seq: int, sampler, compiled: bool, ddp: bool) -> Callable[[int], None]:
    """The user's own step: forward, backward, clipping, AdamW, on the rank's rows of the same batches."""
    import torch
    import torch.distributed as dist

    from mist_compiler.models import build_model

    torch.manual_seed(0)
    model = build_model(model_name, seq_len=seq)
    runnable = torch.compile(model) if compiled else model
    if ddp:
        from torch.nn.parallel import DistributedDataParallel

        runnable = DistributedDataParallel(runnable)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    rank, world = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)
    share = BATCH // world

    def step(index: int) -> None:
        batch = {k: v[rank * share:(rank + 1) * share] for k, v in sampler.batch(index).items()}
        runnable(**batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _alternate(contenders: dict[str, Callable[[int], None]], steps: int, warmup: int) -> dict[str, float]:
    """Median seconds per step of each contender, stepping them in turn (the order reversed every other
    round), and the median over rounds of the first two contenders' ratio within a round ("ratio": a
    machine whose load drifts slows both sides of a round alike)."""
    import torch.distributed as dist

    times: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for index in range(warmup + steps):
        for name in (names if index % 2 == 0 else names[::-1]):
            if dist.is_initialized():
                dist.barrier()
            start = time.perf_counter()
            contenders[name](index)
            if index >= warmup:
                times[name].append(time.perf_counter() - start)
    result = {name: statistics.median(values) for name, values in times.items()}
    result["ratio"] = statistics.median(a / b for a, b in zip(times[names[0]], times[names[1]]))
    return result


def _measure(rank: int, world: int, model: str, seq: int, steps: int, warmup: int, threads: int,
             with_eager: bool) -> dict[str, float]:
    import torch

    torch.set_num_threads(threads)
    mist = _trainer(model, seq, world, compile_units=True)
    contenders = {"mist": lambda i: mist.train_step(),
                  "user compiled": _user_loop(model, seq, mist.sampler, True, world > 1)}
    if with_eager:
        eager = _trainer(model, seq, world, compile_units=False)
        contenders["mist eager"] = lambda i: eager.train_step()
        contenders["user eager"] = _user_loop(model, seq, mist.sampler, False, world > 1)
    result = _alternate(contenders, steps, warmup)
    result["compile"] = mist.engine.compile_stats.describe()
    return result


def steady_table(models: list[str], seq: int, steps: int, warmup: int, world: int, with_eager: bool,
                 threads: int | None = None) -> list[str]:
    threads = threads or max(1, (os.cpu_count() or 1) // world)
    title = "one process" if world == 1 else f"{world} processes, data parallel (user: DDP over torch.compile)"
    lines = [f"### {title}: {threads} thread(s) per process, global batch {BATCH}, sequence {seq}, fp32, "
             f"median of {steps} steps after {warmup}", "",
             "| model | mist s/step | user torch.compile s/step | ratio (median of paired steps) | mist eager | "
             "user eager |", "| --- | --- | --- | --- | --- | --- |"]
    for model in models:
        result = run_ranks(_measure, world=world, args=(model, seq, steps, warmup, threads, with_eager),
                           timeout_s=3600, collective_timeout_s=1800)[0]
        eager = (f"{result['mist eager']:.3f} | {result['user eager']:.3f}" if with_eager else "- | -")
        lines.append(f"| {model} | {result['mist']:.3f} | {result['user compiled']:.3f} | "
                     f"{result['ratio']:.3f} | {eager} |")
        print(f"  {model}: {result['compile']}", flush=True)
    return lines


# ------------------------------------------------------------------------------------------ start-up
def _startup_child(model: str, seq: int, who: str) -> None:
    """In a fresh process: time to the end of the first training step (printed as one line)."""
    import torch.distributed as dist

    start = time.perf_counter()
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1")
    if who == "mist":
        trainer = _trainer(model, seq, 1, compile_units=True)
        built = time.perf_counter() - start
        trainer.train_step()
        stats = trainer.engine.compile_stats
        print(f"RESULT {built:.1f} {time.perf_counter() - start:.1f} {stats.seconds:.1f} {int(stats.from_cache)}")
    else:
        from mist_compiler.training.data import SAMPLE_TEXT, TokenSampler, open_tokens

        sampler = TokenSampler(open_tokens(SAMPLE_TEXT), BATCH, seq, 0, SAMPLE_TEXT)
        from mist_compiler.models.zoo import zoo_config

        sampler.vocab = zoo_config(model).vocab
        step = _user_loop(model, seq, sampler, True, False)
        built = time.perf_counter() - start
        step(0)
        print(f"RESULT {built:.1f} {time.perf_counter() - start:.1f} - -")
    if dist.is_initialized():
        dist.destroy_process_group()


def _run_child(model: str, seq: int, who: str, cache: str) -> list[str]:
    from mist_compiler.launch.local_ranks import free_port

    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, MASTER_PORT=str(free_port()))
    command = [sys.executable, os.path.abspath(__file__), "--child", who, "--models", model, "--seq", str(seq)]
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT")), None)
    if line is None:
        raise RuntimeError(f"start-up child failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return line.split()[1:]


def startup_table(models: list[str], seq: int) -> list[str]:
    lines = ["### start-up: a fresh process to the end of its first step (cold: empty inductor cache; warm: "
             "the cache the cold run left)", "",
             "| model | who | cold s | warm s | of which compiling, cold / warm s | warm from the cache |",
             "| --- | --- | --- | --- | --- | --- |"]
    for model in models:
        for who in ("mist", "user"):
            with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
                cold = _run_child(model, seq, who, cache)
                warm = _run_child(model, seq, who, cache)
            compiling = f"{cold[2]} / {warm[2]}" if who == "mist" else "-"
            cached = ("yes" if warm[3] == "1" else "no") if who == "mist" else "-"
            label = "mist train" if who == "mist" else "user torch.compile"
            lines.append(f"| {model} | {label} | {cold[1]} | {warm[1]} | {compiling} | {cached} |")
            print(lines[-1], flush=True)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama-small,gpt-small")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-eager", action="store_true", help="leave out the eager contenders")
    parser.add_argument("--no-dp", action="store_true", help="leave out the 2-process table")
    parser.add_argument("--startup", action="store_true", help="also measure cold and warm start-up")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per process (default: cores / ranks)")
    parser.add_argument("--child", choices=("mist", "user"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    if args.child:
        _startup_child(models[0], args.seq, args.child)
        return 0
    print(f"# compiled training on {os.cpu_count()} CPU cores, {time.strftime('%Y-%m-%d')}\n", flush=True)
    tables = [steady_table(models, args.seq, args.steps, args.warmup, 1, not args.no_eager, args.threads)]
    if not args.no_dp:
        tables.append(steady_table(models, args.seq, args.steps, args.warmup, 2, not args.no_eager, args.threads))
    if args.startup:
        tables.append(startup_table(models, args.seq))
    for table in tables:
        print("\n".join(table) + "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
