"""How well does the cost model predict real runs? Predicted vs measured step time and peak memory.

Runs each configuration for real on this machine and prints, per configuration, the predicted
and measured step time (forward + backward + AdamW step) and peak memory of live tensors, each
error, and the Kendall tau between predicted and measured step times (per group and overall).

Configurations (``accuracy_configs.py``) are dataclasses with a ``kind``; ``RUNNERS[kind]`` measures one and
``PREDICTORS[kind]`` predicts it (one kind today, ``plan``): a plan trained through the backend
(``mist_compiler.compile``) on 1, 2 or 4 local gloo ranks, torch limited to one thread per rank
(one core is one device of the ``cpu`` profile). One rank: a stage with the whole model, batch,
sequence, checkpointing and attention kernel varied. Two and four ranks: data parallelism at every
ZeRO level, checkpointing, each offload kind, 1F1B pipelines. Mixed precision (fp16/bf16 with
fp32 master weights, with and without low-precision gradients) and tensor parallelism are
compared on peak memory (fp16/bf16 step times on a CPU say nothing of a GPU's; the compute rates
are calibrated in fp32); tensor-parallel plans are summarised as their own group (their loss is
not yet the one the cost model prices: ``accuracy_configs.TP_CONFIGS``). ``--memory-only``: one
round, no timing, no calibration (a few minutes).

- Peak memory: ``profiling.live_memory.DevicePeakMemory`` (every storage an op creates or touches,
  resized flat buffers re-read, the runtime's host buffers left out; CUDA memory statistics on a
  GPU) over one whole training step after a warm-up step, per rank; the model is built on the host
  and dropped after ``compile``, as a GPU run would. Reported per pipeline stage, the largest over
  its ranks; the stage furthest from its prediction is printed.
- Step time: one rank: its CPU time (nothing to wait for; the other jobs on the shared machine do
  not count); several ranks: wall clock of the slowest rank. Median of the timed steps of a round.

Interleaved rounds over all configurations (a burst of load hits every configuration alike).
Calibration (``--no-calibrate`` keeps the shipped profile): right before each run, in the run's
own rank processes and all ranks at once, the profile's compute rates (matmul, attention, memory,
per-op overhead, the backend's AdamW step) are re-measured with ``mistc profile``'s
micro-benchmarks on the CPU clock, averaged over the ranks, and that run is predicted with that
profile: this CPU's speed drifts by 10-25% within minutes (other tenants, clocks), so a
calibration taken at another moment than its run mostly measures the drift; and ranks on one
machine share its caches and memory bandwidth, so a device's rates are the ones it gets while
the other devices run. A configuration's
error is the geometric mean over rounds of predicted/measured, its printed times the geometric
means. The collectives are measured once over 1x2 and 1x4 gloo groups and the slowdowns of
channels running together with as many ranks as the plan has. No per-configuration adjustment.
More ranks than cores (4 ranks on this 2-core machine): a rank that waits in a pipeline bubble
hands its core to the others, which then run faster than their even share, so a device model of
half a core per rank over-prices every bubble. Such a plan is priced with a core per rank, and its
step is the larger of that simulated iteration and the ranks' total busy time (the iteration less
each rank's bubble, summed over ranks) spread over the cores: the cores share the work as a fluid
processor-sharing queue would (:func:`shared_core_step`; the even-share figure is printed too).
On a machine with a core per rank, as with one device per rank, neither arises.
Prediction: ``mist_compiler.cost.analyze.analyze`` of the plan.

Schedules (``--schedules``, ``accuracy_configs.SCHEDULE_CONFIGS``): interleaved 1F1B, ZB-H1 and ZB-V plans
on 4 ranks (two stages of two data-parallel ranks), each with its 1F1B twin, predicted by
simulating their action lists.

Hugging Face models (``--hf``, ``accuracy_configs.HF_CONFIGS``): transformers' own GPT-2 (with its
dropout) and Llama (grouped-query attention), built from configs, on 1, 2 and 4 ranks.

Usage: ``PYTHONPATH=. python benchmarks/prediction_accuracy.py [--quick] [--ranks 1|2|4] [--compiled] [--schedules]
[--hf]`` (``--compiled``: every plan runs and is priced as compiled units)

Last full run: see the closing note of issue 3 (figures are quoted as measured there, with the
command above).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from mist_compiler.cost.hardware import HardwareProfile, load_profile
from mist_compiler.cost.stage_model import StageCostModel
from mist_compiler.runtime.host_allocator import keep_freed_host_memory

try:  # run as a script (benchmarks/ on the path) or imported as benchmarks.prediction_accuracy
    from benchmarks.accuracy_configs import (  # noqa: F401
        CONFIGS,
        FACTORIES,
        HF_CONFIGS,
        ONE_RANK_CONFIGS,
        PLAN_CONFIGS,
        PRECISION_CONFIGS,
        SCHEDULE_CONFIGS,
        QUICK,
        TP_CONFIGS,
        PlanConfig,
        StageSpec,
        _stages,
        one_rank,
    )
except ImportError:
    from accuracy_configs import (  # noqa: F401
        CONFIGS,
        FACTORIES,
        HF_CONFIGS,
        ONE_RANK_CONFIGS,
        PLAN_CONFIGS,
        PRECISION_CONFIGS,
        SCHEDULE_CONFIGS,
        QUICK,
        TP_CONFIGS,
        PlanConfig,
        StageSpec,
        _stages,
        one_rank,
    )

@dataclass
class Outcome:
    step_s: float
    peak_bytes: float
    stage_peaks: list[float] | None = None  # multi-stage plans: peak per pipeline stage
    calibration: HardwareProfile | None = None  # compute rates measured by the run's ranks right before it


def cpu_seconds_per_call(fn: Callable[[], object], target_s: float = 0.15, repeats: int = 5) -> float:
    """Median per-call *CPU* seconds of ``fn`` over ``repeats`` batches of about ``target_s`` each
    (this process's own clock: other work on the shared machine does not count, unlike wall time).

    The median, as for the step times it is compared with: this CPU's speed swings within seconds,
    and the best of short batches catches faster moments than the best of one-second steps would.
    """
    fn()
    start = time.process_time()
    fn()
    once = max(time.process_time() - start, 1e-6)
    calls = max(1, int(target_s / once))
    times = []
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(calls):
            fn()
        times.append((time.process_time() - start) / calls)
    return statistics.median(times)


def calibrated_profile(name: str, compiled: bool = False) -> HardwareProfile:
    """The named profile with its compute rates re-measured now, on the CPU clock.

    The same micro-benchmarks and efficiency formulas as ``mistc profile``
    (``profiler.measure_compute`` / ``_efficiencies``, CPU sizes), timed with this process's CPU
    time so that other work on the shared machine does not distort them; links and copies stay
    as shipped; GEMMs by shape (``mistc profile``'s CPU shapes, operands cycled through so that they
    come from memory, fitted to the profile's ``matmul_shape_model``). ``compiled``: the inductor-compiled layer chain too (``efficiency['fused']``, what
    compiled units' elementwise kernels run at; compiled once per process, cached on disk) and the
    compiled GELU/SiLU math beyond a memory pass (``compiled_pointwise_ns``).
    """
    from mist_compiler.cost import matmul_shapes
    from mist_compiler.profiling.compiled import fused_bytes_per_s, pointwise_extra_ns
    from mist_compiler.profiling.profiler import ComputeMeasurements, _best_gemm_as_peak, _efficiencies
    from mist_compiler.profiling.state_rates import adamw_params_per_s, stream_bytes_per_s

    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    peak = 2 * n**3 / cpu_seconds_per_call(lambda: a @ b)
    x, w = torch.randn(1024, 512), torch.randn(512, 2048)
    model_rate = 2 * 1024 * 512 * 2048 / cpu_seconds_per_call(lambda: x @ w)
    q, k, v = (torch.randn(1, 4, 256, 64, requires_grad=True) for _ in range(3))
    attention_rate = 3 * 4 * 4 * 256 * 256 * 64 / cpu_seconds_per_call(
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward())
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
    cpu_timer = lambda fn, sync, target: cpu_seconds_per_call(fn, target)  # noqa: E731
    adam_rate = adamw_params_per_s("cpu", 16 << 20, 0.15, timer=cpu_timer)
    stream_rate = stream_bytes_per_s("cpu", 256 << 20, 0.15, timer=cpu_timer)
    base = load_profile(name)
    fused_rate = (fused_bytes_per_s("cpu", "float32", 1024, 512, lambda fn: cpu_seconds_per_call(fn), lambda m: None)
                  if compiled else 0.0)
    pointwise = (pointwise_extra_ns("cpu", "float32", 512, 3072, lambda fn: cpu_seconds_per_call(fn), lambda m: None)
                 if compiled else {})
    # GEMMs by shape, operands cycled through as a model's GEMMs read them (cost.matmul_shapes)
    shapes = matmul_shapes.measure_shapes("cpu", "float32", peak, lambda fn: cpu_seconds_per_call(fn, 0.08),
                                          matmul_shapes.CPU_SHAPES, lambda line: None)
    peak, shapes = _best_gemm_as_peak(peak, model_rate, shapes, lambda line: None)  # as mistc profile's peak
    shape_model = matmul_shapes.fit_shape_model(shapes, peak, copy_rate, 4.0)
    measured = ComputeMeasurements({"float32": peak}, model_rate, attention_rate, copy_rate, add_rate, reduce_rate,
                                   base.h2d_bandwidth, base.d2h_bandwidth, "float32", norm_rate, softmax_rate, overhead,
                                   adam_rate, adam_rate, fused_bytes_per_s=fused_rate)
    peaks = {**base.peak_flops, "float32": peak}
    return dataclasses.replace(base, peak_flops=peaks, efficiency=_efficiencies(measured, peaks),
                               memory_bandwidth=copy_rate, op_overhead=overhead, optimizer_params_per_s=adam_rate,
                               host_optimizer_params_per_s=adam_rate, matmul_model=shape_model,
                               matmul_points=tuple(shapes), stream_bandwidth=stream_rate,
                               compiled_pointwise_ns=pointwise or base.compiled_pointwise_ns)


def mean_profile(profiles: list[HardwareProfile]) -> HardwareProfile:
    """The first profile with the compute rates ``calibrated_profile`` measures averaged over all
    (one calibration per rank of a run)."""
    def mean(values) -> float:
        return statistics.mean(float(v) for v in values)

    first = profiles[0]
    return dataclasses.replace(
        first,
        peak_flops={**first.peak_flops, "float32": mean(p.peak_flops["float32"] for p in profiles)},
        efficiency={key: mean(p.efficiency[key] for p in profiles) for key in first.efficiency},
        memory_bandwidth=mean(p.memory_bandwidth for p in profiles),
        op_overhead=mean(p.op_overhead for p in profiles),
        optimizer_params_per_s=mean(p.optimizer_params_per_s for p in profiles),
        host_optimizer_params_per_s=mean(p.host_optimizer_params_per_s for p in profiles),
        stream_bandwidth=mean(p.stream_bandwidth for p in profiles),
        compiled_pointwise_ns={op: mean(p.compiled_pointwise_ns.get(op, 0.0) for p in profiles)
                               for op in first.compiled_pointwise_ns})


def _compute_share_rank(rank: int, world: int, seconds: float) -> float:
    """One of ``world`` concurrent ranks: its matmul rate (wall clock) over ``seconds``."""
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    a @ b
    import torch.distributed as dist

    dist.barrier()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        calls += 1
    return calls / (time.perf_counter() - start)


def measured_compute_share(world: int, seconds: float = 2.0) -> float:
    """The fraction of a lone rank's compute rate each of ``world`` ranks got when all computed at
    once (wall clock; printed next to the share the predictions use, as a check)."""
    from mist_compiler.launch.local_ranks import run_ranks

    alone = run_ranks(_compute_share_rank, 1, args=(seconds,), timeout_s=120.0)[0]
    together = run_ranks(_compute_share_rank, world, args=(seconds,), timeout_s=120.0)
    return min(1.0, statistics.mean(together) / alone)


def compute_share(world: int) -> float:
    """Each rank's share of a core: one core per rank while they fit, else the cores shared evenly.
    (Measured shares on the shared machine swing from 0.5 to 0.9 for 2 ranks with the other jobs'
    load, so the predictions use the machine's shape, not a noisy reading.)"""
    cores = os.cpu_count() or 1
    return min(1.0, cores / world)


@dataclass
class LinkCalibration:
    """Collective fits over 1x2 and 1x4 gloo groups, and the concurrency slowdowns per rank count."""

    links: dict
    factors: dict
    slowdowns: dict[int, dict]


def measure_links(worlds: list[int], log: Callable[[str], None] = print) -> LinkCalibration:
    """``mistc profile``'s full (not --quick: quick gloo fits on this shared machine swing 10x)
    collective and slowdown measurements, the slowdowns with as many ranks as a plan has."""
    from mist_compiler.profiling.comm import fit_collectives, run_collective_group
    from mist_compiler.profiling.timing import ProfilerOptions

    options = ProfilerOptions(quick=False, device="cpu", log=lambda message: None)
    results = {world: run_collective_group(world, "cpu", options, measure_concurrency=world in worlds, timeout_s=300.0)
               for world in sorted(set(worlds) | {2, 4}) if world > 1}
    links, factors = fit_collectives(list(results.values()))
    log(f"collectives { {shape: round(float(fit['bandwidth_gbps']), 3) for shape, fit in links.items()} } GB/s")
    return LinkCalibration(links, factors, {world: results[world]["slowdown"] for world in worlds})


def multi_rank_profile(base: HardwareProfile, world: int, calibration: LinkCalibration,
                       share: float | None = None) -> HardwareProfile:
    """``base`` (compute rates of one rank alone) with the measured collectives and slowdowns, its
    compute rates scaled by ``share`` of a core (default: the even share, 4 ranks on this 2-core
    machine: half)."""
    per_node = max(int(shape.split("x")[1]) for shape in calibration.links)
    fitted = HardwareProfile.from_dict({**base.to_dict(), "gpus_per_node": per_node,
                                        "collectives": calibration.links, "collective_factor": calibration.factors,
                                        "slowdown": calibration.slowdowns[world]}, source="benchmark calibration")
    share = compute_share(world) if share is None else share
    return dataclasses.replace(fitted, peak_flops={k: v * share for k, v in fitted.peak_flops.items()},
                               memory_bandwidth=fitted.memory_bandwidth * share, op_overhead=fitted.op_overhead / share,
                               optimizer_params_per_s=fitted.optimizer_params_per_s * share,
                               host_optimizer_params_per_s=fitted.host_optimizer_params_per_s * share)


# The backend runs the captured graph, whose head and loss capture fuses (mist::linear_cross_entropy):
# the programs priced here are captured the same way.
RUNTIME_FUSES_LOSS = True


@lru_cache(maxsize=None)
def _analysed(model_name: str, dtype: str = "float32", compiled: bool = False):
    from mist_compiler import capture
    from mist_compiler.cost.analysis import analyse_program
    from mist_compiler.frontend.joint import loss_fusion

    with loss_fusion(RUNTIME_FUSES_LOSS):
        program = capture(FACTORIES.get(model_name, model_name), dtype=dtype)  # b and s stay symbolic
    return analyse_program(program, compiled=compiled)


PLAN_STEPS_PER_ROUND = 4  # timed steps per launch of a plan's ranks (after a warm-up step)


def _plan_rank(rank: int, world: int, config: PlanConfig, timed_steps: int, measure_memory: bool,
               calibrate: str | None) -> tuple[float, list[float], HardwareProfile | None]:
    """One rank trains ``config``'s plan: (peak device bytes of live tensors over one whole training
    step after a warm-up step, wall seconds of each of ``timed_steps`` further steps, and with
    ``calibrate`` (a profile name) that profile's compute rates as this rank measured them first,
    all ranks at once: ranks on one machine share its caches and memory bandwidth, so a rank's
    rates are measured while the others run too, as they will while training)."""
    import torch.distributed as dist

    from mist_compiler.models import build_model
    from mist_compiler.profiling.live_memory import DevicePeakMemory
    from mist_compiler import compile as compile_plan
    from mist_compiler.verify.check import synthetic_batch
    from mist_compiler.verify.check import vocab_size as model_vocab

    plan = config.plan()
    calibration = None
    if calibrate is not None:
        keep_freed_host_memory()  # as the engine will set it
        dist.barrier()
        calibration = calibrated_profile(calibrate, compiled=config.compiled)
    # one rank has nothing to wait for: its CPU clock is the step time and ignores the other jobs
    clock = time.process_time if world == 1 else time.perf_counter
    kernel = SDPBackend.MATH if config.attention == "math" else SDPBackend.FLASH_ATTENTION
    with contextlib.ExitStack() as stack:
        stack.enter_context(sdpa_kernel(kernel))
        probe = stack.enter_context(DevicePeakMemory("cpu")) if measure_memory else None
        model = build_model(FACTORIES.get(config.model, config.model), seq_len=plan.seq_len)
        engine = compile_plan(model, plan, timeout_s=120.0)
        vocab = model_vocab(model)
        del model  # the engine keeps this rank's stage only; the rest is cyclic garbage until collected
        gc.collect()
        batches = [synthetic_batch(vocab, plan.global_batch, plan.seq_len, step) for step in range(2)]
        engine.step(batches[0])  # warm-up: gradients, optimizer states, communication buffers exist from here on
        peak = float("nan")
        if probe is not None:
            probe.reset_peak()
            engine.step(batches[1])
            peak = float(probe.peak_bytes)
    times = []
    with sdpa_kernel(kernel):
        for step in range(timed_steps):
            dist.barrier()
            start = clock()
            engine.step(batches[step % 2])
            times.append(clock() - start)
    engine.close()
    return peak, times, calibration


def measure_plan(config: PlanConfig, timed_steps: int, measure_memory: bool, calibrate: str | None = None) -> Outcome:
    """Spawn the plan's ranks; step time is the slowest rank's, median over the timed steps; the
    peak is per stage, the largest over the stage's ranks (``Outcome.stage_peaks``); with
    ``calibrate``, the ranks' calibrations averaged (``Outcome.calibration``)."""
    from mist_compiler.ir.topology import Topology
    from mist_compiler.launch.local_ranks import run_ranks

    results = run_ranks(_plan_rank, config.world, args=(config, timed_steps, measure_memory, calibrate),
                        timeout_s=900.0, collective_timeout_s=300.0)
    step_s = (statistics.median(max(times[step] for _, times, _ in results) for step in range(timed_steps))
              if timed_steps else float("nan"))
    topology = Topology(config.plan())
    stage_peaks = [0.0] * config.pipeline_stages
    for rank, (peak, _, _) in enumerate(results):
        stage = topology.coord(rank).stage
        stage_peaks[stage] = max(stage_peaks[stage], peak)
    calibration = mean_profile([profile for _, _, profile in results]) if calibrate is not None else None
    return Outcome(step_s, max(stage_peaks), stage_peaks, calibration)


def _estimate(config: PlanConfig, hardware: HardwareProfile):
    from mist_compiler.cost.analyze import analyze

    blocks, num_layers = _analysed(config.model, config.dtype, config.compiled)
    cost_model = StageCostModel(blocks, hardware, config.seq_len, config.dtype, config.attention, config.model, num_layers,
                                compiled=config.compiled)
    plan = config.plan()
    return plan, analyze(None, plan, hardware, cost_model=cost_model, attention=config.attention)


def predict_plan(config: PlanConfig, hardware: HardwareProfile) -> Outcome:
    """``mist_compiler.analyze`` of the plan (the backend's flat-shard AdamW: the default optimizer
    traffic) with the plan's attention kernel."""
    plan, estimate = _estimate(config, hardware)
    peaks = [estimate.stages[plan.chunks(group)[0]].peak_memory_mb * 1e6 for group in range(plan.pp)]
    return Outcome(estimate.iteration_time_s, max(peaks), peaks)


def shared_core_step(config: PlanConfig, one_core: HardwareProfile, cores: int) -> float:
    """Step time of a plan whose ranks outnumber the cores: the plan priced with a core per rank
    (``one_core``), and its ranks' busy time (iteration less bubble, per group of ranks) shared by the
    cores; the larger of the two."""
    plan, estimate = _estimate(config, one_core)
    iteration = estimate.iteration_time_s
    firsts = [plan.chunks(group)[0] for group in range(plan.pp)]  # a group's devices and bubble, on its first chunk
    busy = sum(plan.stages[j].devices * (iteration - estimate.stages[j].bubble_s) for j in firsts)
    return max(iteration, busy / cores)


RUNNERS: dict[str, Callable[..., Outcome]] = {"plan": measure_plan}
PREDICTORS: dict[str, Callable[..., Outcome]] = {"plan": predict_plan}


def geometric_mean(values: list[float]) -> float:
    return math.exp(statistics.mean(math.log(value) for value in values))


def kendall_tau(xs: list[float], ys: list[float]) -> float:
    concordant = discordant = 0
    for i in range(len(xs)):
        for j in range(i + 1, len(xs)):
            sign = (xs[i] - xs[j]) * (ys[i] - ys[j])
            concordant += sign > 0
            discordant += sign < 0
    pairs = len(xs) * (len(xs) - 1) / 2
    return (concordant - discordant) / pairs if pairs else float("nan")


def _summary(name: str, rows: list[tuple]) -> None:
    """rows: (predicted s, measured s, predicted bytes, measured bytes) per configuration."""
    if not rows:
        return
    timed = [row for row in rows if math.isfinite(row[1])]
    time_errors = [abs(p / m - 1) for p, m, _, _ in timed] or [float("nan")]
    memory_errors = [abs(p / m - 1) for _, _, p, m in rows]
    tau = kendall_tau([r[0] for r in timed], [r[1] for r in timed])
    print(f"{name:<22} {len(rows):>3} configs ({len(timed)} timed) | step time mean |err| {statistics.mean(time_errors):6.1%} "
          f"max {max(time_errors):6.1%} tau {tau:6.3f} | peak memory mean |err| {statistics.mean(memory_errors):6.2%} "
          f"max {max(memory_errors):6.2%}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{len(QUICK)} configurations, 2 rounds")
    parser.add_argument("--ranks", type=int, choices=(1, 2, 4), help="only the plans on this many ranks")
    parser.add_argument("--tp", action="store_true", help="only the tensor-parallel plans")
    parser.add_argument("--schedules", action="store_true",
                        help="only the pipeline-schedule plans (interleaved, zero-bubble, each beside its 1F1B twin)")
    parser.add_argument("--hf", action="store_true", help="only the Hugging Face models' plans (GPT-2, Llama)")
    parser.add_argument("--hardware", default="cpu", help="hardware profile of this machine")
    parser.add_argument("--no-calibrate", action="store_true",
                        help="use the shipped profile as is (default: re-measure compute rates and collectives first)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 3, quick 2)")
    parser.add_argument("--memory-only", action="store_true", help="peak memory only: one round, no timing, no calibration")
    parser.add_argument("--compiled", action="store_true",
                        help="every plan runs its units compiled by inductor (the plan's 'compiled' key) and is priced so "
                             "(cost.compiled); the calibration times the compiled layer chain too")
    args = parser.parse_args(argv)
    if args.memory_only:
        args.rounds, args.no_calibrate = 1, True
    torch.set_num_threads(1)
    configs = [dataclasses.replace(c, compiled=args.compiled)
               for c in (QUICK if args.quick else SCHEDULE_CONFIGS if args.schedules else HF_CONFIGS if args.hf
                         else CONFIGS)
               if args.ranks in (None, c.world) and (c.tensor_parallel or not args.tp)]
    rounds = args.rounds or (2 if args.quick else 3)
    worlds = sorted({c.world for c in configs if c.world > 1 and c.timed and not args.memory_only})
    links = None
    if worlds and not args.no_calibrate:
        links = measure_links(worlds)
        for world in worlds:
            print(f"{world} ranks: each rank is {compute_share(world):.2f} of a core (measured now: "
                  f"{measured_compute_share(world):.2f}); slowdowns {links.slowdowns[world]}", flush=True)
    # per configuration and round: the profile calibrated just before the run, and the run's step time
    rounds_of: list[list[tuple[HardwareProfile, float]]] = [[] for _ in configs]
    measured: list[Outcome | None] = [None] * len(configs)
    for round_index in range(rounds):  # interleaved: a burst of load hits every config alike
        for index, config in enumerate(configs):
            if not config.timed and round_index > 0:
                continue  # peak memory only: measured in the first round
            timed = config.timed and not args.memory_only
            outcome = RUNNERS[config.kind](config, PLAN_STEPS_PER_ROUND if timed else 0, measure_memory=round_index == 0,
                                           calibrate=None if args.no_calibrate or not timed else args.hardware)
            profile = outcome.calibration or load_profile(args.hardware)
            rounds_of[index].append((profile, outcome.step_s))
            if round_index == 0:
                measured[index] = outcome
        print(f"round {round_index + 1}/{rounds} done", flush=True)
    calibrations = [profile for pairs in rounds_of for profile, _ in pairs] or [load_profile(args.hardware)]
    peaks = [profile.peak_flops["float32"] / 1e9 for profile in calibrations]
    print(f"profile {args.hardware}: {len(calibrations)} calibrations, fp32 peak {min(peaks):.1f}-{max(peaks):.1f} GFLOP/s "
          f"(median {statistics.median(peaks):.1f}), memory {statistics.median(p.memory_bandwidth for p in calibrations) / 1e9:.2f} "
          f"GB/s, AdamW {statistics.median(p.device_adam_params_per_s for p in calibrations) / 1e9:.3f} G params/s, "
          f"op overhead {statistics.median(p.op_overhead for p in calibrations) * 1e6:.1f} us (medians)", flush=True)

    def for_world(profile: HardwareProfile, world: int, share: float | None = None) -> HardwareProfile:
        if world == 1:
            return profile
        return (dataclasses.replace(profile, gpus_per_node=max(max(worlds, default=world), world)) if links is None
                else multi_rank_profile(profile, world, links, share))

    predicted, measured_steps = [], []
    for config, pairs in zip(configs, rounds_of):
        # each round's run against the profile measured right before it; geometric means over rounds
        outcomes = [PREDICTORS[config.kind](config, for_world(profile, config.world)) for profile, _ in pairs]
        if compute_share(config.world) < 1.0:  # more ranks than cores: the processor-sharing bound
            even = geometric_mean([o.step_s / m for o, (_, m) in zip(outcomes, pairs)])
            outcomes = [dataclasses.replace(outcome, step_s=shared_core_step(config, for_world(profile, config.world, 1.0),
                                                                             os.cpu_count() or 1))
                        for outcome, (profile, _) in zip(outcomes, pairs)]
            print(f"{config.label}: the even share of a core would predict {even - 1:+.1%}", flush=True)
        step_s = geometric_mean([measured_s for _, measured_s in pairs])
        ratio = geometric_mean([outcome.step_s / measured_s for outcome, (_, measured_s) in zip(outcomes, pairs)])
        predicted.append(dataclasses.replace(outcomes[0], step_s=ratio * step_s))
        measured_steps.append(step_s)
    print(f"\n{'configuration':<52} {'pred s':>7} {'meas s':>7} {'err':>7}  {'pred MB':>8} {'meas MB':>8} {'err':>7}")
    rows: dict[str, list[tuple]] = {}
    for config, prediction, step_s, outcome in zip(configs, predicted, measured_steps, measured):
        # per pipeline stage: the stage whose predicted peak is furthest from its measured one
        stage_pairs = list(zip(prediction.stage_peaks or [prediction.peak_bytes], outcome.stage_peaks or [outcome.peak_bytes]))
        pred_mb, meas_mb = max(stage_pairs, key=lambda pair: abs(pair[0] / pair[1] - 1))
        stages = f" (worst of {len(stage_pairs)} stages)" if len(stage_pairs) > 1 else ""
        times = (f"{prediction.step_s:>7.3f} {step_s:>7.3f} {prediction.step_s / step_s - 1:>+7.1%}"
                 if math.isfinite(step_s) else f"{'-':>7} {'-':>7} {'-':>7}")
        print(f"{config.label + stages:<52} {times}  {pred_mb / 1e6:>8.2f} {meas_mb / 1e6:>8.2f} {pred_mb / meas_mb - 1:>+7.2%}")
        group = f"{config.world} rank" + ("s" if config.world > 1 else "") + (" TP" if config.tensor_parallel else "")
        group += f" {config.schedule}" if config in SCHEDULE_CONFIGS else ""
        rows.setdefault(group, []).append((prediction.step_s, step_s, pred_mb, meas_mb))
    print()
    for group, group_rows in rows.items():
        _summary(group, group_rows)
    _summary("all but TP", [row for group, group_rows in rows.items() if not group.endswith("TP") for row in group_rows])
    _summary("all", [row for group_rows in rows.values() for row in group_rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
