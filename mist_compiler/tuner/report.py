"""Human- and machine-readable views of a tuning result: tables, MFU, JSON, the frontier side file."""
from __future__ import annotations

import json
import os

from ..ir.files import write_atomic
from ..ir.vocabulary import OFFLOAD_KINDS
from .api import TuneResult
from ..cost.flops import mfu


def describe_stage(index: int, stage, grad_accum: int) -> str:
    offload = ", ".join(f"{k} {getattr(stage.offload, k):.0%}" for k in OFFLOAD_KINDS
                        if getattr(stage.offload, k) > 0)
    where = (f"{stage.nodes} node(s) x {stage.gpus_per_node} GPUs" if stage.nodes > 1
             else f"{stage.gpus_per_node} GPU(s) of one node")
    return (f"stage {index}: layers {stage.layers[0]}..{stage.layers[1] - 1} ({stage.num_layers}) on {where}, "
            f"DP {stage.dp} x TP {stage.tp}, micro-batch {stage.micro_batch} x {grad_accum} steps, ZeRO-{stage.zero}, "
            f"{stage.ckpt_layers} checkpointed layer(s), offload {offload or 'none'}")


def format_result(result: TuneResult, config=None, peak_flops: float | None = None) -> str:
    plan = result.plan
    utilisation = mfu(result, config, peak_flops)
    stats = result.stats
    lines = [
        f"{plan.model}: {plan.pp} stage(s), grad_accum {plan.grad_accum}, global batch {plan.global_batch}, "
        f"seq {plan.seq_len}, {plan.world_size} devices",
        f"predicted iteration {result.predicted_time_s:.4f} s, {result.tokens_per_s:,.0f} tokens/s"
        + (f", MFU {utilisation:.1%}" if utilisation is not None else ""),
        f"  schedule {plan.schedule}" + (f" with {plan.virtual_stages} virtual stages per device group"
                                         if plan.virtual_stages > 1 else "")
        + f" (simulated): busiest stage computes {result.breakdown['compute_s']:.4f} s, idles "
        f"{result.breakdown['bubble_s']:.4f} s, per-iteration work {result.breakdown['delta_s']:.4f} s",
        "",
        f"{'stage':>5} {'layers':>9} {'devices':>8} {'dp':>3} {'tp':>3} {'mb':>4} {'zero':>4} {'ckpt':>4} "
        f"{'offload w/g/o/a':>17} {'stable s':>9} {'delta s':>9} {'peak GB':>8} {'limit GB':>8}",
    ]
    for stage, report in zip(plan.stages, result.stages):
        o = stage.offload
        lines.append(
            f"{report.index:>5} {f'[{stage.layers[0]}, {stage.layers[1]})':>9} "
            f"{f'{stage.nodes}x{stage.gpus_per_node}':>8} {stage.dp:>3} {stage.tp:>3} {stage.micro_batch:>4} "
            f"{stage.zero:>4} {stage.ckpt_layers:>4} {f'{o.weights:.2f}/{o.grads:.2f}/{o.opt:.2f}/{o.acts:.2f}':>17} "
            f"{report.stable_s:>9.4f} {report.delta_s:>9.4f} {report.peak_memory_bytes / 1e9:>8.2f} "
            f"{result.device_memory_bytes / 1e9:>8.2f}")
    lines += [
        "",
        f"search: {stats.get('search_s', 0):.1f} s, {stats.get('grad_accum_tried', 0)} G values, "
        f"{stats.get('evaluated', 0):,} stage configs evaluated, {stats.get('frontier_points', 0):,} Pareto points, "
        f"{stats.get('grad_accum_skipped', 0)} skipped by bound, {stats.get('dp_passes', 0)} partition DP passes, "
        f"1F1B partition {stats.get('final_status')} (lower bound {stats.get('bound_s', 0):.4f} s by 1F1B's closed form, "
        f"gap {stats.get('gap', 0):.2%}), {stats.get('schedule_plans_priced', 0)} other-schedule plans simulated",
        f"space: {stats.get('space')}",
    ]
    if stats.get("warning"):
        lines.append(f"WARNING: {stats['warning']}")
    return "\n".join(lines)


def result_to_dict(result: TuneResult, config=None, peak_flops: float | None = None) -> dict:
    stats = {k: v for k, v in result.stats.items() if not k.startswith("_") and k != "partition_log"}
    return {
        "plan": result.plan.to_dict(),
        "predicted_time_s": result.predicted_time_s,
        "tokens_per_s": result.tokens_per_s,
        "mfu": mfu(result, config, peak_flops),
        "breakdown": result.breakdown,
        "device_memory_bytes": result.device_memory_bytes,
        "stages": [{"index": r.index, "stable_s": r.stable_s, "delta_s": r.delta_s, "inflight": r.inflight,
                    "peak_memory_bytes": r.peak_memory_bytes, "breakdown": r.breakdown} for r in result.stages],
        "stats": stats,
    }


def frontier_path(plan_path: str) -> str:
    root, _ = os.path.splitext(plan_path)
    return root + ".frontiers.json"


def save_frontiers(result: TuneResult, plan_path: str) -> str:
    path = frontier_path(plan_path)
    write_atomic(path, json.dumps({
        "predicted_time_s": result.predicted_time_s, "device_memory_bytes": result.device_memory_bytes,
        "grad_accum": result.plan.grad_accum,
        "stage_estimates": [{"stable_s": r.stable_s, "delta_s": r.delta_s, "peak_memory_bytes": r.peak_memory_bytes,
                             "inflight": r.inflight, "breakdown": r.breakdown} for r in result.stages],
        "frontiers": result.frontiers.get("stages", [])}, indent=1))
    return path
