"""How well does the cost model predict real runs? Predicted vs measured step time and peak memory.

Runs each configuration for real on this machine and prints, per configuration, the predicted
and measured step time (forward + backward + AdamW step) and peak memory of live tensors, each
error, and the Kendall tau between predicted and measured step times.

Configurations are a list of dataclasses, each with a ``kind``; ``RUNNERS[kind]`` measures one
and ``PREDICTORS[kind]`` predicts it, so multi-rank kinds (pipeline / data / tensor parallel
through the backend) can be added as new kinds. Today there is one kind, ``single``: one
process, one pipeline stage holding the whole model, float32 AdamW, ``torch.utils.checkpoint``
on the first ``ckpt_layers`` blocks, torch limited to one thread (one core is one device of
the ``cpu`` hardware profile, which ``mistc profile`` measured the same way).

Measurement:
- peak memory: ``torch.distributed._tools.mem_tracker.MemTracker`` over forward + backward,
  with parameters, gradients (kept allocated, as gradient accumulation does: ``zero_grad(
  set_to_none=False)``) and optimizer states tracked; the step's own temporaries are outside
  that window. On a GPU the same runner would read ``torch.cuda.max_memory_allocated``.
- step time: this process's CPU time for one step (one thread, so CPU time is the time the
  step ran; on the shared 2-core machine wall time also counts the other jobs), after a warm-up,
  in interleaved rounds over all the configurations, keeping each configuration's best round.
Calibration: the profile's compute rates (peak, per-class efficiencies, memory bandwidth, op
overhead) are re-measured once at start with ``mistc profile``'s micro-benchmarks and formulas,
on the same CPU clock (``--no-calibrate`` keeps the shipped numbers).
Prediction: ``build_stage_cost_model`` for the same model on that profile, one stage with
every block, ``dp = tp = 1``, ZeRO 0, no offload, one micro-batch in flight; step time is
``pipeline_iteration_time(stable, delta, 1)``. No per-configuration adjustment.

Usage: ``PYTHONPATH=. python benchmarks/prediction_accuracy.py [--quick] [--hardware cpu]``

Last full run (2026-11-21, the shared 2-core CPU machine, 16 configurations, ~10 min): step time
mean |error| 10.1% (max 22.1%, all but one under-predicted: per-node autograd overhead is not
modelled), Kendall tau 0.942; peak memory mean |error| 0.00%, max 0.04%.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from mist_compiler.cost.hardware import HardwareProfile, load_profile
from mist_compiler.cost.stage_api import StageCandidates, pipeline_iteration_time
from mist_compiler.cost.stage_model import TORCH_ADAMW_BYTES_PER_PARAM, StageCostModel
from mist_compiler.models import TransformerConfig, TransformerLM, zoo_config

CUSTOM_MODELS: dict[str, TransformerConfig] = {
    "gpt-wide": TransformerConfig(hidden=512, ffn=2048, layers=3, heads=8, vocab=8192, max_seq=512, family="gpt"),
    "llama-deep": TransformerConfig(hidden=256, ffn=688, layers=8, heads=4, vocab=8192, max_seq=256, norm="rmsnorm",
                                    activation="swiglu", positions="rotary", family="llama"),
}


def gpt_wide() -> TransformerLM:
    """Factory for ``mist_compiler.capture("benchmarks.prediction_accuracy:gpt_wide")``."""
    return TransformerLM(CUSTOM_MODELS["gpt-wide"])


def llama_deep() -> TransformerLM:
    return TransformerLM(CUSTOM_MODELS["llama-deep"])


FACTORIES = {"gpt-wide": "benchmarks.prediction_accuracy:gpt_wide", "llama-deep": "benchmarks.prediction_accuracy:llama_deep"}


def model_config(name: str, seq_len: int) -> TransformerConfig:
    if name in CUSTOM_MODELS:
        return replace(CUSTOM_MODELS[name], max_seq=max(seq_len, CUSTOM_MODELS[name].max_seq))
    return zoo_config(name, seq_len)


@dataclass(frozen=True)
class SingleProcessConfig:
    """One process, one stage with the whole model."""

    model: str
    micro_batch: int
    seq_len: int
    ckpt_layers: int = 0
    attention: str = "flash"  # "math": SDPA's math backend (keeps the s x s probabilities)
    kind: str = "single"

    @property
    def label(self) -> str:
        ckpt = f" ckpt{self.ckpt_layers}" if self.ckpt_layers else ""
        math = " math" if self.attention == "math" else ""
        return f"{self.model} b{self.micro_batch} s{self.seq_len}{ckpt}{math}"


@dataclass
class Outcome:
    step_s: float
    peak_bytes: float


CONFIGS: list[SingleProcessConfig] = [
    SingleProcessConfig("gpt-small", 2, 256),
    SingleProcessConfig("gpt-small", 4, 256),
    SingleProcessConfig("gpt-small", 8, 128),
    SingleProcessConfig("gpt-small", 4, 256, ckpt_layers=2),
    SingleProcessConfig("gpt-small", 8, 256, ckpt_layers=4),
    SingleProcessConfig("gpt-small", 1, 64),
    SingleProcessConfig("llama-small", 2, 256),
    SingleProcessConfig("llama-small", 4, 256, ckpt_layers=2),
    SingleProcessConfig("llama-small", 8, 128),
    SingleProcessConfig("gpt-wide", 2, 512),
    SingleProcessConfig("gpt-wide", 4, 256, ckpt_layers=3),
    SingleProcessConfig("llama-deep", 4, 256),
    SingleProcessConfig("llama-deep", 8, 256, ckpt_layers=4),
    SingleProcessConfig("llama-deep", 2, 128),
    SingleProcessConfig("gpt-small", 2, 256, attention="math"),
    SingleProcessConfig("llama-small", 2, 128, ckpt_layers=2, attention="math"),
]
QUICK = [CONFIGS[0], CONFIGS[3], CONFIGS[6], CONFIGS[14]]


class CheckpointedBlock(nn.Module):
    """Runs a block under non-reentrant activation checkpointing (keeps only its input)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


