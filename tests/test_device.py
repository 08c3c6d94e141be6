"""Each rank's device: cuda:LOCAL_RANK made current before any CUDA work; the CPU on CPU machines;
and a step does not make the host wait for the device per micro-batch."""
from __future__ import annotations

import pytest
import torch

from mist_compiler.runtime import device as device_module
from mist_compiler.runtime.device import DeviceError, select_device


def test_cpu_machine_selects_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert select_device() == torch.device("cpu")
    assert select_device("cpu") == torch.device("cpu")


@pytest.fixture
def four_fake_gpus(monkeypatch):
    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: current.append(torch.device(device)))
    return current


def test_gpu_rank_uses_its_local_rank_and_makes_it_current(monkeypatch, four_fake_gpus):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert select_device() == torch.device("cuda", 3)
    assert four_fake_gpus == [torch.device("cuda", 3)]
    assert select_device("cuda") == torch.device("cuda", 3)  # an unindexed request means this rank's GPU
    assert select_device("cuda:1") == torch.device("cuda", 1)


def test_local_rank_beyond_the_visible_gpus_is_named(monkeypatch, four_fake_gpus):
    monkeypatch.setenv("LOCAL_RANK", "5")
    with pytest.raises(DeviceError, match="4 GPU"):
        select_device()


def test_nccl_process_group_gets_the_device_id(monkeypatch):
    calls = []
    monkeypatch.setattr(device_module.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(device_module.dist, "init_process_group", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setenv("WORLD_SIZE", "8")
    device_module.init_process_group(60.0, torch.device("cuda", 2))
    assert calls[0][0] == ("nccl",) and calls[0][1]["device_id"] == torch.device("cuda", 2)
    device_module.init_process_group(60.0, torch.device("cpu"))
    assert calls[1][0] == ("gloo",) and "device_id" not in calls[1][1]


def test_a_step_waits_for_the_device_once_whatever_the_micro_batch_count(monkeypatch):
    """Every host read of a device value (item, tolist, cpu, float) in a step is counted: one, for the
    loss, with 2 or 8 micro-batches (on a GPU each would stall the host until the device catches up)."""
    import torch.distributed as dist

    from mist_compiler.ir.plan import Plan
    from mist_compiler.models import build_model
    from mist_compiler import compile as compile_plan
    from mist_compiler.verify.check import synthetic_batch

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    counts = []
    try:
        for grad_accum in (2, 8):
            plan = Plan.from_dict({"model": "gpt-tiny", "seq_len": 16, "global_batch": 8, "dtype": "float32",
                                   "grad_accum": grad_accum, "stages": [{"layers": [0, 4], "nodes": 1, "gpus_per_node": 1,
                                                                         "micro_batch": 8 // grad_accum, "dp": 1, "tp": 1}]})
            engine = compile_plan(build_model("gpt-tiny"), plan)
            batch = synthetic_batch(512, 8, 16, 0)
            engine.step(batch)
            reads = []
            with monkeypatch.context() as patch:
                for name in ("item", "tolist", "cpu", "__float__"):
                    original = getattr(torch.Tensor, name)

                    def counted(self, *args, _original=original, _name=name, **kwargs):
                        reads.append(_name)
                        return _original(self, *args, **kwargs)
                    patch.setattr(torch.Tensor, name, counted)
                engine.step(batch)
            engine.close()
            counts.append(len(reads))
    finally:
        dist.destroy_process_group()
    assert counts == [1, 1], counts
