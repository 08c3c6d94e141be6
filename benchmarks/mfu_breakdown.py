"""Where the predicted MFU of a large plan goes: one layer's ops by class, then whole plans.

    python benchmarks/mfu_breakdown.py                       # Llama 3 405B, TP 8, seq 8192, H100
    python benchmarks/mfu_breakdown.py --model gpt3-175b --seq 2048 --tp 8 --hardware h100-80gb

Prints three tables, all priced by the project's cost model (the prices of the program our runtime
runs: ATen ops of the captured graph, eager, one kernel per op):

1. One transformer layer, one micro-batch, forward and backward: time per op class (GEMMs,
   attention, elementwise/normalisation) and the layer's own MFU, i.e. the ceiling of any plan that
   runs this layer at this micro-batch and tensor-parallel degree, before pipeline bubbles,
   exposed collectives or recomputation. The tensor-parallel all-reduce payload is listed apart.
2. Published layouts priced: for Llama 3 405B the one Meta reports (TP 8, PP 16, DP 128, micro-batch
   1, 16 micro-batches per iteration at global batch 2048 x 8192; Dubey et al. 2024, Table 4:
   41% MFU on 16,384 H100) with the fewest checkpointed layers that fit, and the tuned plan
   (``mistc tune``) on the same cluster.
3. The split of each plan's iteration: compute, exposed communication, pipeline bubble.

The gap between 2 and the published figure is what this runtime does not do that Meta's did; the
table shows how much each part accounts for (see ``benchmarks/results/llama405b-mfu.md``).
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sympy  # noqa: E402

from mist_compiler import driver  # noqa: E402
from mist_compiler.cost.analyze import analyze  # noqa: E402
from mist_compiler.cost.hardware import load_profile  # noqa: E402
from mist_compiler.cost.op_time import matmul_time, op_class_time, peak_flops  # noqa: E402
from mist_compiler.ir.plan import Offload, Plan, StagePlan  # noqa: E402
from mist_compiler.models import resolve_model  # noqa: E402
from mist_compiler.passes.cost_annotation import B, S, T  # noqa: E402
from mist_compiler.cost.flops import model_flops_per_iteration  # noqa: E402

CLASS_GROUPS = {"matmul": "GEMM", "attention": "attention"}  # everything else: elementwise, norms, fused kernels


def layer_table(cost_model, profile, dtype: str, seq: int, tp: int, micro_batch: int) -> dict[str, float]:
    """Seconds per op group of one layer's forward + backward, and the all-reduce payload (bytes)."""
    block = cost_model.blocks["layer"]
    values = {B: micro_batch, S: seq, T: tp}
    seconds: dict[str, float] = defaultdict(float)
    for graph in (block.costs.forward, block.costs.backward):
        for node in graph.nodes:
            flops = float(sympy.sympify(node.flops).subs(values))
            nbytes = float(sympy.sympify(node.bytes).subs(values))
            if node.op_class == "matmul":
                seconds["GEMM"] += float(matmul_time(profile, dtype, flops, nbytes))
            elif flops or nbytes:
                seconds[CLASS_GROUPS.get(node.op_class, "elementwise/norm")] += float(
                    op_class_time(profile, dtype, node.op_class, flops, nbytes))
        seconds["all-reduce bytes"] += sum(float(sympy.sympify(c.bytes).subs(values)) for c in graph.collectives)
    return dict(seconds)


def layer_flops(config, seq: int, tp: int, micro_batch: int) -> float:
    """Model FLOPs of one layer, one micro-batch, forward + backward, on one tensor-parallel rank: the
    count of whole plans' MFU (``cost.flops``) less the head's 6 x vocab x hidden per token (the
    embedding lookup counts nothing)."""
    plan = Plan(model="layer", seq_len=seq, global_batch=micro_batch, dtype="bfloat16", grad_accum=1,
                stages=(StagePlan(layers=(0, config.layers), nodes=1, gpus_per_node=1, micro_batch=micro_batch,
                                  dp=1, tp=1),))
    head = config.vocab * config.hidden
    return (model_flops_per_iteration(config, plan) - 6 * seq * micro_batch * head) / config.layers / tp


def published_plan(model: str, seq: int, global_batch: int, tp: int, pp: int, dp: int, ckpt: int,
                   layers: int, compiled: bool) -> Plan:
    """Meta's layout: one layer fewer in the first and the last stage (Dubey et al. 2024, 3.3.2); one stage
    holds every layer."""
    inner = (layers + 2) // pp
    counts = [layers] if pp == 1 else [inner - 1] + [inner] * (pp - 2) + [layers - (inner - 1) - inner * (pp - 2)]
    stages, start = [], 0
    micro_batch = 1
    grad_accum = global_batch // (dp * micro_batch)
    for count in counts:
        stages.append(StagePlan(layers=(start, start + count), nodes=dp * tp // 8, gpus_per_node=8, micro_batch=micro_batch,
                                dp=dp, tp=tp, zero=1, ckpt_layers=min(ckpt, count), offload=Offload()))
        start += count
    return Plan(model=model, seq_len=seq, global_batch=global_batch, dtype="bfloat16", grad_accum=grad_accum,
                stages=tuple(stages), compiled=compiled)


