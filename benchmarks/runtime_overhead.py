"""Runtime overhead: mist-compiler against the same configuration composed by hand in PyTorch.

For each configuration the same model, global batch and AdamW run twice on the same ranks: once
through ``mist_compiler.compile(model, plan)`` and once through plain PyTorch (DDP, FSDP2
``fully_shard``, ``torch.distributed.pipelining`` with ``Schedule1F1B``, DTensor TP through
``parallelize_module``). The table reports the median step time of each and their ratio
(mist / PyTorch; the target is <= 1.1).

    python benchmarks/runtime_overhead.py                 # 2 and 4 gloo ranks, gpt-small
    python benchmarks/runtime_overhead.py --world 2 --steps 6 --model gpt-tiny

On a machine with as many GPUs as ranks it uses NCCL and one GPU per rank; otherwise gloo on
the CPU (where the timings are dominated by compute shared by all ranks of the machine).
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mist_compiler.ir.plan import Plan  # noqa: E402
from mist_compiler.models import build_model, zoo_config  # noqa: E402
from mist_compiler.runtime.optimizer import AdamWConfig  # noqa: E402
from mist_compiler.verify.check import synthetic_batch  # noqa: E402

ADAMW = AdamWConfig(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)


@dataclass(frozen=True)
class Config:
    name: str
    world: int
    stages: list  # plan stages (dicts without layers/nodes/gpus/micro_batch)
    grad_accum: int
    baseline: str  # ddp | fsdp | pipeline | tp


def configs(world: int) -> list[Config]:
    if world == 2:
        return [
            Config("DP=2", 2, [{"dp": 2}], 1, "ddp"),
            Config("DP=2 ZeRO-3", 2, [{"dp": 2, "zero": 3}], 1, "fsdp"),
            Config("PP=2 (G=4)", 2, [{"dp": 1}, {"dp": 1}], 4, "pipeline"),
            Config("TP=2", 2, [{"dp": 1, "tp": 2}], 1, "tp"),
        ]
    return [
        Config("DP=4", 4, [{"dp": 4}], 1, "ddp"),
        Config("DP=4 ZeRO-3", 4, [{"dp": 4, "zero": 3}], 1, "fsdp"),
        Config("PP=4 (G=4)", 4, [{"dp": 1}] * 4, 4, "pipeline"),
    ]  # TP=4 needs heads divisible by 4 (gpt-small has 6); TP is measured on 2 ranks


def make_plan(cfg: Config, model: str, layers: int, batch: int, seq: int) -> Plan:
    per_stage = layers // len(cfg.stages)
    stages = []
    for index, extra in enumerate(cfg.stages):
        dp, tp = extra.get("dp", 1), extra.get("tp", 1)
        end = layers if index == len(cfg.stages) - 1 else (index + 1) * per_stage
        stages.append({"layers": [index * per_stage, end], "nodes": 1, "gpus_per_node": dp * tp,
                       "micro_batch": batch // (dp * cfg.grad_accum), "dp": dp, "tp": tp, "zero": extra.get("zero", 0)})
    return Plan.from_dict({"model": model, "seq_len": seq, "global_batch": batch, "dtype": "float32",
                           "grad_accum": cfg.grad_accum, "stages": stages})


def timed(step: Callable[[int], None], steps: int, warmup: int, device: torch.device) -> float:
    times = []
    for index in range(warmup + steps):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step(index)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if index >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


# ------------------------------------------------------------------------------ mist
def run_mist(cfg: Config, args, device: torch.device) -> float:
    from mist_compiler import compile as compile_plan

    plan = make_plan(cfg, args.model, zoo_config(args.model).layers, args.batch, args.seq)
    engine = compile_plan(build_model(args.model, seq_len=args.seq), plan, optimizer=ADAMW, device=device)
    vocab = zoo_config(args.model).vocab
    batches = [synthetic_batch(vocab, args.batch, args.seq, i) for i in range(2)]
    result = timed(lambda i: engine.step(batches[i % 2]), args.steps, args.warmup, device)
    engine.close()
    return result


# ------------------------------------------------------------------------------ plain PyTorch
def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=ADAMW.lr, betas=ADAMW.betas, eps=ADAMW.eps, weight_decay=ADAMW.weight_decay)


def _local_batch(batch: dict, rank: int, world: int) -> dict:
    share = batch["input_ids"].shape[0] // world
    return {k: v[rank * share:(rank + 1) * share] for k, v in batch.items()}



def _time_training(model: nn.Module, opt, batches: list[dict], args, device) -> float:
    """Time plain forward/backward/AdamW steps of a hand-composed model over two alternating batches."""

    def step(index: int) -> None:
        batch = {k: v.to(device) for k, v in batches[index % 2].items()}
        model(**batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return timed(step, args.steps, args.warmup, device)

def run_ddp_or_fsdp(cfg: Config, args, device: torch.device, rank: int) -> float:
    model = build_model(args.model, seq_len=args.seq).to(device)
    if cfg.baseline == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (cfg.world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = _adamw(model.parameters())
    vocab = zoo_config(args.model).vocab
    batches = [_local_batch(synthetic_batch(vocab, args.batch, args.seq, i), rank, cfg.world) for i in range(2)]

    return _time_training(model, opt, batches, args, device)


class _FirstStage(nn.Module):
    def __init__(self, model: nn.Module, blocks: range) -> None:
        super().__init__()
        self.embed, self.pos_embed = model.embed, model.pos_embed
        self.blocks = nn.ModuleList(model.blocks[i] for i in blocks)

    def forward(self, input_ids):
        x = self.embed(input_ids) + self.pos_embed(torch.arange(input_ids.shape[1], device=input_ids.device))
        for block in self.blocks:
            x = block(x)
        return x


class _MiddleStage(nn.Module):
    def __init__(self, model: nn.Module, blocks: range, last: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(model.blocks[i] for i in blocks)
        self.last = last
        if last:
            self.final_norm, self.head = model.final_norm, model.head

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x)) if self.last else x


def run_pipeline(cfg: Config, args, device: torch.device, rank: int) -> float:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    model = build_model(args.model, seq_len=args.seq)
    layers = len(model.blocks)
    stages = cfg.world
    per = layers // stages
    blocks = range(rank * per, layers if rank == stages - 1 else (rank + 1) * per)
    module = _FirstStage(model, blocks) if rank == 0 else _MiddleStage(model, blocks, rank == stages - 1)
    module.to(device)
    stage = PipelineStage(module, rank, stages, device)

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))

    schedule = Schedule1F1B(stage, n_microbatches=cfg.grad_accum, loss_fn=loss_fn)
    opt = _adamw(module.parameters())
    vocab = zoo_config(args.model).vocab
    batches = [synthetic_batch(vocab, args.batch, args.seq, i) for i in range(2)]

    def step(index: int) -> None:
        batch = batches[index % 2]
        if rank == 0:
            schedule.step(batch["input_ids"].to(device))
        elif rank == stages - 1:
            schedule.step(target=batch["labels"].to(device), losses=[])
        else:
            schedule.step()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return timed(step, args.steps, args.warmup, device)


def run_tp(cfg: Config, args, device: torch.device, rank: int) -> float:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = build_model(args.model, seq_len=args.seq).to(device)
    mesh = init_device_mesh(device.type, (cfg.world,))
    plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.o": RowwiseParallel(), "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()}
    for block in model.blocks:
        parallelize_module(block, mesh, plan)
    opt = _adamw(model.parameters())
    vocab = zoo_config(args.model).vocab
    batches = [synthetic_batch(vocab, args.batch, args.seq, i) for i in range(2)]

    return _time_training(model, opt, batches, args, device)


BASELINES = {"ddp": run_ddp_or_fsdp, "fsdp": run_ddp_or_fsdp, "pipeline": run_pipeline, "tp": run_tp}


def _rank_main(rank: int, world: int, port: int, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, args.threads))
    use_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= world
    device = torch.device("cuda", rank) if use_gpu else torch.device("cpu")
    if use_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_gpu else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    rows = []
    for cfg in configs(world):
        torch.manual_seed(0)
        mist = run_mist(cfg, args, device)
        torch.manual_seed(0)
        baseline = BASELINES[cfg.baseline](cfg, args, device, rank)
        rows.append((cfg.name, cfg.baseline, mist, baseline))
    if rank == 0:
        results.put((str(device.type), rows))
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--batch", type=int, default=8, help="global batch")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args(argv)
    context = mp.get_context("spawn")
    print(f"model {args.model}, global batch {args.batch}, seq {args.seq}, median of {args.steps} steps "
          f"after {args.warmup} warm-up, {args.threads} thread(s) per rank")
    print(f"{'ranks':>5}  {'configuration':<14} {'PyTorch by hand':<22} {'mist s/step':>11} {'torch s/step':>12} {'ratio':>6}")
    for world in args.world:
        results = context.SimpleQueue()
        mp.start_processes(_rank_main, args=(world, free_port(), args, results), nprocs=world, join=True,
                           start_method="spawn")
        device, rows = results.get()
        names = {"ddp": "DDP", "fsdp": "FSDP2 fully_shard", "pipeline": "pipelining 1F1B", "tp": "DTensor TP"}
        for name, baseline, mist, torch_time in rows:
            print(f"{world:>5}  {name:<14} {names[baseline] + ' (' + device + ')':<22} {mist:>11.3f} "
                  f"{torch_time:>12.3f} {mist / torch_time:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
