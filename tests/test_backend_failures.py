"""Failure handling: a failed or killed rank makes every other rank exit, in time, naming it;
a plan that does not fit the launched world or the model is rejected before any computation."""
from __future__ import annotations

import datetime
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mist_compiler.ir.plan import Plan, PlanError
from tests.dist_utils import free_port

TIMEOUT_S = 6.0


def _plan(world: int) -> Plan:
    return Plan.from_dict({
        "model": "gpt-tiny", "seq_len": 16, "global_batch": 8, "dtype": "float32", "grad_accum": 2,
        "stages": [{"layers": [0, 2], "nodes": 1, "gpus_per_node": world // 2, "micro_batch": 8 // world, "dp": world // 2, "tp": 1},
                   {"layers": [2, 4], "nodes": 1, "gpus_per_node": world // 2, "micro_batch": 8 // world, "dp": world // 2, "tp": 1}],
    })


def _failing_worker(rank: int, world: int, port: int, mode: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    log = os.open(os.path.join(out_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 2)  # whatever this rank says (its own error on stderr, its monitor's on stdout) lands here
    os.dup2(log, 1)
    torch.set_num_threads(1)
    from mist_compiler.models import build_model
    from mist_compiler import compile as compile_plan
    from mist_compiler.verify.check import synthetic_batch

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    engine = compile_plan(build_model("gpt-tiny"), _plan(world), timeout_s=TIMEOUT_S)
    engine.step(synthetic_batch(512, 8, 16, 0))
    if rank == 1:
        with open(os.path.join(out_dir, "failed_at"), "w") as handle:
            handle.write(repr(time.time()))
        if mode == "exit":
            os._exit(17)  # a crash: no goodbye to anyone

        def broken(*args, **kwargs):
            raise RuntimeError("injected failure")

        engine.program.module.forward = broken
    try:
        engine.step(synthetic_batch(512, 8, 16, 1))
        print("finished", file=sys.stderr, flush=True)
        os._exit(0)
    except Exception as error:  # what the worker does: say why, leave non-zero
        print(f"{type(error).__name__}: {error}", file=sys.stderr, flush=True)
        os._exit(1)


def _run_failure(mode: str, out_dir: str, world: int = 4):
    context = mp.get_context("spawn")
    port = free_port()
    processes = [context.Process(target=_failing_worker, args=(r, world, port, mode, out_dir), daemon=True)
                 for r in range(world)]
    for process in processes:
        process.start()
    exited_at: dict[int, float] = {}
    deadline = time.time() + 120
    while len(exited_at) < world and time.time() < deadline:
        for rank, process in enumerate(processes):
            if rank not in exited_at and not process.is_alive():
                exited_at[rank] = time.time()
        time.sleep(0.05)
    alive = [rank for rank, p in enumerate(processes) if p.is_alive()]
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join()
    logs = {}
    for rank in range(world):
        with open(os.path.join(out_dir, f"rank{rank}.log")) as handle:
            logs[rank] = handle.read()
    with open(os.path.join(out_dir, "failed_at")) as handle:
        failed_at = float(handle.read())
    return alive, [p.exitcode for p in processes], logs, {r: t - failed_at for r, t in exited_at.items()}


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["raise", "exit"])
def test_a_failed_rank_makes_the_others_exit_in_time_naming_it(mode, tmp_path):
    alive, exit_codes, logs, exit_delay = _run_failure(mode, str(tmp_path))
    assert not alive, f"ranks still running after the failure: {alive}"
    assert all(code != 0 for code in exit_codes), exit_codes
    for rank in (0, 2, 3):
        assert "rank 1" in logs[rank] and "failed" in logs[rank], f"rank {rank} does not name rank 1: {logs[rank][-600:]}"
        assert exit_delay[rank] < 3 * TIMEOUT_S, f"rank {rank} exited {exit_delay[rank]:.1f} s after the failure"
    if mode == "raise":
        assert "injected failure" in logs[0]


def _single_rank_group():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def _count_forward_calls(model):
    """Forward calls on real tensors (capture traces a fake copy: no real computation)."""
    from torch._subclasses.fake_tensor import FakeTensor

    calls = []

    def count(module, args, kwargs):
        values = list(args) + list(kwargs.values())
        if not any(isinstance(v, FakeTensor) for v in values) and not torch.compiler.is_compiling():
            calls.append(1)

    model.register_forward_pre_hook(count, with_kwargs=True)
    for block in model.blocks:
        block.register_forward_pre_hook(count, with_kwargs=True)
    return calls


def test_plan_for_another_world_size_is_rejected_before_compute():
    from mist_compiler.models import build_model
    from mist_compiler import compile as compile_plan

    _single_rank_group()
    try:
        model = build_model("gpt-tiny")
        calls = _count_forward_calls(model)
        with pytest.raises(PlanError, match=r"needs 2 ranks .* but 1 were launched"):
            compile_plan(model, _plan(2))
        assert not calls
    finally:
        dist.destroy_process_group()


def test_plan_for_another_model_is_rejected_before_compute():
    from mist_compiler.models import build_model
    from mist_compiler import compile as compile_plan

    data = _plan(2).to_dict()
    data["stages"] = [{**data["stages"][0], "layers": [0, 6], "gpus_per_node": 1, "dp": 1, "micro_batch": 4}]
    _single_rank_group()
    try:
        model = build_model("gpt-tiny")
        calls = _count_forward_calls(model)
        with pytest.raises(PlanError, match="covers 6 layers but model 'gpt-tiny' has 4"):
            compile_plan(model, Plan.from_dict(data))
        assert not calls
        data["stages"][0].update(layers=[0, 4], tp=1)
        data["seq_len"] = 4096
        with pytest.raises(PlanError, match="seq_len"):
            compile_plan(model, Plan.from_dict(data))
    finally:
        dist.destroy_process_group()