def plan_row(name: str, plan: Plan, estimate, flops: float, peak: float) -> str:
    world = plan.world_size
    compute = max(stage.compute_s for stage in estimate.stages)
    comm = max(stage.exposed_comm_s for stage in estimate.stages)
    bubble = max(stage.bubble_s for stage in estimate.stages)
    ckpt = max(stage.ckpt_layers for stage in plan.stages)
    shape = (f"pp{plan.pp} tp{plan.stages[0].tp} dp{plan.stages[0].dp} mb{plan.stages[0].micro_batch} "
             f"G{plan.grad_accum} z{plan.stages[0].zero} ckpt<={ckpt}")
    fits = "fits" if all(stage.missing_mb <= 0 for stage in estimate.stages) else "DOES NOT FIT"
    return (f"{name:<28} {shape:<36} {estimate.iteration_time_s:>8.2f} {flops / (estimate.iteration_time_s * world * peak):>6.1%} "
            f"{compute:>8.2f} {comm:>7.2f} {bubble:>7.2f}  {fits}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-405b")
    parser.add_argument("--hardware", default="h100-80gb")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=16, help="pipeline stages of the published layout")
    parser.add_argument("--dp", type=int, default=128, help="data-parallel degree of the published layout")
    parser.add_argument("--global-batch", type=int, default=2048)
    parser.add_argument("--no-tune", action="store_true", help="skip the tuned plan (the slowest row)")
    parser.add_argument("--eager", action="store_true", help="price the eager program (one kernel per ATen op, "
                        "what autograd saves) instead of the compiled one (fused elementwise kernels, what "
                        "inductor's partitioner saves)")
    args = parser.parse_args(argv)
    dtype = "bfloat16"
    profile = load_profile(args.hardware)
    peak = peak_flops(profile, dtype)
    program, cost_model = driver.price(args.model, profile, seq_len=args.seq, dtype=dtype, compiled=not args.eager)
    config = resolve_model(args.model, args.seq).config  # vocabulary and head tying for the layer's FLOPs

    print(f"1. one layer of {args.model}, micro-batch 1, seq {args.seq}, TP {args.tp}, {dtype}, {args.hardware} "
          f"(forward + backward, no recomputation)")
    parts = layer_table(cost_model, profile, dtype, args.seq, args.tp, 1)
    payload = parts.pop("all-reduce bytes")
    total = sum(parts.values())
    for group, seconds in sorted(parts.items(), key=lambda item: -item[1]):
        print(f"   {group:<18} {seconds * 1e3:>8.2f} ms  {seconds / total:>6.1%}")
    flops = layer_flops(config, args.seq, args.tp, 1)
    print(f"   {'total':<18} {total * 1e3:>8.2f} ms   layer MFU {flops / (total * peak):.1%} "
          f"({flops / (parts['GEMM'] * peak):.1%} if only its GEMMs took time)")
    print(f"   tensor-parallel all-reduces: {payload / 1e6:,.0f} MB per layer and micro-batch (on the critical path)")

    iteration_flops = None
    print(f"\n2./3. plans on {args.dp * args.tp * args.pp:,} x {args.hardware}, global batch {args.global_batch} x {args.seq}")
    print(f"{'plan':<28} {'shape':<36} {'iter s':>8} {'MFU':>6} {'compute':>8} {'comm':>7} {'bubble':>7}")
    layers = config.layers
    for ckpt in range(0, (layers + 2) // args.pp + 1):
        plan = published_plan(args.model, args.seq, args.global_batch, args.tp, args.pp, args.dp, ckpt, layers,
                              cost_model.compiled)
        estimate = analyze(program, plan, profile, cost_model=cost_model)
        iteration_flops = model_flops_per_iteration(config, plan)
        if all(stage.missing_mb <= 0 for stage in estimate.stages) or ckpt == (layers + 2) // args.pp:
            print(plan_row("published layout", plan, estimate, iteration_flops, peak))
            break
    if not args.no_tune:
        nodes = args.dp * args.tp * args.pp // 8
        result = driver.tune(program, cost_model, nodes=nodes, gpus_per_node=8, global_batch=args.global_batch,
                             seq_len=args.seq)
        estimate = analyze(program, result.plan, profile, cost_model=cost_model)
        print(plan_row("tuned (mistc tune)", result.plan, estimate, iteration_flops, peak))
    print("\ncompute / comm / bubble: the busiest stage's seconds per iteration (compute includes recomputation)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
