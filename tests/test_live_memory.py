"""The live-memory probe (``profiling.live_memory``) on CPU, and the backend's measured peaks against ``analyze``.

The probe is what ``benchmarks/prediction_accuracy.py`` compares the cost model with, so it is
checked on exact byte counts; the distributed test is a small end-to-end version of that benchmark.
"""
from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
from dist_utils import run_ranks

from mist_compiler.ir.plan import ActivationPolicy, Offload, Plan, StagePlan
from mist_compiler.profiling.live_memory import DevicePeakMemory
from mist_compiler.runtime.streams import host_empty


def test_counts_storages_frees_and_peaks():
    with DevicePeakMemory() as probe:
        a = torch.empty(1000)
        b = a * 2
        view = b[10:20]  # a view shares its base's storage
        assert probe.current_bytes == 8000
        del b
        assert probe.current_bytes == 8000  # the view keeps the storage alive
        del view
        assert probe.current_bytes == 4000
        assert probe.peak_bytes == 8000
        probe.reset_peak()
        assert probe.peak_bytes == 4000
        del a


def test_resized_storages_and_host_buffers():
    with DevicePeakMemory() as probe:
        flat = torch.zeros(1000)
        flat.untyped_storage().resize_(0)  # a flat buffer freed in place, as the runtime does
        assert probe.current_bytes == 0
        flat.untyped_storage().resize_(8000)
        assert probe.current_bytes == 8000
        host = host_empty(10_000, torch.float32).zero_()  # the runtime's host memory is not device memory
        assert probe.current_bytes == 8000
        del host, flat
    assert torch.UntypedStorage.resize_ is not None  # the wrapper is gone again
    with pytest.raises(ValueError, match="device"):
        DevicePeakMemory("meta")


def test_tensors_from_before_count_once_touched():
    early = torch.ones(250)
    with DevicePeakMemory() as probe:
        assert probe.current_bytes == 0
        probe.track(early)
        assert probe.current_bytes == 1000
        early.add_(1)
        assert probe.current_bytes == 1000


def test_backward_is_seen():
    weight = torch.randn(64, 64, requires_grad=True)
    with DevicePeakMemory() as probe:
        probe.track(weight)
        (weight @ weight).sum().backward()
        # the weight, its gradient, and at the peak the product and a gradient-side temporary
        assert probe.current_bytes >= 2 * 64 * 64 * 4
        assert probe.peak_bytes >= 3 * 64 * 64 * 4


def _peak_rank(rank: int, world: int, plan: Plan) -> float:
    from mist_compiler.models import build_model
    from mist_compiler import compile as compile_plan
    from mist_compiler.verify.check import synthetic_batch
    from mist_compiler.verify.check import vocab_size as model_vocab

    with DevicePeakMemory() as probe:
        model = build_model(plan.model, seq_len=plan.seq_len)
        engine = compile_plan(model, plan, timeout_s=60.0)
        vocab = model_vocab(model)
        del model
        gc.collect()
        batches = [synthetic_batch(vocab, plan.global_batch, plan.seq_len, step) for step in range(2)]
        engine.step(batches[0])
        probe.reset_peak()
        engine.step(batches[1])
        peak = float(probe.peak_bytes)
    engine.close()
    return peak


def _plan(stages: list[dict], grad_accum: int = 1, global_batch: int = 8, dtype: str = "float32",
          model: str = "gpt-small", schedule: str = "1f1b", virtual: int = 1) -> Plan:
    built, start = [], 0
    for stage in stages:
        dp, tp = stage.get("dp", 1), stage.get("tp", 1)
        built.append(StagePlan(layers=(start, start + stage["layers"]), nodes=1, gpus_per_node=dp * tp, dp=dp, tp=tp,
                               micro_batch=global_batch // (dp * grad_accum), zero=stage.get("zero", 0),
                               ckpt_layers=stage.get("ckpt", 0), offload=stage.get("offload", Offload()),
                               sp=stage.get("sp", False),
                               activations=ActivationPolicy.from_dict(stage["activations"], "activations")
                               if "activations" in stage else None))
        start += stage["layers"]
    # the suite runs units eagerly (MIST_COMPILE=0): the plan says so, so that it is priced as it runs
    return Plan(model, 128, global_batch, dtype, grad_accum, tuple(built), compiled=False, schedule=schedule,
                virtual_stages=virtual)


