"""Start-up memory per rank: what a rank holds once its engine is built, against the whole model.

A plan is chosen because the model does not fit on one device, so no rank may build the whole
model. This benchmark builds, rank by rank, the engine of a gpt2-7b plan with 4 pipeline stages
of 8 layers, each data parallel over 4 devices under ZeRO-3 (16 devices, bf16), exactly as
``mistc run`` builds it: capture on fake tensors, the lowering passes, then the runtime lays
out the rank's ZeRO-3 shard unit by unit, each parameter initialised on demand from the model
built on the meta device.

Each measured rank runs in its own process, joined to torch's ``fake`` process group of the
plan's world size (collectives are no-ops), so one machine stands in for one rank of the job at a
time. Per rank the table gives:

- host peak: the process's peak resident set during start-up, above its resident set before
  (torch and mist_compiler imported);
- device peak: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` with ``--device
  cuda``; on the CPU the device is the host, so the host column is the one to read;
- kept: the bytes the runtime keeps for the rank (bf16 weight shard, fp32 master shard, Adam
  moments: ``StageRuntime.memory_report``), which the peak should approach;
- against the whole model's fp32 weights, what every rank built before start-up was made lazy.

    python benchmarks/startup_memory.py                     # gpt2-7b, PP=4, dp=4, ZeRO-3
    python benchmarks/startup_memory.py --model gpt2-1.3b --dp 2 --stages 2 --device cuda
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GIB = 1024 ** 3


def plan_dict(model: str, stages: int, dp: int, seq_len: int, layers: int) -> dict:
    if layers % stages:
        raise SystemExit(f"--stages {stages} must divide the model's {layers} layers")
    per = layers // stages
    return {"model": model, "seq_len": seq_len, "global_batch": 4 * dp, "dtype": "bfloat16", "grad_accum": 4,
            "stages": [{"layers": [s * per, (s + 1) * per], "nodes": 1, "gpus_per_node": dp, "micro_batch": 1,
                        "dp": dp, "tp": 1, "zero": 3, "ckpt_layers": per} for s in range(stages)]}


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure_rank(plan_json: str, rank: int, device: str) -> dict:
    """Build ``rank``'s engine in this process (fake process group) and report its memory."""
    import torch
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the 'fake' backend)

    from mist_compiler.ir.plan import Plan
    from mist_compiler import compile as compile_plan

    plan = Plan.from_dict(json.loads(plan_json))
    before = rss_bytes()
    if peak_rss_bytes() > before + 64 * 1024 ** 2:
        raise SystemExit("the process's resident set peaked before start-up; the host peak would be wrong")
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=plan.world_size)
    start = time.perf_counter()
    engine = compile_plan(plan.model, plan, device=device, timeout_s=600)
    seconds = time.perf_counter() - start
    report = engine.runtime.memory_report()
    kept = sum(report["device"].values()) + sum(report["host"].values())
    result = {"rank": rank, "stage": engine.coord.stage, "host_peak": peak_rss_bytes() - before, "kept": kept,
              "params": sum(p.numel() for _, m in engine.program.units for p in m.parameters()), "seconds": seconds}
    if device.startswith("cuda"):
        result["device_allocated"] = torch.cuda.max_memory_allocated()
        result["device_reserved"] = torch.cuda.max_memory_reserved()
    engine.close()
    return result


def run_child(plan: dict, rank: int, device: str) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--child-rank", str(rank), "--plan-json", json.dumps(plan),
               "--device", device]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"rank {rank} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2-7b")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (one rank's device at a time)")
    parser.add_argument("--child-rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--plan-json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_rank is not None:
        print(json.dumps(measure_rank(args.plan_json, args.child_rank, args.device)))
        return 0

    from mist_compiler.models import zoo_config
    from mist_compiler.models.transformer import parameter_count

    config = zoo_config(args.model, args.seq_len)
    total = parameter_count(config)
    plan = plan_dict(args.model, args.stages, args.dp, args.seq_len, config.layers)
    print(f"{args.model}: {total / 1e9:.2f} B parameters, whole model fp32 {total * 4 / GIB:.1f} GiB; plan PP={args.stages} "
          f"x dp={args.dp} ZeRO-3 bf16 ({args.stages * args.dp} devices), one rank per stage measured on {args.device}")
    header = f"{'rank':>4} {'stage':>5} {'stage params':>12} {'kept GiB':>9} {'host peak GiB':>14} {'peak/kept':>9} {'peak/whole':>10} {'s':>6}"
    if args.device.startswith("cuda"):
        header += f" {'dev alloc GiB':>13} {'dev rsvd GiB':>12}"
    print(header)
    for stage in range(args.stages):
        rank = stage * args.dp  # dp index 0 of each stage
        row = run_child(plan, rank, args.device)
        line = (f"{row['rank']:>4} {row['stage']:>5} {row['params'] / 1e9:>11.2f}B {row['kept'] / GIB:>9.2f} "
                f"{row['host_peak'] / GIB:>14.2f} {row['host_peak'] / max(row['kept'], 1):>9.2f} "
                f"{row['host_peak'] / (total * 4):>10.3f} {row['seconds']:>6.1f}")
        if "device_allocated" in row:
            line += f" {row['device_allocated'] / GIB:>13.2f} {row['device_reserved'] / GIB:>12.2f}"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
