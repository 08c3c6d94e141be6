"""Tuning time as the search space grows and as the cluster grows, with the plans' quality.

    python benchmarks/tuning_time.py ladder     # GPT-22B on 4 x 8 L4, global batch 512
    python benchmarks/tuning_time.py cluster    # 8 -> 16,384 GPUs: GPT-7B ... GPT-3 175B on L4, Llama 3 405B on H100
    python benchmarks/tuning_time.py all [--json out.json] [--no-baseline] [--clusters N]

The ladder adds one family at a time: base (ZeRO 0/1, checkpoint all-or-none, no offload),
+ZeRO-2/3, +checkpoint tuning (any count), +optimizer offload, +activation offload, +gradient
offload, +weight offload (the last rung is the full space).

Every row runs in its own process (so peak memory is the row's own) and prints: the tuner's wall
and CPU seconds (the model capture and analysis, once per model, separately), the process's peak
resident memory, the certified optimality gap, the predicted iteration time and MFU, the plan's
shape, and the speedup over the best Megatron-style grid plan (TP within a node, PP, DP,
micro-batch, full or no checkpointing; ``tuner.baselines``) priced by the same cost model. On a
shared machine the wall clock includes waiting for the CPU: compare CPU seconds.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import sys
import time
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mist_compiler.tuner.space import SearchSpace  # noqa: E402

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
# (model, hardware, nodes, gpus per node, global batch, sequence, dtype)
CLUSTERS = [
    ("gpt2-7b", "l4", 1, 8, 128, 2048, "float16"),
    ("gpt2-13b", "l4", 2, 8, 256, 2048, "float16"),
    ("gpt2-22b", "l4", 4, 8, 512, 2048, "float16"),
    ("gpt2-40b", "l4", 8, 8, 512, 2048, "float16"),
    ("gpt3-175b", "l4", 32, 8, 1024, 2048, "float16"),
    ("gpt3-175b", "l4", 128, 8, 2048, 2048, "float16"),
    ("llama-70b", "h100-80gb", 2048, 8, 8192, 4096, "bfloat16"),
    ("llama-405b", "h100-80gb", 2048, 8, 2048, 8192, "bfloat16"),
]


def run_case(model: str, hardware: str, nodes: int, gpus: int, batch: int, seq: int, dtype: str,
             space: SearchSpace, baseline: bool) -> dict:
    """Analyse, tune and (optionally) tune the Megatron-style baseline; the numbers of one row."""
    from mist_compiler import driver
    from mist_compiler.tuner.space import TuneError

    clock = time.perf_counter()
    program, cost_model = driver.price(model, hardware, seq_len=seq, dtype=dtype)
    analysis = time.perf_counter() - clock
    wall, cpu = time.perf_counter(), time.process_time()
    result = driver.tune(program, cost_model, nodes=nodes, gpus_per_node=gpus, global_batch=batch, seq_len=seq,
                         space=space)
    row = {
        "model": model, "hardware": hardware, "gpus": nodes * gpus, "batch": batch, "seq": seq,
        "analysis_s": analysis, "wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
        "peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
        "iteration_s": result.predicted_time_s, "mfu": result.mfu, "gap": result.stats.get("gap", 0.0),
        "stages": result.plan.pp, "grad_accum": result.plan.grad_accum,
        "tp": sorted({s.tp for s in result.plan.stages}), "evaluated": result.stats["evaluated"],
        "flag": result.stats.get("mfu_flag"),
    }
    if baseline:
        clock = time.process_time()
        try:
            megatron = driver.tune(program, cost_model, nodes=nodes, gpus_per_node=gpus, global_batch=batch,
                                   seq_len=seq, baseline="megatron")
            row["megatron_s"] = megatron.predicted_time_s
            row["megatron_plan"] = (f"TP{megatron.plan.stages[0].tp} PP{megatron.plan.pp} DP{megatron.plan.stages[0].dp} "
                                    f"mb{megatron.plan.stages[0].micro_batch} G{megatron.plan.grad_accum} "
                                    f"{'ckpt' if megatron.plan.stages[0].ckpt_layers else 'no-ckpt'}")
        except TuneError:
            row["megatron_s"] = None  # no Megatron-style plan fits
        row["megatron_cpu_s"] = time.process_time() - clock
    return row


def _isolated(args: tuple) -> dict:
    return run_case(*args)


def run_isolated(*args) -> dict:
    """``run_case`` in a fresh process (its peak memory is the row's own)."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_isolated, args).result()


HEADER = (f"{'GPUs':>6} {'analysis s':>10} {'wall s':>7} {'cpu s':>7} {'peak GB':>7} {'gap':>7} {'iteration s':>11} "
          f"{'MFU':>6} {'S':>3} {'G':>4} {'TP':>7} {'x Megatron':>10}")


def format_row(row: dict) -> str:
    mfu = f"{row['mfu']:.1%}" if row.get("mfu") is not None else "n/a"
    speedup = row.get("megatron_s")
    versus = "no plan" if "megatron_s" in row and speedup is None else (
        f"{speedup / row['iteration_s']:.2f}x" if speedup else "-")
    tps = ",".join(str(t) for t in row["tp"])
    line = (f"{row['gpus']:>6} {row['analysis_s']:>10.1f} {row['wall_s']:>7.1f} {row['cpu_s']:>7.1f} "
            f"{row['peak_gb']:>7.2f} {row['gap']:>7.2%} {row['iteration_s']:>11.3f} {mfu:>6} {row['stages']:>3} "
            f"{row['grad_accum']:>4} {tps:>7} {versus:>10}")
    return line + (" (MFU above the hardware's published best)" if row.get("flag") else "")


def ladder(seq: int = 2048, baseline: bool = True) -> list[dict]:
    print("GPT-22B on 4 x 8 L4, global batch 512, sequence 2048")
    print(f"{'space':<24} " + HEADER)
    rows = []
    for name, space in LADDER:
        row = {"space": name, **run_isolated("gpt2-22b", "l4", 4, 8, 512, seq, "float16", space,
                                             baseline and name == LADDER[-1][0])}
        rows.append(row)
        print(f"{name:<24} " + format_row(row), flush=True)
    return rows


def cluster(limit: int | None = None, baseline: bool = True) -> list[dict]:
    print("cluster scaling, full search space")
    print(f"{'model':<12} {'hw':<10} {'batch':>6} {'seq':>5} " + HEADER)
    rows = []
    for case in CLUSTERS[:limit]:
        row = run_isolated(*case, SearchSpace(), baseline)
        rows.append(row)
        print(f"{row['model']:<12} {row['hardware']:<10} {row['batch']:>6} {row['seq']:>5} " + format_row(row), flush=True)
    for row in rows:
        if row.get("megatron_plan"):
            print(f"  Megatron-style best for {row['model']} on {row['gpus']}: {row['megatron_plan']} "
                  f"({row['megatron_s']:.3f} s, searched in {row['megatron_cpu_s']:.1f} s CPU)")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", choices=("ladder", "cluster", "all"), nargs="?", default="all")
    parser.add_argument("--seq", type=int, default=2048, help="sequence length of the ladder")
    parser.add_argument("--clusters", type=int, help="only the first N cluster rows")
    parser.add_argument("--no-baseline", action="store_true", help="skip the Megatron-style grid plans")
    parser.add_argument("--json", help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    out = {}
    if args.which in ("ladder", "all"):
        out["ladder"] = ladder(args.seq, not args.no_baseline)
    if args.which in ("cluster", "all"):
        out["cluster"] = cluster(args.clusters, not args.no_baseline)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(out, handle, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
