"""The per-rank program ``mistc run`` launches through torchrun.

Each rank compiles the model with the plan through the driver (the same pipeline every entry
point uses), trains ``--steps`` steps on synthetic batches (seeded, the same global batch on
every rank) and rank 0 prints one line per step. With ``--check``, rank 0 then compares the run
with one-process training (:mod:`.check`). Everything meant for the user goes to stdout, one
line each (the launcher forwards stdout and keeps torchrun's stderr to itself).

On any error the rank prints ``mist: rank R: error: ...``, records it for the others (see
:mod:`.failure`) and exits at once, so a failed rank never leaves the job
hanging; Ctrl-C ends a rank quietly (the launcher says it once); a rank whose launcher dies
follows it (Linux parent-death signal, and a watchdog on the parent process as a fallback).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import threading
import time
import traceback
from typing import Callable

import torch

from mist_compiler.ir.plan import load_plan

PREFIX = "mist:"


def follow_parent() -> None:
    """Exit when the launching process dies (it cannot clean up after a SIGKILL)."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(143)

    threading.Thread(target=watch, name="mist-parent-watch", daemon=True).start()


def say(message: str) -> None:
    print(f"{PREFIX} {message}", flush=True)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="mist_compiler.launch.worker")
    parser.add_argument("model")
    parser.add_argument("--plan", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--debug", action="store_true")
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--no-compile", action="store_true")
    return parser.parse_args(argv)


def train(args: argparse.Namespace, rank: int) -> int:
    from mist_compiler import driver

    from ..runtime.optimizer import AdamWConfig
    from ..verify.check import synthetic_batch, vocab_size

    plan = load_plan(args.plan)
    optimizer = AdamWConfig() if args.lr is None else AdamWConfig(lr=args.lr)
    started = time.perf_counter()
    compiled = driver.compile_model(args.model, plan=plan, model_name=args.model, prove=False, optimizer=optimizer,
                                    timeout_s=args.timeout, compile_units=not args.no_compile)
    engine, vocab = compiled.engine, vocab_size(compiled.program)
    if rank == 0:
        say(f"compiled {args.model} for {plan.world_size} rank(s) in {time.perf_counter() - started:.1f} s")
    batches = [synthetic_batch(vocab, plan.global_batch, plan.seq_len, step) for step in range(args.steps)]
    losses, gradients = [], None
    for step, batch in enumerate(batches):
        clock = time.perf_counter()
        losses.append(engine.forward_backward(batch))
        if step == 0 and args.check:
            gradients = engine.gather_full_gradients(dst=0)
        engine.optimizer_step()
        if rank == 0:
            tokens = plan.global_batch * plan.seq_len
            elapsed = time.perf_counter() - clock
            say(f"step {step + 1}/{args.steps}: loss {losses[-1]:.6f}, {elapsed:.3f} s, {tokens / elapsed:,.0f} tokens/s")
            if step == 0:  # units compile at their first call
                say(f"compilation: {engine.compile_stats.describe()}")
    weights = engine.gather_full_state(dst=0)
    status = 0
    if args.check and rank == 0:
        status = check(args, plan, batches, losses, gradients, weights, optimizer)
    engine.close()
    return status


def check(args, plan, batches, losses, gradients, weights, optimizer) -> int:
    from ..verify.check import Run, check_run

    verdict = check_run(args.model, plan, batches, Run(losses, gradients, weights), optimizer)
    say(verdict.line())
    return 0 if verdict.ok else 1


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    return run_rank(lambda rank: train(args, rank), timeout=args.timeout, debug=args.debug)


def run_rank(body: Callable[[int], int], *, timeout: float, debug: bool) -> int:
    """The life of one launched rank (shared by every launched program): follow the launcher, join
    the process group, run ``body(rank)``, leave cleanly; on any error say it in one line and exit
    at once, never hanging the others."""
    rank = int(os.environ.get("RANK", 0))
    follow_parent()
    signal.signal(signal.SIGINT, lambda *_: os._exit(130))  # the launcher reports an interrupt once
    try:
        import torch.distributed as dist

        from ..runtime.device import init_process_group, select_device

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
        init_process_group(timeout, select_device())  # NCCL bound to this rank's GPU, gloo on CPU
        status = body(rank)
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        return status
    except Exception as error:  # report, then leave at once: never hang the others
        say(f"rank {rank}: error: {type(error).__name__}: {error}")
        if debug:
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
