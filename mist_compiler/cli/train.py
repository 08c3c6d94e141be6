"""Train a model for real: data, schedule, clipping, metrics, checkpoints (``mistc train``).

MODEL is a zoo name, hf:DIR (a save_pretrained directory: fine-tuned from its weights),
hf:path/to/config.json (random weights) or package.module:function. Labels follow the model's own
convention (Hugging Face causal LMs shift them inside). Without --plan, a plan saved in the
checkpoint given to --resume is used, else a plain data-parallel one over the launched processes
(fp32, ZeRO-0, global batch 8, sequence 64). Without --data, the sample text shipped with the
package is trained on (byte-level). --steps is the total number of steps, also when resuming.
Everything the launcher can check (plan, model, data, checkpoint) is checked before any process
starts; errors end in one line and a non-zero exit code.

Data: a ``.bin`` file of uint16 tokens (``.u32.bin`` or --data-dtype uint32 for uint32), memory
mapped; any other file is UTF-8 text, tokenised byte-level or with --tokenizer (Hugging Face).
Checkpoints: --save-dir D --save-every K write D/step-000010 (asynchronously, atomically) and
D/latest; --resume D (or a step directory) continues from the last complete one under any plan,
after checking its files against their manifest; --resume-exact insists on the checkpoint's own
plan (bit-for-bit continuation); --keep-last K keeps the newest K. One run owns D at a time (D/.lock);
a directory holding checkpoints is only reused by --resume D, or emptied first with --overwrite.

Long jobs: a step with a non-finite loss or gradient norm updates nothing, and --max-bad-steps of
them in a row stop the run (exit 1). SIGTERM or Ctrl-C finishes the step, saves a checkpoint and
exits 75 ("preempted, resumable": run the same command with --resume D); a second one stops at once
(exit 130). Metrics are appended to --metrics, never truncated.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
from typing import Any

from . import run as run_command
from .run import RunArgumentError

WORKER_MODULE = "mist_compiler.training.worker"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="zoo name, hf:DIR, hf:path/to/config.json or package.module:function")
    parser.add_argument("--plan", default=None, help="plan file (default: the checkpoint's, else plain data parallel)")
    parser.add_argument("--data", default=None, help="token .bin file or text file (default: the bundled sample text)")
    parser.add_argument("--data-dtype", choices=("uint16", "uint32"), default=None,
                        help="token width of a .bin file (default: uint16, uint32 for *.u32.bin)")
    parser.add_argument("--tokenizer", default=None, help="Hugging Face tokenizer for a text file (default: bytes)")
    parser.add_argument("--steps", type=int, required=True, help="total training steps (also when resuming)")
    parser.add_argument("--seed", type=int, default=0, help="data sampling seed (default 0)")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    parser.add_argument("--min-lr", type=float, default=None, help="final learning rate of the cosine (default lr/10)")
    parser.add_argument("--warmup", type=int, default=0, help="linear warm-up steps (default 0)")
    parser.add_argument("--weight-decay", type=float, default=0.1, help="AdamW decay of matrices (default 0.1)")
    parser.add_argument("--clip", type=float, default=1.0, help="max global gradient norm, 0 = off (default 1.0)")
    parser.add_argument("--log-every", type=int, default=1, help="print a line every N steps (default 1)")
    parser.add_argument("--metrics", default=None, help="append one JSON object per step to this file")
    parser.add_argument("--save-dir", default=None, help="checkpoint directory")
    parser.add_argument("--save-every", type=int, default=0, help="save every N steps (and at the end)")
    parser.add_argument("--blocking-save", action="store_true", help="save synchronously (default: in the background)")
    parser.add_argument("--keep-last", type=int, default=0, help="keep only the newest K checkpoints (default 0: all)")
    parser.add_argument("--overwrite", action="store_true",
                        help="start over in a --save-dir that holds checkpoints (deletes them first)")
    parser.add_argument("--resume", default=None, help="checkpoint directory (or step directory) to continue from")
    parser.add_argument("--resume-exact", action="store_true", help="require the checkpoint's plan (bit-exact resume)")
    parser.add_argument("--export", default=None,
                        help="write the final weights here (rank 0): DIR (Hugging Face models: a save_pretrained "
                             "directory), *.safetensors, else torch.save")
    parser.add_argument("--peak-tflops", type=float, default=None, help="peak TFLOP/s per device, for MFU")
    parser.add_argument("--max-bad-steps", type=int, default=3,
                        help="stop after N steps in a row with a non-finite loss or gradient norm (default 3)")
    run_command.add_launch_arguments(parser)


def default_plan(model: str, world: int, program: Any) -> dict:
    """A plain data-parallel plan over ``world`` processes (fp32, ZeRO-0, the plain head + loss: its
    logits are small at this batch and sequence)."""
    seq = min(64, program.max_positions or 64)
    batch = max(8 // world, 1) * world
    return {"model": model, "seq_len": seq, "global_batch": batch, "dtype": "float32", "grad_accum": 1,
            "fused_loss": False,
            "stages": [{"layers": [0, program.model_graph.num_layers], "nodes": 1, "gpus_per_node": world,
                        "micro_batch": batch // world, "dp": world, "tp": 1, "zero": 0}]}


def _config(args: argparse.Namespace) -> Any:
    from ..training.optim import OptimConfig
    from ..training.trainer import TrainConfig

    min_lr = args.lr / 10 if args.min_lr is None else args.min_lr
    optim = OptimConfig(lr=args.lr, min_lr=min_lr, warmup=args.warmup, weight_decay=args.weight_decay, clip=args.clip)
    absolute = lambda path: os.path.abspath(path) if path else None  # noqa: E731 (ranks may start elsewhere)
    return TrainConfig(steps=args.steps, data=absolute(args.data), data_dtype=args.data_dtype,
                       tokenizer=args.tokenizer, seed=args.seed, optim=optim, log_every=args.log_every,
                       metrics=absolute(args.metrics), save_dir=absolute(args.save_dir), save_every=args.save_every,
                       resume=absolute(args.resume), resume_exact=args.resume_exact, blocking_save=args.blocking_save,
                       export=absolute(args.export), peak_tflops=args.peak_tflops, timeout_s=args.timeout,
                       max_bad_steps=args.max_bad_steps, keep_last=args.keep_last, overwrite=args.overwrite,
                       compile_units=False if getattr(args, "no_compile", False) else None)


def validate(args: argparse.Namespace) -> dict:
    """Everything checkable before launching; returns the worker's spec (model, plan, config)."""
    from ..ir.plan import Plan, load_plan
    from ..training.data import SAMPLE_TEXT, TokenSampler, open_tokens, token_vocab
    from ..training.integrity import check_manifest
    from ..training.save_dir import read_meta, resolve

    run_command.validate_launch(args)
    _check_numbers(args)
    if args.resume_exact and not args.resume:
        raise RunArgumentError("--resume-exact needs --resume")
    if args.overwrite and args.resume and _inside(args.resume, args.save_dir):
        raise RunArgumentError("--overwrite would delete the checkpoint --resume reads (both in --save-dir); "
                               "drop --overwrite to continue that run")
    config = _config(args)  # checks the optimizer settings
    _check_outputs(args)  # before the seconds capturing takes
    meta = None
    if args.resume:
        resume_path = resolve(args.resume)
        meta = read_meta(resume_path)
        check_manifest(resume_path, meta)
        if meta.get("model") != args.model:
            raise RunArgumentError(f"--resume: the checkpoint was saved for model {meta.get('model')!r}, "
                                   f"not {args.model!r}")
        if meta["step"] >= args.steps:
            raise RunArgumentError(f"--resume: the checkpoint is at step {meta['step']}; --steps {args.steps} is the "
                                   f"total, so there is nothing left to train")
    world = args.nproc_per_node * args.nnodes
    if args.plan is not None:
        plan = load_plan(args.plan)
    elif meta is not None:
        plan = Plan.from_dict(meta["plan"])
    else:
        from ..frontend.capture import capture

        plan = Plan.from_dict(default_plan(args.model, world, capture(args.model, dtype="float32", analyse=False)))
    if meta is not None and args.resume_exact and plan.to_dict() != meta["plan"]:
        raise RunArgumentError(f"--resume-exact: the checkpoint was saved under another plan (on {meta['world']} "
                               f"rank(s)); this one runs on {plan.world_size}; drop --resume-exact to reshard")
    compiled = run_command.check_plan_fits(args, plan)
    _check_shapes(args.model, plan.seq_len, meta)
    from ..verify.check import vocab_size

    data = config.data or SAMPLE_TEXT
    sampler = TokenSampler(open_tokens(data, dtype=args.data_dtype, tokenizer=args.tokenizer), plan.global_batch,
                           plan.seq_len, args.seed, data)
    vocab = vocab_size(compiled.program)
    needed = token_vocab(data, args.tokenizer)
    if needed is not None and needed > vocab:
        raise RunArgumentError(f"--data: the tokenizer has {needed} tokens but {args.model} has a vocabulary of "
                               f"{vocab}")
    sampler.check_vocab(vocab)
    _check_room(args, _param_count(args.model, plan.seq_len))
    return {"model": args.model, "plan": plan.to_dict(), "train": config.to_dict()}


