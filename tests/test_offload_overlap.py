"""Offload work overlaps the device's: a torch.profiler timeline on CPU shows the host threads'
gradient accumulation and AdamW running while the main thread computes, and the results equal
the synchronous path's."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from mist_compiler.runtime.optimizer import AdamWConfig
from mist_compiler.runtime.stage_runtime import StageRuntime
from mist_compiler.ir.plan import Offload

WIDTH = 768
UNITS = 6


@pytest.fixture(autouse=True)
def _compute_leaves_a_core_to_the_host_workers():
    """The main thread stands in for the device. On a GPU it launches kernels and the host's cores are
    the host workers'; here its kernels would take both cores (OpenMP's team spins between kernels),
    so whether a worker ran beside them was the OS scheduler's call. One compute thread gives the host
    workers what a GPU run gives them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _units(seed: int = 0) -> list[tuple[str, nn.Module]]:
    torch.manual_seed(seed)
    return [(f"layer{i}", nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())) for i in range(UNITS)]


def _runtime(units, zero: int, offload: Offload, grad_accum_free: bool = True) -> StageRuntime:
    return StageRuntime(units, dp_group=None, zero=zero, offload={name: offload for name, _ in units},
                        optimizer=AdamWConfig(lr=1e-2, weight_decay=0.1), device=torch.device("cpu"))


def _train_step(runtime: StageRuntime, units, grad_accum: int) -> None:
    runtime.begin_iteration()
    for micro in range(grad_accum):
        x = torch.randn(32, WIDTH, generator=torch.Generator().manual_seed(micro))
        for _, module in units:
            x = module(x)
        runtime.set_last_microbatch(micro == grad_accum - 1)
        (x.square().mean() / grad_accum).backward()
    runtime.finish_gradients()
    runtime.step()


def _intervals(prof, name: str) -> list[tuple[int, float, float]]:
    return [(event.thread, event.time_range.start, event.time_range.end) for event in prof.events() if event.name == name]


def _overlapping(first, second) -> list:
    return [(a, b) for a in first for b in second if a[0] != b[0] and a[1] < b[2] and b[1] < a[2]]


def _profile(zero: int, offload: Offload, grad_accum: int, trace_path=None):
    units = _units()
    runtime = _runtime(units, zero, offload)
    _train_step(runtime, units, grad_accum)  # warm-up (first-touch allocations)
    all_threads = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)  # the host workers too
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], experimental_config=all_threads) as prof:
        _train_step(runtime, units, grad_accum)
    if trace_path is not None:
        prof.export_chrome_trace(str(trace_path))
    weights = {k: v.clone() for k, v in runtime.named_full_parameters().items()}
    runtime.remove_hooks()
    return prof, weights


def _synchronous_weights(zero: int, offload: Offload, grad_accum: int) -> dict[str, torch.Tensor]:
    units = _units()
    runtime = _runtime(units, zero, offload)
    runtime.host_memory.workers = None  # writes inline, host AdamW inline
    runtime.optimizer.workers = None
    for _ in range(2):
        _train_step(runtime, units, grad_accum)
    weights = {k: v.clone() for k, v in runtime.named_full_parameters().items()}
    runtime.remove_hooks()
    return weights


@pytest.mark.exclusive  # asserts that threads overlapped
def test_host_adamw_runs_while_the_device_part_is_updated(tmp_path):
    offload = Offload(opt=0.5)
    for attempt in range(3):  # the machine is shared: a busy moment can serialise the threads
        prof, weights = _profile(0, offload, 1, tmp_path / "adamw_trace.json")
        pairs = _overlapping(_intervals(prof, "mist.host_adamw"), _intervals(prof, "mist.device_adamw"))
        if pairs:
            break
    assert pairs, "no host AdamW chunk ran while the device part was being updated"
    trace = json.loads((tmp_path / "adamw_trace.json").read_text())
    assert any(e.get("name") == "mist.host_adamw" for e in trace["traceEvents"])
    expected = _synchronous_weights(0, offload, 1)
    for name, value in expected.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=0)


