"""The per-rank program ``mistc run`` launches through torchrun.

Each rank compiles the model with the plan through the driver (the same pipeline every entry
point uses), trains ``--steps`` steps on synthetic batches (seeded, the same global batch on
every rank) and rank 0 prints one line per step. With ``--check``, rank 0 then compares the run
with one-process training (:mod:`.check`). Everything meant for the user goes to stdout, one
line each (the launcher forwards stdout and keeps torchrun's stderr to itself).

On any error the rank prints ``mist: rank R: error: ...``, records it for the others (see
:mod:`mist_compiler.runtime.failure`) and exits at once, so a failed rank never leaves the job
hanging; Ctrl-C ends a rank quietly (the launcher says it once); a rank whose launcher dies
follows it (Linux parent-death signal, and a watchdog on the parent process as a fallback).
Right after the rendezvous every rank compares its options with rank 0's: nodes launched with
different options (``--check`` on one node only, another plan) are refused, naming the option.
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
    try:
        print(f"{PREFIX} {message}", flush=True)
    except (BrokenPipeError, OSError):  # the launcher is gone: nobody to tell
        pass


class OptionMismatch(ValueError):
    """The ranks of one job were launched with different options."""


def _flatten(options: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in options.items():
        if isinstance(value, dict) and key != "plan":
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def option_flag(key: str) -> str:
    """The command-line spelling of an option key (``optim.min_lr`` -> ``--min-lr``)."""
    name = key.rsplit(".", 1)[-1]
    if name == "model":
        return "MODEL"
    return "--" + {"timeout_s": "timeout"}.get(name, name).replace("_", "-")


def check_same_options(options: dict, rank: int, ignore: tuple[str, ...] = ("debug", "lock_token")) -> None:
    """Every rank was launched with the options rank 0 was (collective, once, right after the rendezvous)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = {k: v for k, v in _flatten(options).items() if k not in ignore}
    node = os.environ.get("GROUP_RANK", "?")
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (node, mine))
    node0, first = gathered[0]
    for other, (other_node, theirs) in enumerate(gathered[1:], 1):
        for key in sorted(set(first) | set(theirs)):
            if first.get(key) != theirs.get(key):
                if key == "plan":
                    detail = f"differs: rank {other} (node {other_node}) got another plan than rank 0 (node {node0})"
                else:
                    detail = (f"{first.get(key)!r} on rank 0 (node {node0}) but {theirs.get(key)!r} on rank {other} "
                              f"(node {other_node})")
                raise OptionMismatch(f"the nodes of this job were launched with different options: {option_flag(key)} "
                                     f"{'' if key == 'plan' else 'is '}{detail}; launch every node with the same command")


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
                                    timeout_s=args.timeout, compile_units=False if args.no_compile else None)
    engine, vocab = compiled.engine, vocab_size(compiled.program)
    if rank == 0:
        say(f"compiled {args.model} for {plan.world_size} rank(s) in {time.perf_counter() - started:.1f} s")
    batches = []  # kept for --check only: a long run draws each batch when it needs it
    losses, gradients = [], None
    for step in range(args.steps):
        batch = synthetic_batch(vocab, plan.global_batch, plan.seq_len, step)
        if args.check:
            batches.append(batch)
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
    with open(args.plan, "rb") as handle:  # compared by content: each node may keep it at its own path
        plan = handle.read().decode(errors="replace")
    options = {"model": args.model, "plan": plan, "steps": args.steps, "check": args.check, "lr": args.lr,
               "timeout_s": args.timeout}
    return run_rank(lambda rank: train(args, rank), timeout=args.timeout, debug=args.debug, options=options)


def run_rank(body: Callable[[int], int], *, timeout: float, debug: bool, options: dict | None = None) -> int:
    """The life of one launched rank (shared by every launched program): follow the launcher, join
    the process group, check that every rank got the same ``options``, run ``body(rank)``, leave
    cleanly; on any error say it in one line, tell the other ranks and exit at once, never hanging them."""
    rank = int(os.environ.get("RANK", 0))
    follow_parent()
    signal.signal(signal.SIGINT, lambda *_: os._exit(130))  # the launcher reports an interrupt once
    try:
        import torch.distributed as dist

        from ..runtime.device import init_process_group, select_device

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
        init_process_group(timeout, select_device())  # NCCL bound to this rank's GPU, gloo on CPU
        if options is not None:
            check_same_options(options, rank)
        status = body(rank)
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        # Leave now: interpreter teardown (inductor's compile workers, thread pools) takes seconds that a
        # preempted job does not have, and everything of ours is written (files closed, checkpoints synced).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    except Exception as error:  # report, then leave at once: never hang the others
        from ..runtime.failure import blame, report_failure

        world = int(os.environ.get("WORLD_SIZE", 1))
        reason = blame(error, rank, world, timeout)
        say(f"rank {rank}: error: {reason}")
        if not reason.startswith("stops because"):
            report_failure(reason, rank)
        if debug:
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