def _check_numbers(args: argparse.Namespace) -> None:
    """Counts within range and rates finite, each error naming its flag (before anything slow)."""
    from ..ir.plan import MAX_INT

    counts = {"steps": 1, "save_every": 0, "warmup": 0, "log_every": 1, "keep_last": 0, "max_bad_steps": 1, "seed": 0}
    for name, low in counts.items():
        value = getattr(args, name)
        if not low <= value <= MAX_INT:
            raise RunArgumentError(f"--{name.replace('_', '-')} must be in {low}..{MAX_INT}, got {value}")
    finite = lambda value: value == value and abs(value) != float("inf")  # noqa: E731
    rates = {"lr": args.lr, "clip": args.clip, "weight_decay": args.weight_decay,
             **({"min_lr": args.min_lr} if args.min_lr is not None else {})}
    for name, value in rates.items():
        if not (finite(value) and value >= 0):
            raise RunArgumentError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {value}")
    if args.min_lr is not None and args.min_lr > args.lr:
        raise RunArgumentError(f"--min-lr {args.min_lr} is above --lr {args.lr}")
    if args.peak_tflops is not None and not (finite(args.peak_tflops) and args.peak_tflops > 0):
        raise RunArgumentError(f"--peak-tflops must be a finite number > 0, got {args.peak_tflops}")
    for name in ("save_every", "keep_last", "overwrite", "blocking_save"):
        if getattr(args, name) and not args.save_dir:
            raise RunArgumentError(f"--{name.replace('_', '-')} needs --save-dir")