@pytest.mark.exclusive  # asserts that threads overlapped
def test_offloaded_gradients_are_added_on_host_threads_during_the_backward():
    offload = Offload(grads=0.5)
    prof, weights = _profile(2, offload, 2)
    products = _intervals(prof, "aten::mm") + _intervals(prof, "aten::addmm")
    compute_threads = {thread for thread, _, _ in products}
    last_product = max(start for _, start, _ in products)  # the second micro-batch's backward, first layer
    additions = _intervals(prof, "mist.host_grad_accumulate")
    assert additions and all(thread not in compute_threads for thread, _, _ in additions)
    # added while the backward went on: before its last product, beside the main thread's own ops (a
    # layer's gradient is added between its products and the next layer's, so requiring overlap with a
    # product itself measured the OS scheduler, not the runtime)
    main_ops = [(event.thread, event.time_range.start, event.time_range.end) for event in prof.events()
                if event.name.startswith("aten::") and event.thread in compute_threads]
    during = [a for a in additions if a[2] < last_product]
    assert during, "every offloaded-gradient addition waited for the backward to end"
    assert _overlapping(during, main_ops), "the main thread stood still while the gradients were added"
    expected = _synchronous_weights(2, offload, 2)
    for name, value in expected.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=0)


def test_cost_model_prices_the_host_adamw_as_overlapping_the_device():
    import numpy as np

    from mist_compiler.cost.state_traffic import optimizer_phase_s

    # host-bound: the host update plus one unit's copy out and back (the units pipeline)
    assert optimizer_phase_s(np.array([0.1]), np.array([1.0]), np.array([0.4]), np.array([0.2]), np.array([6]))[0] \
        == 1.0 + 0.6 / 6
    # device-bound: the device part and the copies hide the host threads
    assert optimizer_phase_s(np.array([2.0]), np.array([1.0]), np.array([0.4]), np.array([0.2]), np.array([6]))[0] == 2.0
    # nothing offloaded: the device part alone
    assert optimizer_phase_s(np.array([0.3]), np.array([0.0]), np.array([0.0]), np.array([0.0]), np.array([6]))[0] == 0.3


def test_cost_model_prices_what_offloaded_gradients_move():
    """The fp32 accumulator's host fraction leaves every micro-batch under ZeRO 2-3 (all but the last
    under ZeRO 0-1, whose last micro-batch folds it back) and comes back on every micro-batch that adds
    into it; before the step, the device optimizer reads back what it updates of the host tail."""
    import numpy as np

    from mist_compiler.cost.state_traffic import offloaded_grad_bytes, step_grads_to_device

    params, zero, dp = np.array([100.0] * 4), np.array([2, 2, 0, 0]), np.array([2, 2, 2, 2])
    accum = np.array([1, 4, 1, 4])
    out, back = offloaded_grad_bytes(params, np.full(4, 0.5), zero, dp, accum)
    shard, full = 0.5 * 4.0 * 100.0 / 2, 0.5 * 4.0 * 100.0
    np.testing.assert_allclose(out, [shard, shard, 0.0, full * 3 / 4])
    np.testing.assert_allclose(back, [0.0, shard * 3 / 4, 0.0, full * 3 / 4])
    assert not offloaded_grad_bytes(params, np.zeros(4), zero, dp, accum)[0].any()
    np.testing.assert_allclose(step_grads_to_device(np.array([0.5, 0.5, 0.25, 0.5]), np.array([0.0, 0.25, 0.5, 0.0]),
                                                    np.array([2, 3, 2, 1])), [0.5, 0.25, 0.0, 0.0])


def test_adding_into_host_memory_through_a_bounded_device_buffer():
    """The GPU path of an accumulating offload write (``Streams.add_to_host_async``) adds piece by piece
    through one buffer; run here on the CPU, every piece boundary must give the plain sum."""
    from mist_compiler.runtime.streams import add_through

    for numel, piece in ((10, 3), (9, 3), (5, 8), (1, 1)):
        dst, src = torch.arange(numel, dtype=torch.float32), torch.randn(numel, dtype=torch.bfloat16)
        expected = dst + src.float()
        add_through(dst, src, piece)
        torch.testing.assert_close(dst, expected, rtol=0, atol=0)