def build(config: SingleProcessConfig) -> nn.Module:
    torch.manual_seed(0)
    model = TransformerLM(model_config(config.model, config.seq_len))
    for index in range(config.ckpt_layers):
        model.blocks[index] = CheckpointedBlock(model.blocks[index])
    return model


def measure_single(config: SingleProcessConfig, timed_steps: int, measure_memory: bool) -> Outcome:
    """Best of ``timed_steps`` steps after a warm-up, and (if asked) the peak of live tensors."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model = build(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = model.config.vocab
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (config.micro_batch, config.seq_len), generator=generator)
    labels = torch.randint(0, vocab, (config.micro_batch, config.seq_len), generator=generator)

    def forward_backward() -> None:
        with sdpa_kernel(SDPBackend.MATH if config.attention == "math" else SDPBackend.FLASH_ATTENTION):
            model(input_ids=ids, labels=labels).backward()

    def step() -> None:
        optimizer.zero_grad(set_to_none=False)
        forward_backward()
        optimizer.step()

    step()  # warm-up: allocates gradients and optimizer states
    best = float("inf")
    for _ in range(timed_steps):
        start = time.process_time()
        step()
        best = min(best, time.process_time() - start)
    peak = float("nan")
    if measure_memory:
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        optimizer.zero_grad(set_to_none=False)
        with tracker:
            forward_backward()
        peak = float(sum(stats["Total"] for stats in tracker.get_tracker_snapshot("peak").values()))
    return Outcome(best, peak)


def cpu_seconds_per_call(fn: Callable[[], object], target_s: float = 0.15, repeats: int = 3) -> float:
    """Best per-call *CPU* seconds of ``fn`` (this process's own clock: other work on the shared
    machine does not count, unlike wall time)."""
    fn()
    start = time.process_time()
    fn()
    once = max(time.process_time() - start, 1e-6)
    calls = max(1, int(target_s / once))
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.process_time() - start) / calls)
    return best


def calibrated_profile(name: str) -> HardwareProfile:
    """The named profile with its compute rates re-measured now, on the CPU clock.

    The same micro-benchmarks and efficiency formulas as ``mistc profile``
    (``profiler.measure_compute`` / ``_efficiencies``, CPU sizes), timed with this process's CPU
    time so that other work on the shared machine does not distort them; links and copies stay
    as shipped.
    """
    from mist_compiler.cost.profiler import ComputeMeasurements, _efficiencies

    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    peak = 2 * n**3 / cpu_seconds_per_call(lambda: a @ b)
    x, w = torch.randn(1024, 512), torch.randn(512, 2048)
    model_rate = 2 * 1024 * 512 * 2048 / cpu_seconds_per_call(lambda: x @ w)
    q, k, v = (torch.randn(1, 4, 256, 64, requires_grad=True) for _ in range(3))
    attention_rate = 3 * 4 * 4 * 256 * 256 * 64 / cpu_seconds_per_call(
        lambda: F.scaled_dot_product_attention(q, k, v).sum().backward())
    numel = 4 << 20
    src, other, dst = torch.randn(numel), torch.randn(numel), torch.empty(numel)
    nbytes = 4 * numel
    copy_rate = 2 * nbytes / cpu_seconds_per_call(lambda: dst.copy_(src))
    add_rate = 3 * nbytes / cpu_seconds_per_call(lambda: torch.add(src, other, out=dst))
    rows = src.view(-1, 1024)
    sums = torch.empty(rows.shape[0])
    reduce_rate = nbytes / cpu_seconds_per_call(lambda: torch.sum(rows, dim=1, out=sums))
    norm_rate = 2 * nbytes / cpu_seconds_per_call(lambda: F.layer_norm(rows, (1024,)))
    softmax_rate = 2 * nbytes / cpu_seconds_per_call(lambda: torch.softmax(rows, dim=1))
    tiny, tiny_out = torch.ones(1), torch.empty(1)
    overhead = cpu_seconds_per_call(lambda: torch.add(tiny, tiny, out=tiny_out))
    base = load_profile(name)
    measured = ComputeMeasurements({"float32": peak}, model_rate, attention_rate, copy_rate, add_rate, reduce_rate,
                                   base.h2d_bandwidth, base.d2h_bandwidth, "float32", norm_rate, softmax_rate, overhead)
    peaks = {**base.peak_flops, "float32": peak}
    return dataclasses.replace(base, peak_flops=peaks, efficiency=_efficiencies(measured, peaks),
                               memory_bandwidth=copy_rate, op_overhead=overhead)


@lru_cache(maxsize=None)
def _analysed(model_name: str):
    from mist_compiler import capture
    from mist_compiler.cost.analysis import analyse_program

    program = capture(FACTORIES.get(model_name, model_name), dtype="float32")  # b and s stay symbolic
    return analyse_program(program)


def predict_single(config: SingleProcessConfig, hardware: HardwareProfile) -> Outcome:
    blocks, num_layers = _analysed(config.model)
    # the runner steps torch.optim.AdamW (single-tensor loop on CPU), not a fused kernel
    model = StageCostModel(blocks, hardware, config.seq_len, "float32", config.attention, config.model, num_layers,
                           optimizer_bytes_per_param=TORCH_ADAMW_BYTES_PER_PARAM)
    candidate = StageCandidates(
        num_layers=num_layers, has_pre=True, has_post=True, nodes=1, gpus_per_node=1, micro_batch=config.micro_batch,
        dp=1, tp=1, zero=0, ckpt_layers=config.ckpt_layers, offload_weights=0.0, offload_grads=0.0, offload_opt=0.0,
        offload_acts=0.0, inflight=1)
    estimate = model.evaluate(candidate)
    step = pipeline_iteration_time(estimate.stable_s, estimate.delta_s, 1)
    return Outcome(step, float(estimate.peak_memory_bytes[0]))


RUNNERS: dict[str, Callable[..., Outcome]] = {"single": measure_single}
PREDICTORS: dict[str, Callable[..., Outcome]] = {"single": predict_single}


def kendall_tau(xs: list[float], ys: list[float]) -> float:
    concordant = discordant = 0
    for i in range(len(xs)):
        for j in range(i + 1, len(xs)):
            sign = (xs[i] - xs[j]) * (ys[i] - ys[j])
            concordant += sign > 0
            discordant += sign < 0
    pairs = len(xs) * (len(xs) - 1) / 2
    return (concordant - discordant) / pairs if pairs else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{len(QUICK)} configurations, 2 rounds")
    parser.add_argument("--hardware", default="cpu", help="hardware profile of this machine")
    parser.add_argument("--no-calibrate", action="store_true",
                        help="use the shipped profile as is (default: re-measure its compute rates first)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 3, quick 2)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    configs = QUICK if args.quick else CONFIGS
    rounds = args.rounds or (2 if args.quick else 3)
    profile = load_profile(args.hardware) if args.no_calibrate else calibrated_profile(args.hardware)
    print(f"profile {profile.name}: fp32 peak {profile.peak_flops['float32'] / 1e9:.1f} GFLOP/s, "
          f"memory {profile.memory_bandwidth / 1e9:.2f} GB/s, op overhead {profile.op_overhead * 1e6:.1f} us, "
          f"efficiencies {profile.efficiency}")
    predicted = [PREDICTORS[config.kind](config, profile) for config in configs]
    best = [float("inf")] * len(configs)
    peaks = [float("nan")] * len(configs)
    for round_index in range(rounds):  # interleaved: a burst of load on the shared machine hits every config alike
        for index, config in enumerate(configs):
            outcome = RUNNERS[config.kind](config, 1, measure_memory=round_index == 0)
            best[index] = min(best[index], outcome.step_s)
            if round_index == 0:
                peaks[index] = outcome.peak_bytes
        print(f"round {round_index + 1}/{rounds} done", flush=True)
    print(f"\n{'configuration':<30} {'pred s':>7} {'meas s':>7} {'err':>7}  {'pred MB':>8} {'meas MB':>8} {'err':>7}")
    for config, prediction, step_s, peak in zip(configs, predicted, best, peaks):
        print(f"{config.label:<30} {prediction.step_s:>7.3f} {step_s:>7.3f} {prediction.step_s / step_s - 1:>+7.1%}  "
              f"{prediction.peak_bytes / 1e6:>8.2f} {peak / 1e6:>8.2f} {prediction.peak_bytes / peak - 1:>+7.2%}")
    predicted_times = [p.step_s for p in predicted]
    time_errors = [abs(p / m - 1) for p, m in zip(predicted_times, best)]
    memory_errors = [abs(p.peak_bytes / m - 1) for p, m in zip(predicted, peaks)]
    print(f"\nstep time: mean |error| {statistics.mean(time_errors):.1%}, max {max(time_errors):.1%}; "
          f"Kendall tau {kendall_tau(predicted_times, best):.3f} over {len(configs)} configurations")
    print(f"peak memory: mean |error| {statistics.mean(memory_errors):.2%}, max {max(memory_errors):.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
