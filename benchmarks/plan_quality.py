"""Predicted speedup of the tuned plan over each baseline, in the same cost model.

    python benchmarks/plan_quality.py                 # the zoo ladder: full space vs the paper's Mist space
    python benchmarks/plan_quality.py --paper-grid    # the Mist paper's grid, every baseline
    python benchmarks/plan_quality.py --quick         # a small subset
    python benchmarks/plan_quality.py --json out.json

Ladder (default): GPT and LLaMA 1.3B-22B on L4 (sequence 2048) and H100 (sequence 4096): 1.3B and
2.7B on 8 GPUs, 7B on 16, 13B on 32, 22B on 64 (8 GPUs per node), 16 sequences per GPU (the paper's
ratio): the tuned plan of the full space (every schedule: 1F1B, interleaved, ZB-H1, ZB-V, and every
knob) against the paper's Mist space (1F1B; micro-batch 1/2/4, one TP degree, equal devices, layers
within +-2 of an even split), both priced by simulating their schedule; and against the full space without sequence parallelism
and per-tensor activation choices (``x no-sp/pt``: what those two bring). The paper's grid
(``--paper-grid``): 1.3B on 2 GPUs with batch 32, 2.7B/4/64, 7B/8/128, 13B/16/256, 22B/32/512; L4 and
A100-40GB; baselines (``mist_compiler.tuner.baselines``): Megatron-style uniform grid, ZeRO-3/FSDP
only, and the paper's restricted Mist space. A speedup below 1 would mean the full search missed a
plan a baseline found; the table flags it.
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
from mist_compiler.tuner.space import SearchSpace, TuneError  # noqa: E402

# the full space less one of its additions: what sequence parallelism and per-tensor activation
# choices bring on their own (issue 26), next to the paper's space (everything this compiler adds)
ABLATIONS = {"no-sp/pt": SearchSpace(sequence_parallel=False, per_tensor=False)}

SIZES = [("1.3b", 1, 2, 32), ("2.7b", 1, 4, 64), ("7b", 1, 8, 128), ("13b", 2, 8, 256), ("22b", 4, 8, 512)]
LADDER_SIZES = [("1.3b", 1, 8, 128), ("2.7b", 1, 8, 128), ("7b", 2, 8, 256), ("13b", 4, 8, 512), ("22b", 8, 8, 1024)]
FAMILIES = {"gpt": "gpt2-", "llama": "llama-"}
HARDWARE = {"l4": 2048, "a100-40gb": 4096}
LADDER_HARDWARE = {"l4": 2048, "h100-80gb": 4096}
SEQ = {**HARDWARE, **LADDER_HARDWARE}
QUICK = [("gpt2-1.3b", "l4", 1, 8, 128), ("llama-7b", "h100-80gb", 2, 8, 256), ("gpt2-13b", "l4", 4, 8, 512)]


def grid(paper: bool = False) -> list[tuple[str, str, int, int, int]]:
    sizes, hardware_seq = (SIZES, HARDWARE) if paper else (LADDER_SIZES, LADDER_HARDWARE)
    return [(prefix + size, hardware, nodes, gpus, batch)
            for hardware in hardware_seq for prefix in FAMILIES.values() for size, nodes, gpus, batch in sizes]


def evaluate_case(model: str, hardware: str, nodes: int, gpus: int, batch: int, baselines=tuple(BASELINE_SPACES)) -> dict:
    seq = SEQ[hardware]
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
    row["schedule"] = tuned.plan.schedule + (f"/{tuned.plan.virtual_stages}" if tuned.plan.virtual_stages > 1 else "")
    row["one_f_one_b_s"] = tuned.stats.get("one_f_one_b_s")
    for name in baselines:
        try:
            spaces = {"space": ABLATIONS[name]} if name in ABLATIONS else {"baseline": name}
            baseline = driver.tune(program, cost_model, **cluster, **spaces)
            row[name] = baseline.predicted_time_s
        except TuneError:
            row[name] = None  # the baseline has no plan that fits
    return row


def speedup(row: dict, name: str) -> float | None:
    if row.get(name) is None or "tuned_s" not in row:
        return None
    return row[name] / row["tuned_s"]


def print_table(rows: list[dict], names: list[str]) -> None:
    print(f"{'model':<12} {'hw':<10} {'GPUs':>4} {'batch':>5} {'tuned s':>9} {'MFU':>6} {'plan':>11} {'schedule':>13} "
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
              f"{mfu:>6} {row['plan']:>11} {row['schedule']:>13} " + " ".join(cells) + f" {row['tune_s']:>7.1f}")
    for name in names:
        values = [v for v in (speedup(r, name) for r in rows) if v is not None]
        if values:
            print(f"speedup over {name}: average {sum(values) / len(values):.3f}x, best {max(values):.2f}x, "
                  f"worst {min(values):.2f}x over {len(values)} cases"
                  + (f" ({sum(1 for r in rows if r.get(name) is None and 'tuned_s' in r)} cases where it has no plan)"))
    gains = [r["one_f_one_b_s"] / r["tuned_s"] for r in rows if r.get("one_f_one_b_s") and "tuned_s" in r]
    if gains:
        chosen = sum(1 for r in rows if r.get("schedule", "1f1b") != "1f1b")
        print(f"schedules alone (the full space's best 1F1B plan / its chosen plan): average {sum(gains) / len(gains):.3f}x, "
              f"best {max(gains):.2f}x; a schedule other than 1F1B chosen in {chosen} of {len(gains)} cases")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three cases of the ladder only")
    parser.add_argument("--paper-grid", action="store_true", help="the Mist paper's grid against every baseline")
    parser.add_argument("--json", help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    names = list(BASELINE_SPACES) if args.paper_grid else ["mist-paper", *ABLATIONS]
    rows = []
    for case in (QUICK if args.quick else grid(args.paper_grid)):
        rows.append(evaluate_case(*case, baselines=names))
        print(f"done {case}", file=sys.stderr, flush=True)
        if args.json:  # as it goes: a long run keeps what it measured
            with open(args.json, "w") as handle:
                json.dump(rows, handle, indent=1)
    print_table(rows, names)
    return 0


if __name__ == "__main__":
    sys.exit(main())