def _inside(path: str, directory: str) -> bool:
    path, directory = os.path.realpath(path), os.path.realpath(directory)
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def _output_dirs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(option, directory) of everything the run writes: checkpoints, the export, the metrics."""
    dirs = []
    if args.save_dir:
        dirs.append(("--save-dir", os.path.abspath(args.save_dir)))
    if args.export:
        bare = os.path.isdir(args.export) or not os.path.splitext(args.export)[1]  # a save_pretrained directory
        dirs.append(("--export", os.path.abspath(args.export if bare else os.path.dirname(os.path.abspath(args.export)))))
    if args.metrics:
        dirs.append(("--metrics", os.path.dirname(os.path.abspath(args.metrics))))
    return dirs


def _check_outputs(args: argparse.Namespace) -> None:
    """Every output directory accepts a file (created if missing), before anything slow happens."""
    from ..training.save_dir import check_writable

    if args.metrics and os.path.isdir(args.metrics):
        raise RunArgumentError(f"--metrics {args.metrics} is a directory; give a file")
    for option, directory in _output_dirs(args):
        check_writable(option, directory, 0)


def _check_room(args: argparse.Namespace, params: int) -> None:
    """Room for one checkpoint (fp32 weights and two Adam moments: 12 bytes a parameter, or the size of
    the newest one there) and for the export (4 bytes a parameter), before any rank starts."""
    from ..training.save_dir import check_writable, complete_steps, directory_bytes

    for option, directory in _output_dirs(args):
        if option == "--save-dir":
            newest = complete_steps(directory)
            needed = directory_bytes(os.path.join(directory, newest[-1][1])) if newest else 12 * params
            check_writable(option, directory, needed)
        elif option == "--export":
            check_writable(option, directory, 4 * params, what="the exported model")


def _meta_model(model: str, seq_len: int):
    import torch

    from ..models import build_model

    with torch.device("meta"):
        return build_model(model, seq_len=seq_len, seed=None)


def _param_count(model: str, seq_len: int) -> int:
    return sum(p.numel() for p in _meta_model(model, seq_len).parameters())


def _check_shapes(model: str, seq_len: int, meta: dict | None) -> None:
    """A checkpoint whose parameters differ from the model's (same name, other configuration)."""
    if meta is None or not meta.get("shapes"):
        return
    module = _meta_model(model, seq_len)
    mine = {name: list(p.shape) for name, p in module.named_parameters()}
    saved = meta["shapes"]
    wrong = sorted(name for name in saved if mine.get(name) != saved[name])
    if wrong:
        name = wrong[0]
        raise RunArgumentError(f"--resume: the checkpoint does not fit {model}: {name} is {saved[name]} there, "
                               f"{mine.get(name, 'absent')} here (a checkpoint of another model?)")


