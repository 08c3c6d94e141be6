"""mistc tune MODEL --hardware HW --nodes N --gpus-per-node M --global-batch B: search the fastest plan.

Prints the plan as a table with its predicted iteration time, MFU and memory per stage (or JSON
with --json); -o writes the plan (JSON or YAML, the schema ``mistc analyze`` and ``mistc run``
read) and, next to it, ``<plan>.frontiers.json`` with the Pareto frontiers the stages were chosen
from (``mistc explain`` plots them). Progress goes to stderr. Exit 2 with one sentence when no
plan exists (the sentence names the limit and the smallest change that would fit).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from ..ir.plan import save_plan
from ..ir.vocabulary import ATTENTION_KERNELS, COMPILED_DEFAULT, TRAINING_DTYPES
from ..tuner.api import _stderr_progress
from ..tuner.baselines import BASELINE_SPACES
from ..tuner.space import OFFLOAD_FAMILIES, SearchSpace


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="zoo name, hf:path/config.json or package.module:function")
    parser.add_argument("--hardware", required=True, help="hardware profile name (l4, a100-40gb, ...) or YAML path")
    parser.add_argument("--nodes", type=int, required=True, help="number of nodes")
    parser.add_argument("--gpus-per-node", type=int, required=True, help="GPUs per node")
    parser.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    parser.add_argument("--seq", type=int, default=None,
                        help="sequence length (default: the model's maximum positions, else 2048)")
    parser.add_argument("--dtype", choices=TRAINING_DTYPES, default="bfloat16",
                        help="compute dtype (default bfloat16; float16 trains with dynamic loss scaling)")
    parser.add_argument("--grad-dtype", choices=TRAINING_DTYPES, default="float32",
                        help="gradients ZeRO 0/1 keep between micro-batches: float32 (default) or --dtype (as Mist)")
    parser.add_argument("--attention", choices=ATTENTION_KERNELS, default="flash", help="target attention kernel")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=COMPILED_DEFAULT,
                        help="plan units compiled by inductor (fused elementwise kernels, what its partitioner saves) "
                             f"or, with --no-compile, run op by op (default: {'--compile' if COMPILED_DEFAULT else '--no-compile'})")
    parser.add_argument("--memory-limit", help="memory a plan may use per device, e.g. 70GB or 64GiB (default: the "
                        "profile's device memory minus its headroom for context, NCCL, workspaces, fragmentation)")
    parser.add_argument("-o", "--output", help="write the plan here (.json or .yaml)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--space", choices=("full",) + tuple(BASELINE_SPACES), default="full",
                        help="search space: full (default) or a baseline's restriction")
    parser.add_argument("--offload-grid", help="comma-separated offload ratios, e.g. 0,0.25,0.5,0.75,1")
    parser.add_argument("--no-offload", action="append", choices=OFFLOAD_FAMILIES + ("all",), default=[],
                        help="turn an offload family off (repeatable; acts: whole-layer and per-tensor activation offload alike)")
    parser.add_argument("--max-stages", type=int, help="at most this many pipeline stages")
    parser.add_argument("--gap", type=float, help="relative optimality gap to certify (default 1e-4; 0: exact)")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def space_from_args(args: argparse.Namespace) -> SearchSpace:
    space = SearchSpace() if args.space == "full" else BASELINE_SPACES[args.space]()[0]
    changes = {}
    if args.offload_grid:
        try:
            changes["offload_grid"] = tuple(float(v) for v in args.offload_grid.split(","))
        except ValueError:
            raise ValueError(f"--offload-grid: expected comma-separated numbers, got {args.offload_grid!r}") from None
    for family in args.no_offload:
        for name in (OFFLOAD_FAMILIES if family == "all" else (family,)):
            changes[f"offload_{name}"] = False
    if args.max_stages is not None:
        if args.max_stages < 1:
            raise ValueError(f"--max-stages must be >= 1, got {args.max_stages}")
        changes["max_stages"] = args.max_stages
    if args.gap is not None:
        if not 0 <= args.gap < 1:
            raise ValueError(f"--gap must be in [0, 1), got {args.gap}")
        changes["gap"] = args.gap
    return space.restrict(**changes) if changes else space


def hardware_from_args(args: argparse.Namespace):
    """The hardware profile, with ``--memory-limit`` applied when given."""
    from ..cost.hardware import load_profile, with_memory_limit

    limit = getattr(args, "memory_limit", None)
    return with_memory_limit(load_profile(args.hardware), limit) if limit is not None else args.hardware


def run(args: argparse.Namespace) -> int:
    from .. import driver
    from ..ir.files import check_output
    from ..tuner.report import format_result, result_to_dict, save_frontiers

    from ..cost.stage_model import MAX_GROUP, MAX_MICRO_BATCH
    from ..ir.plan import MAX_INT

    limits = {"nodes": MAX_GROUP - 1, "gpus_per_node": MAX_GROUP - 1, "global_batch": MAX_MICRO_BATCH - 1, "seq": MAX_INT}
    for name, most in limits.items():
        value = getattr(args, name)
        if value is not None and not 1 <= value <= most:
            raise ValueError(f"--{name.replace('_', '-')} must be in 1..{most}, got {value}")
    if args.grad_dtype not in ("float32", args.dtype):
        raise ValueError(f"--grad-dtype must be float32 or --dtype ({args.dtype}), got {args.grad_dtype}")
    if args.output:
        check_output(args.output)  # before the search, not after it
    space = space_from_args(args)
    progress = None if args.quiet else _stderr_progress
    program = driver.capture(args.model, dtype=args.dtype, attention=args.attention, seq_len=args.seq)
    driver.check_sequence(program, args.seq or program.seq_len)  # named as the option typed (--seq)
    compiled = driver.compile_model(args.model, program=program, hardware=hardware_from_args(args), nodes=args.nodes,
                                    gpus_per_node=args.gpus_per_node, global_batch=args.global_batch, seq_len=args.seq,
                                    dtype=args.dtype, attention=args.attention, space=space, grad_dtype=args.grad_dtype,
                                    baseline=None if args.space == "full" else args.space, until="plan", prove=False,
                                    progress=progress, compiled=args.compile)
    result = compiled.tuning
    result.plan = dataclasses.replace(result.plan, model=args.model)
    if args.output:
        save_plan(result.plan, args.output)
        side = save_frontiers(result, args.output)
        print(f"wrote {args.output} and {side}", file=sys.stderr)
    if args.json:
        print(json.dumps(result_to_dict(result, result.model_config, result.peak_flops), indent=2))
    else:
        print(format_result(result, result.model_config, result.peak_flops))
    return 0