@pytest.mark.distributed
@pytest.mark.parametrize("plan", [
    _plan([{"layers": 4, "dp": 2, "zero": 3, "ckpt": 2}]),
    _plan([{"layers": 4, "dp": 2, "zero": 2, "offload": Offload(grads=0.5, opt=0.5, acts=0.5)}], grad_accum=2),
    _plan([{"layers": 2, "ckpt": 1}, {"layers": 2}], grad_accum=4),
    _plan([{"layers": 4, "tp": 2, "ckpt": 2}]),
    _plan([{"layers": 4, "tp": 2, "sp": True}]),  # sequence parallelism: layers' norms and residuals on chunks
    # mixed precision, accumulating: the first micro-batch's fp32 copy becomes the accumulator (not copied)
    _plan([{"layers": 2}, {"layers": 2}], grad_accum=2, dtype="bfloat16"),
    # 4 ranks: in the first stage the next backward's first unit finishes while the previous backward's
    # token-embedding reduce-scatter may still run; the runtime finishes it before launching the next
    _plan([{"layers": 2, "dp": 2, "zero": 2}, {"layers": 2, "dp": 2, "zero": 2}], grad_accum=2, dtype="bfloat16"),
    # schedules (cost/schedule_memory.py): two chunks per rank, and weight halves keeping their stash
    _plan([{"layers": 1}] * 4, grad_accum=4, schedule="interleaved", virtual=2),
    _plan([{"layers": 2}, {"layers": 2}], grad_accum=4, schedule="zb-h1"),
    # a W action holds a layer's gradients twice (the weight half's outputs beside their bucket): rank 1's
    # chunks are layers only (was 7% under before that was priced)
    _plan([{"layers": 1}] * 4, grad_accum=4, model="llama-small", schedule="zbv", virtual=2),
    # a head tied to the embedding: the post block's unit gathers the embedding's, autograd holds the head's
    # gradient part until the embedding's backward adds to it; a pipeline's last stage keeps a plain copy
    _plan([{"layers": 4, "dp": 2, "zero": 3, "ckpt": 2}], model="stage_runtime_cases:gpt_small_tied"),
    _plan([{"layers": 2}, {"layers": 2}], grad_accum=4, model="stage_runtime_cases:gpt_small_tied"),
], ids=["zero3-ckpt", "zero2-offload-accumulate", "pipeline", "tp2-ckpt", "tp2-sp", "pipeline-bf16-accumulate",
        "pipeline-dp2-zero2-bf16", "interleaved", "zb-h1", "zbv", "tied-zero3-ckpt", "tied-pipeline"])
def test_backend_peak_matches_the_memory_model(plan):
    _assert_peaks_match(plan)


@pytest.mark.heavy
@pytest.mark.distributed
@pytest.mark.parametrize("plan", [
    _plan([{"layers": 4, "dp": 2, "zero": 3, "ckpt": 2}]),
    _plan([{"layers": 2}, {"layers": 2}], grad_accum=4),  # the first stage's layers see the head's gradients
    _plan([{"layers": 4, "tp": 2, "sp": True}]),  # the re-gathered sequence: not kept by a compiled unit either
    # fused RMSNorm and SwiGLU on sequence chunks: what the compiled partition keeps, split along the sequence
    _plan([{"layers": 4, "tp": 2, "sp": True}], model="llama-small"),
    # a per-tensor policy (replay the layer from its input, offloaded): its units run eagerly, priced so
    _plan([{"layers": 4, "activations": {"recompute": ["layer_norm", "linear", "linear_1", "linear_2", "y", "linear_3",
                                                      "x_2", "layer_norm_1", "linear_4", "gelu"],
                                         "offload": {"x_1_in": 1.0}}}]),
], ids=["zero3-ckpt", "pipeline", "tp2-sp", "llama-tp2-sp", "per-tensor"])
def test_compiled_peak_matches_the_memory_model(plan, monkeypatch):
    """Units compiled by inductor (compiled inside the measuring tracker: it must not change them), priced
    as compiled units: each one's backward is one autograd node returning its gradients together."""
    monkeypatch.setenv("MIST_COMPILE", "1")  # the spawned ranks inherit it
    _assert_peaks_match(dataclasses.replace(plan, compiled=True))


def _assert_peaks_match(plan: Plan) -> None:
    from mist_compiler import analyze
    from mist_compiler.cost.hardware import load_profile
    from mist_compiler.ir.topology import Topology

    peaks = run_ranks(_peak_rank, world=plan.world_size, args=(plan,), timeout_s=240)
    estimate = analyze(plan.model, plan, load_profile("cpu"))  # the program that runs: head and loss fused
    topology = Topology(plan)
    for rank, measured in enumerate(peaks):
        predicted = estimate.stages[topology.coord(rank).stage].peak_memory_mb * 1e6
        print(f"rank {rank}: predicted {predicted / 1e6:.2f} MB, measured {measured / 1e6:.2f} MB")
        assert abs(predicted / measured - 1) < 0.03, (rank, predicted, measured)


def test_activation_offload_moves_each_storage_once_and_counts_activations_only():
    from mist_compiler.runtime.offload import ActivationOffloader, HostMemory
    from mist_compiler.runtime.streams import Streams

    weight = torch.randn(256, 256, requires_grad=True)
    x = torch.randn(256, 256, requires_grad=True)
    host = HostMemory()
    offloader = ActivationOffloader(1.0, Streams(torch.device("cpu")), host, lambda: {weight.untyped_storage().data_ptr()})
    with offloader.context("unit"):
        hidden = torch.tanh(x)
        out = (hidden * hidden) @ weight  # ``hidden`` saved twice by mul, the weight by the matmul
    # tanh's output and the product: each storage moved once, the weight never
    assert offloader.offloaded_bytes == 2 * 256 * 256 * 4
    assert host.bytes_by_kind()["acts"] == 2 * 256 * 256 * 4
    offloader.prefetch("unit")
    out.sum().backward()  # both saved slots of ``hidden`` unpack from one host copy
    x_ref = x.detach().clone().requires_grad_(True)
    hidden_ref = torch.tanh(x_ref)
    ((hidden_ref * hidden_ref) @ weight.detach()).sum().backward()
    assert torch.allclose(x.grad, x_ref.grad)
