"""End-to-end: plans executed on gloo ranks give the losses and weights of one-process training."""
from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mist_compiler.ir.plan import Plan

SEQ = 16
LR = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": float(os.environ.get("MIST_TEST_EPS", "1e-6")), "weight_decay": 0.1}


class LocalRuntime:
    """Test stand-in for StageRuntime (plain DP all-reduce + torch AdamW), until backend-a lands."""

    def __init__(self, units, *, dp_group, zero, offload, optimizer, device, param_dtype, timeout_s):
        self.params = [(f"{u}.{n}", p) for u, m in units for n, p in m.named_parameters()]
        self.opt = torch.optim.AdamW([p for _, p in self.params], **optimizer)
        self.dp_group = dp_group
        self.transforms = {}

    def begin_iteration(self):
        for _, p in self.params:
            p.grad = None

    def set_last_microbatch(self, last):
        pass

    def register_grad_transform(self, name, fn):
        self.transforms[name] = fn

    def finish_gradients(self):
        size = dist.get_world_size(self.dp_group)
        for name, p in self.params:
            if name in self.transforms:
                self.transforms[name](p.grad)
            dist.all_reduce(p.grad, group=self.dp_group)
            p.grad.div_(size)

    def step(self):
        self.opt.step()

    def named_full_parameters(self):
        return [(n, p.detach()) for n, p in self.params]


def stage(layers, dp=1, tp=1, micro_batch=None, **extra):
    return {"layers": list(layers), "nodes": 1, "gpus_per_node": dp * tp, "micro_batch": micro_batch, "dp": dp,
            "tp": tp, **extra}


def plan_dict(model, global_batch, grad_accum, stages):
    for s in stages:
        if s["micro_batch"] is None:
            s["micro_batch"] = global_batch // (grad_accum * s["dp"])
    return {"model": model, "seq_len": SEQ, "global_batch": global_batch, "dtype": "float32",
            "grad_accum": grad_accum, "stages": stages}


def _worker(rank, world, port, plans, out_dir, use_local_runtime):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import datetime

    from mist_compiler.backends.engine import compile as compile_plan
    from mist_compiler.backends.worker import compare, model_vocab, reference_training, synthetic_batch
    from mist_compiler.models import build_model

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    results = []
    for data in plans:
        plan = Plan.from_dict(data)
        model = build_model(plan.model, seq_len=plan.seq_len)
        engine = compile_plan(model, plan, optimizer=LR, timeout_s=60,
                              runtime_factory=LocalRuntime if use_local_runtime else None)
        vocab = model_vocab(model)
        losses = [engine.step(synthetic_batch(vocab, plan.global_batch, plan.seq_len, s)) for s in range(3)]
        state = engine.gather_full_state()
        if rank == 0:
            ref_losses, ref_state = reference_training(build_model(plan.model, seq_len=plan.seq_len), plan, 3, LR)
            worst, where = compare(losses, state, ref_losses, ref_state)
            results.append({"plan": data, "worst": worst, "where": where, "losses": losses, "ref": ref_losses})
        engine.close()
    if rank == 0:
        with open(os.path.join(out_dir, "results.json"), "w") as handle:
            json.dump(results, handle)
    dist.barrier()
    dist.destroy_process_group()


def run_plans(world, plans, use_local_runtime=True):
    port = 29500 + (os.getpid() % 2000)
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(world, port, plans, out_dir, use_local_runtime), nprocs=world, join=True)
        with open(os.path.join(out_dir, "results.json")) as handle:
            return json.load(handle)


def assert_all_match(results, tolerance=1e-5):
    bad = [(r["plan"]["stages"], r["worst"], r["where"]) for r in results if not r["worst"] <= tolerance]
    assert not bad, f"plans differ from single-process training: {bad}"


@pytest.mark.distributed
def test_pipeline_and_tensor_parallel_two_ranks():
    plans = [
        plan_dict("gpt-tiny", 8, 4, [stage((0, 2)), stage((2, 4))]),
        plan_dict("llama-tiny", 4, 1, [stage((0, 4), tp=2)]),
        plan_dict("gpt-tiny", 8, 2, [stage((0, 4), dp=2)]),
    ]
    results = run_plans(2, plans)
    for r in results:
        print(r["plan"]["stages"], r["worst"], r["where"], r["losses"], r["ref"])
    assert_all_match(results)


def tied_gpt():
    """gpt-tiny with the head tied to the token embedding (for the tied-weights plans)."""
    from dataclasses import replace

    from mist_compiler.models import TransformerLM, zoo_config

    torch.manual_seed(0)
    return TransformerLM(replace(zoo_config("gpt-tiny"), tied_head=True))


@pytest.mark.distributed
def test_heterogeneous_stages_four_ranks():
    plans = [
        # stages differ in dp, tp and micro_batch
        plan_dict("llama-tiny", 8, 2, [stage((0, 1), dp=2, tp=1), stage((1, 4), dp=1, tp=2)]),
        plan_dict("gpt-tiny", 8, 2, [stage((0, 3), dp=1, tp=2), stage((3, 4), dp=2, tp=1)]),
        # tied embedding/head across stages
        plan_dict("tests.test_backend_engine:tied_gpt", 8, 2, [stage((0, 2), dp=2), stage((2, 4), dp=2)]),
        plan_dict("gpt-tiny", 8, 2, [stage((0, 1)), stage((1, 2)), stage((2, 3)), stage((3, 4))]),
    ]
    results = run_plans(4, plans)
    for r in results:
        print(r["plan"]["stages"], r["worst"], r["where"], r["losses"], r["ref"])
    assert_all_match(results)
