"""mistc analyze MODEL --plan PLAN --hardware HW: predicted iteration time and per-stage memory.

Prints a table per stage (compute, exposed communication and copies, bubble, peak memory) or,
with --json, a JSON object with at least ``iteration_time_s`` and ``stages[].peak_memory_mb``.
Exits 1 when a stage does not fit in device memory (the table says by how much), 2 on bad input.
"""
from __future__ import annotations

import argparse
import dataclasses
import json

from ..cost.analyze import PlanEstimate
from ..ir.vocabulary import ATTENTION_KERNELS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="zoo name, hf:path/config.json or package.module:function")
    parser.add_argument("--plan", required=True, help="plan file (JSON or YAML)")
    parser.add_argument("--hardware", required=True, help="hardware profile name (l4, a100-40gb, ...) or YAML path")
    parser.add_argument("--attention", choices=ATTENTION_KERNELS, default="flash", help="target attention kernel")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="price units compiled by inductor, or with --no-compile op by op (default: what the "
                             "plan's 'compiled' says)")
    parser.add_argument("--memory-limit", help="memory a plan may use per device, e.g. 70GB or 64GiB (default: the "
                        "profile's device memory minus its headroom for context, NCCL, workspaces, fragmentation)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def format_table(estimate: PlanEstimate) -> str:
    lines = [
        f"model {estimate.model} on {estimate.hardware} (attention: {estimate.attention}, "
        f"{'compiled' if estimate.compiled else 'eager'} units, grad_accum {estimate.grad_accum}, "
        f"schedule {estimate.schedule}" + (f", {estimate.virtual_stages} virtual stages per device group" if
                                         estimate.virtual_stages > 1 else "") + ")",
        f"iteration time {estimate.iteration_time_s:.4f} s (simulated schedule), {estimate.tokens_per_s:,.0f} tokens/s",
        "",
        f"{'stage':>5} {'layers':>9} {'compute s':>10} {'comm s':>9} {'copy s':>9} {'bubble s':>9} "
        f"{'peak MB':>11} {'limit MB':>10}  status",
    ]
    for stage in estimate.stages:
        status = "ok" if stage.fits else f"DOES NOT FIT: {stage.missing_mb:,.1f} MB missing"
        lines.append(
            f"{stage.index:>5} {f'[{stage.layers[0]}, {stage.layers[1]})':>9} {stage.compute_s:>10.4f} "
            f"{stage.exposed_comm_s:>9.4f} {stage.exposed_copy_s:>9.4f} {stage.bubble_s:>9.4f} "
            f"{stage.peak_memory_mb:>11,.1f} {stage.memory_limit_mb:>10,.0f}  {status}")
    lines.append("")
    lines.append("memory per stage (MB): " + "; ".join(
        f"stage {s.index}: " + ", ".join(f"{k} {v:,.1f}" for k, v in s.memory_mb.items()) for s in estimate.stages))
    if not estimate.fits:
        lines.append("the plan does not fit in device memory")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from .. import driver
    from ..cost.hardware import load_profile, with_memory_limit
    from ..ir.plan import load_plan

    plan = load_plan(args.plan)
    if getattr(args, "compile", None) is not None:
        plan = dataclasses.replace(plan, compiled=args.compile)
    hardware = load_profile(args.hardware)  # a bad profile fails before the capture
    if getattr(args, "memory_limit", None) is not None:
        hardware = with_memory_limit(hardware, args.memory_limit)
    estimate = driver.analyze_plan(args.model, plan, hardware, attention=args.attention)
    if args.json:
        print(json.dumps(estimate.to_dict(), indent=2))
    else:
        print(format_table(estimate))
    return 0 if estimate.fits else 1