def _take_save_dir(args: argparse.Namespace):
    """Node 0 holds --save-dir's lock for the whole run, after checking that this run may write there."""
    from ..training.save_dir import RunLock, check_ownership, clear_checkpoints

    if not args.save_dir or args.node_rank != 0:
        return None
    save_dir = os.path.abspath(args.save_dir)
    lock = RunLock.acquire(save_dir, command=shlex.join(sys.argv))
    try:
        check_ownership(save_dir, os.path.abspath(args.resume) if args.resume else None, args.overwrite)
        if args.overwrite:
            clear_checkpoints(save_dir)
    except BaseException:
        lock.release()
        raise
    return lock


def _resume_hint(args: argparse.Namespace, line: str) -> str:
    """The launcher's one line for a preempted run: what the rank said, and how to continue."""
    return f"{line}; to continue, run the same command with --resume {args.save_dir}" if args.save_dir else line


def run(args: argparse.Namespace) -> int:
    spec = validate(args)
    lock = _take_save_dir(args)
    if lock is not None:
        spec["train"]["lock_token"] = lock.token
    handle, path = tempfile.mkstemp(prefix="mist-train-", suffix=".json")
    with os.fdopen(handle, "w") as out:
        json.dump(spec, out)
    try:
        def command(port: int) -> list[str]:
            extra = ["--debug"] if getattr(args, "debug", False) else []
            return run_command.torchrun_prefix(args, port, WORKER_MODULE) + [
                "--config", path, "--timeout", str(args.timeout), *extra]

        return run_command.launch(args, command, "train", graceful=True,
                                  on_preempted=lambda line: _resume_hint(args, line))
    finally:
        os.unlink(path)
        if lock is not None:
            lock.release()


def train(model: str, *, steps: int, plan: str | None = None, nproc_per_node: int = 1, **options: Any) -> int:
    """``mist_compiler.train``: what ``mistc train`` does, from Python (launches the ranks, returns
    the exit code). ``options`` are the command's flags with underscores (``save_dir=``, ``metrics=``...)."""
    parser = argparse.ArgumentParser(prog="mist_compiler.train")
    add_arguments(parser)
    defaults = vars(parser.parse_args([model, "--steps", str(steps)]))
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise TypeError(f"mist_compiler.train: unknown option(s) {unknown}")
    args = argparse.Namespace(**{**defaults, **options, "plan": plan, "nproc_per_node": nproc_per_node})
    return run(args)


__all__ = ["add_arguments", "default_plan", "run", "train", "validate"]
