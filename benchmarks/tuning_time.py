"""Tuning wall time as the search space grows and as the cluster grows.

    python benchmarks/tuning_time.py ladder     # GPT-22B on 4 x 8 L4, global batch 512
    python benchmarks/tuning_time.py cluster    # 8 -> 1,024 GPUs, GPT-7B -> a GPT-175B-shaped model
    python benchmarks/tuning_time.py all [--json out.json]

The ladder adds one family at a time: base (ZeRO 0/1, checkpoint all-or-none, no offload),
+ZeRO-2/3, +checkpoint tuning (any count), +optimizer offload, +activation offload, +gradient
offload, +weight offload (the last rung is the full space). Times are the tuner's own (the model
capture and analysis, done once per model, is reported separately). Wall and CPU seconds are both
printed: on a shared machine the wall clock includes waiting for the CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mist_compiler.cost.stage_model import build_stage_cost_model  # noqa: E402
from mist_compiler.models import TransformerConfig, TransformerLM  # noqa: E402
from mist_compiler.tuner.api import tune  # noqa: E402
from mist_compiler.tuner.space import SearchSpace, Workload  # noqa: E402

GPT_175B = TransformerConfig(hidden=12288, ffn=49152, layers=96, heads=96, family="gpt", norm="layernorm",
                             activation="gelu", positions="absolute")


def gpt_175b() -> TransformerLM:
    """A GPT-175B-shaped model (GPT-3 dimensions, the zoo's GPT flavour); used by name
    ``benchmarks.tuning_time:gpt_175b``."""
    return TransformerLM(GPT_175B)


NO_OFFLOAD = dict(offload_weights=False, offload_grads=False, offload_opt=False, offload_acts=False)
LADDER = [
    ("base", SearchSpace(zero_levels=(0, 1), ckpt="all_or_none", **NO_OFFLOAD)),
    ("+ZeRO-2/3", SearchSpace(ckpt="all_or_none", **NO_OFFLOAD)),
    ("+checkpoint tuning", SearchSpace(**NO_OFFLOAD)),
    ("+optimizer offload", SearchSpace(offload_weights=False, offload_grads=False, offload_acts=False)),
    ("+activation offload", SearchSpace(offload_weights=False, offload_grads=False)),
    ("+gradient offload", SearchSpace(offload_weights=False)),
    ("+weight offload (full)", SearchSpace()),
]
# (model, nodes, gpus per node, global batch)
CLUSTERS = [
    ("gpt2-7b", 1, 8, 128),
    ("gpt2-13b", 2, 8, 256),
    ("gpt2-22b", 4, 8, 512),
    ("gpt2-40b", 8, 8, 512),
    ("benchmarks.tuning_time:gpt_175b", 32, 8, 1024),
    ("benchmarks.tuning_time:gpt_175b", 128, 8, 2048),
]


def timed_tune(model: str, cost_model, nodes: int, gpus: int, batch: int, seq: int, space: SearchSpace,
               workload: Workload | None = None) -> dict:
    wall, cpu = time.perf_counter(), time.process_time()
    result = tune(model, "l4", nodes, gpus, batch, seq_len=seq, space=space, cost_model=cost_model, workload=workload)
    return {
        "wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
        "iteration_s": result.predicted_time_s, "stages": result.plan.pp, "grad_accum": result.plan.grad_accum,
        "evaluated": result.stats["evaluated"], "milps": result.stats["milps"], "status": result.stats["final_status"],
    }


def build(model: str, seq: int):
    wall = time.perf_counter()
    cost_model = build_stage_cost_model(model, "l4", seq_len=seq)
    return cost_model, time.perf_counter() - wall


def ladder(seq: int = 2048) -> list[dict]:
    cost_model, analysis = build("gpt2-22b", seq)
    print(f"GPT-22B on 4 x 8 L4, global batch 512 (model analysis {analysis:.1f} s, once)")
    print(f"{'space':<24} {'wall s':>8} {'cpu s':>8} {'iteration s':>12} {'S':>3} {'G':>4} {'configs':>10} {'MILPs':>6}")
    rows = []
    for name, space in LADDER:
        row = {"space": name, **timed_tune("gpt2-22b", cost_model, 4, 8, 512, seq, space)}
        rows.append(row)
        print(f"{name:<24} {row['wall_s']:>8.1f} {row['cpu_s']:>8.1f} {row['iteration_s']:>12.3f} {row['stages']:>3} "
              f"{row['grad_accum']:>4} {row['evaluated']:>10,} {row['milps']:>6}", flush=True)
    return rows


def cluster(seq: int = 2048, limit: int | None = None) -> list[dict]:
    print("cluster scaling on L4 profiles, full search space")
    print(f"{'model':<34} {'GPUs':>5} {'batch':>6} {'analysis s':>10} {'wall s':>8} {'cpu s':>8} {'iteration s':>12} "
          f"{'S':>3} {'G':>4}")
    rows = []
    for model, nodes, gpus, batch in CLUSTERS[:limit]:
        cost_model, analysis = build(model, seq)
        workload = None
        if model.endswith("gpt_175b"):
            workload = Workload(GPT_175B.layers, GPT_175B.heads, batch, seq, "float16", model)
        row = {"model": model, "gpus": nodes * gpus, "batch": batch, "analysis_s": analysis,
               **timed_tune(model, cost_model, nodes, gpus, batch, seq, SearchSpace(), workload)}
        rows.append(row)
        print(f"{model:<34} {row['gpus']:>5} {batch:>6} {analysis:>10.1f} {row['wall_s']:>8.1f} {row['cpu_s']:>8.1f} "
              f"{row['iteration_s']:>12.3f} {row['stages']:>3} {row['grad_accum']:>4}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", choices=("ladder", "cluster", "all"), nargs="?", default="all")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--clusters", type=int, help="only the first N cluster sizes")
    parser.add_argument("--json", help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    out = {}
    if args.which in ("ladder", "all"):
        out["ladder"] = ladder(args.seq)
    if args.which in ("cluster", "all"):
        out["cluster"] = cluster(args.seq, args.clusters)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(out, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
