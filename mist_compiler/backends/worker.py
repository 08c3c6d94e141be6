"""The per-rank program ``mistc run`` launches through torchrun, and its single-process reference.

Each rank builds the model (same seed everywhere), compiles it with the plan, trains ``--steps``
steps on synthetic batches (seeded, the same global batch on every rank) and prints the losses.
With ``--check`` rank 0 then trains the same model in one process (``torch.optim.AdamW`` on the
whole global batch) and compares losses and final weights, printing the largest relative
difference; the exit code is non-zero past the tolerance.

On any error the rank prints it, records it for the others (see ``engine.FailureMonitor``) and
exits non-zero at once, so a failed rank never leaves the job hanging.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback
from typing import Any

import torch
from torch import nn

from mist_compiler.ir.plan import Plan, load_plan

DEFAULT_TOLERANCE = 1e-5


def synthetic_batch(vocab: int, global_batch: int, seq_len: int, step: int, seed: int = 1234) -> dict[str, torch.Tensor]:
    """A deterministic batch of random token ids (labels are a fresh random draw)."""
    generator = torch.Generator().manual_seed(seed + step)
    input_ids = torch.randint(0, vocab, (global_batch, seq_len), generator=generator)
    labels = torch.randint(0, vocab, (global_batch, seq_len), generator=generator)
    return {"input_ids": input_ids, "labels": labels}


def model_vocab(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    for attr in ("vocab", "vocab_size"):
        if config is not None and isinstance(getattr(config, attr, None), int):
            return getattr(config, attr)
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        raise ValueError(f"cannot find the vocabulary size of {type(model).__name__}")
    return max(e.num_embeddings for e in embeddings)


def adamw_kwargs(optimizer: Any) -> dict[str, Any]:
    """torch.optim.AdamW arguments matching the engine's optimizer config."""
    if optimizer is None:
        from .stage_runtime import AdamWConfig

        optimizer = AdamWConfig()
    if isinstance(optimizer, dict):
        return dict(optimizer)
    kwargs = {}
    for name in ("lr", "betas", "eps", "weight_decay"):
        if hasattr(optimizer, name):
            value = getattr(optimizer, name)
            kwargs[name] = tuple(value) if name == "betas" else value
    return kwargs


def _loss_of(output: Any) -> torch.Tensor:
    return output.loss if hasattr(output, "loss") else output


def reference_training(model: nn.Module, plan: Plan, steps: int, optimizer: Any = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training on the whole global batch: the ground truth for a plan."""
    vocab = model_vocab(model)
    opt = torch.optim.AdamW(model.parameters(), **adamw_kwargs(optimizer))
    losses = []
    for step in range(steps):
        batch = synthetic_batch(vocab, plan.global_batch, plan.seq_len, step)
        loss = _loss_of(model(**batch))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    state = {name: p.detach().float().cpu() for name, p in model.named_parameters(remove_duplicate=False)}
    return losses, state


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` (Frobenius norms, float64): the relative error of a whole tensor.

    Element-wise ratios are meaningless under Adam: an entry whose gradient is a cancellation
    near zero has its update direction set by rounding, in any two summation orders.
    """
    a64, b64 = a.detach().double(), b.detach().double()
    return float((a64 - b64).norm()) / max(float(b64.norm()), 1e-30)


def compare(losses: list[float], state: dict[str, torch.Tensor], ref_losses: list[float],
            ref_state: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Largest relative difference over losses and weights, and where it is."""
    worst, where = 0.0, "-"
    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        diff = abs(got - want) / max(abs(want), 1e-12)
        if diff > worst:
            worst, where = diff, f"loss of step {step}"
    missing = sorted(set(ref_state) - set(state))
    if missing:
        return float("inf"), f"parameters missing from the run: {missing[:5]}"
    for name, want in ref_state.items():
        got = state[name]
        if got.shape != want.shape:
            return float("inf"), f"{name}: shape {tuple(got.shape)} != reference {tuple(want.shape)}"
        diff = relative_difference(got, want)
        if diff > worst:
            worst, where = diff, name
    return worst, where


def train(model_name: str, plan: Plan, steps: int, timeout_s: float, optimizer: Any = None) -> tuple[Any, list[float]]:
    """Build, compile and train on this rank; returns the engine and the losses."""
    from mist_compiler.models import build_model

    from .engine import compile as compile_plan

    model = build_model(model_name, seq_len=plan.seq_len)
    engine = compile_plan(model, plan, optimizer=optimizer, timeout_s=timeout_s)
    vocab = model_vocab(model)
    losses = [engine.step(synthetic_batch(vocab, plan.global_batch, plan.seq_len, step)) for step in range(steps)]
    return engine, losses


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="mist_compiler.backends.worker")
    parser.add_argument("model")
    parser.add_argument("--plan", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    rank = int(os.environ.get("RANK", 0))
    try:
        import torch.distributed as dist

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
        plan = load_plan(args.plan)
        if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", 1)) > 1:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
        engine, losses = train(args.model, plan, args.steps, args.timeout)
        if rank == 0:
            print(json.dumps({"losses": losses}), flush=True)
        state = engine.gather_full_state(dst=0)
        status = 0
        if args.check and rank == 0:
            from mist_compiler.models import build_model

            ref_losses, ref_state = reference_training(build_model(args.model, seq_len=plan.seq_len), plan, args.steps)
            worst, where = compare(losses, state, ref_losses, ref_state)
            verdict = "OK" if worst <= args.tolerance else "FAIL"
            print(f"check: largest relative difference {worst:.3e} ({where}); tolerance {args.tolerance:.0e}: {verdict}", flush=True)
            status = 0 if verdict == "OK" else 1
        engine.close()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        return status
    except Exception as error:  # report, then leave at once: never hang the others
        print(f"mist worker rank {rank}: error: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        if os.environ.get("MIST_DEBUG"):
            traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
