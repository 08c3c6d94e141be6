"""Predicted speedup of the tuned plan over each baseline, in the same cost model (the paper's grid).

    python benchmarks/plan_quality.py            # GPT and LLaMA 1.3B-22B on l4 and a100-40gb
    python benchmarks/plan_quality.py --quick    # a small subset
    python benchmarks/plan_quality.py --json out.json

Grid (after the Mist paper): model size -> GPUs and global batch: 1.3B on 2 GPUs with batch 32,
2.7B/4/64, 7B/8/128, 13B/16/256, 22B/32/512 (8 GPUs per node); sequence 2048 on L4 and 4096 on
A100 (shared/FACTS.md). Baselines (``mist_compiler.tuner.baselines``): Megatron-style uniform grid,
ZeRO-3/FSDP only, and the paper's restricted Mist space. A speedup below 1 would mean the full
search missed a plan a baseline found; the table flags it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mist_compiler import driver  # noqa: E402
from mist_compiler.tuner.baselines import BASELINE_SPACES  # noqa: E402
from mist_compiler.tuner.space import TuneError  # noqa: E402

SIZES = [("1.3b", 1, 2, 32), ("2.7b", 1, 4, 64), ("7b", 1, 8, 128), ("13b", 2, 8, 256), ("22b", 4, 8, 512)]
FAMILIES = {"gpt": "gpt2-", "llama": "llama-"}
HARDWARE = {"l4": 2048, "a100-40gb": 4096}
QUICK = [("gpt2-1.3b", "l4", 1, 2, 32), ("llama-2.7b", "l4", 1, 4, 64), ("gpt2-7b", "a100-40gb", 1, 8, 128)]


def grid() -> list[tuple[str, str, int, int, int]]:
    return [(prefix + size, hardware, nodes, gpus, batch)
            for hardware in HARDWARE for prefix in FAMILIES.values() for size, nodes, gpus, batch in SIZES]


def evaluate_case(model: str, hardware: str, nodes: int, gpus: int, batch: int) -> dict:
    seq = HARDWARE[hardware]
    program, cost_model = driver.price(model, hardware, seq_len=seq)
    cluster = dict(nodes=nodes, gpus_per_node=gpus, global_batch=batch, seq_len=seq)
    clock = time.perf_counter()
    row = {"model": model, "hardware": hardware, "gpus": nodes * gpus, "batch": batch, "seq": seq}
    try:
        tuned = driver.tune(program, cost_model, **cluster)
    except TuneError as error:
        row["error"] = str(error)
        return row
    row["tune_s"] = time.perf_counter() - clock
    row["tuned_s"] = tuned.predicted_time_s
    row["mfu"] = tuned.mfu
    row["plan"] = f"S={tuned.plan.pp} G={tuned.plan.grad_accum}"
    for name in BASELINE_SPACES:
        try:
            baseline = driver.tune(program, cost_model, **cluster, baseline=name)
            row[name] = baseline.predicted_time_s
        except TuneError:
            row[name] = None  # the baseline has no plan that fits
    return row


def speedup(row: dict, name: str) -> float | None:
    if row.get(name) is None or "tuned_s" not in row:
        return None
    return row[name] / row["tuned_s"]


def print_table(rows: list[dict]) -> None:
    names = list(BASELINE_SPACES)
    print(f"{'model':<12} {'hw':<10} {'GPUs':>4} {'batch':>5} {'tuned s':>9} {'MFU':>6} {'plan':>11} "
          + " ".join(f"{'x ' + n:>12}" for n in names) + f" {'tune s':>7}")
    for row in rows:
        if "error" in row:
            print(f"{row['model']:<12} {row['hardware']:<10} {row['gpus']:>4} {row['batch']:>5}  no plan: {row['error']}")
            continue
        cells = []
        for name in names:
            value = speedup(row, name)
            flag = "" if value is None or value >= 1 - 1e-9 else "!"
            cells.append(f"{'n/a (OOM)' if value is None else f'{value:.2f}x{flag}':>12}")
        mfu = f"{row['mfu']:.1%}" if row.get("mfu") is not None else "n/a"
        print(f"{row['model']:<12} {row['hardware']:<10} {row['gpus']:>4} {row['batch']:>5} {row['tuned_s']:>9.3f} "
              f"{mfu:>6} {row['plan']:>11} " + " ".join(cells) + f" {row['tune_s']:>7.1f}")
    for name in names:
        values = [v for v in (speedup(r, name) for r in rows) if v is not None]
        if values:
            print(f"speedup over {name}: average {sum(values) / len(values):.2f}x, best {max(values):.2f}x, "
                  f"worst {min(values):.2f}x over {len(values)} cases"
                  + (f" ({sum(1 for r in rows if r.get(name) is None and 'tuned_s' in r)} cases where it has no plan)"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three small cases only")
    parser.add_argument("--json", help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    rows = []
    for case in (QUICK if args.quick else grid()):
        rows.append(evaluate_case(*case))
        print(f"done {case}", file=sys.stderr, flush=True)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
