"""Ready for GPUs: every plan kind trained on the device against CPU/fp32 training, predicted vs
measured step time and peak memory, model FLOPs utilisation, and multi-GPU plans over NCCL.

Sections (each a printed table; ``--out DIR`` also writes them, with the device and the date):

1. environment: device, torch / CUDA / NCCL versions, the attention kernel runs use (flash-attn or SDPA);
2. one device, every plan kind (bf16, fp16 with loss scaling, fp32, ZeRO 1-3, checkpointing, each
   offload kind): ``check`` trains a small model 3 steps on the device and compares losses, first
   gradients and final weights as ``mistc run --check`` does (one-process CPU runs in float64 and in
   the plan's dtype; the column is the largest difference over the allowed one, ok at <= 1);
   ``predicted``/``measured`` price the kind on the performance model (``analyze`` with the hardware
   profile, its compute side re-measured here first: ``recalibrate_compute``) and time it (median of
   the timed steps after warm-up, the device synchronised around each step); memory is the peak of one
   step after warm-up: ``max_memory_allocated`` against the predicted peak, ``max_memory_reserved``
   beside it (what the headroom must cover);
3. MFU of gpt2-1.3b and llama-1.3b at sequence 2048 on one device, each with the plan ``tune`` picks
   for it (``cost.flops.model_flops_per_iteration`` / (step time x the profile's dense peak)), trained
   with compiled units and with eager ones, with each run's start-up (compile and first step);
4. several devices (when there are 2+): DP, TP, PP and mixed plans over NCCL, checked and timed the same way.

``--dry-run`` runs the same code on the CPU: gloo ranks instead of NCCL, the ``cpu`` profile, tiny
models and short sequences (minutes on two cores), so CI exercises every path but the CUDA calls.
``--smoke`` only checks that CUDA, NCCL (an all-reduce over every local GPU) and flash-attn work (the
Docker image's command). Accuracy targets (time within 10 %, memory within 3 %, gpt2-1.3b MFU >= 41 %
on an H100) apply to GPU runs; the dry run prints the same columns without a verdict.

A lent GPU's time is short: ``--sections`` runs sections in the order given, ``--kinds`` picks plan
kinds, ``--deadline-s`` starts no row after that many seconds, and ``--out`` writes the tables after
every row; a row that fails says why in the table and the run goes on. ``--out`` also gets the profile
the run calibrated (``calibrated-<profile>.yaml``), and ``--trace KINDS`` profiles one more step of those
one-device kinds (``trace-<kind>.txt``: top ops and the runtime's ``mist.*`` ranges from every thread;
``trace-<kind>.json.gz``: the Chrome trace), for what a table row cannot say.

Usage: ``PYTHONPATH=. python benchmarks/gpu_check.py [--dry-run | --smoke] [--hardware NAME] [--out DIR]
[--sections mfu,one] [--kinds "bf16,ZeRO-3"] [--trace "offload weights 50%"] [--deadline-s S]
[--extra-kinds benchmarks/plans/gpt2-per-tensor.json]``
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field

import torch

LR = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-6, "weight_decay": 0.1}
TIME_TARGET, MEMORY_TARGET, MFU_TARGET = 0.10, 0.03, 0.41
GPU_PROFILES = [("H200", "h200"), ("H100", "h100-80gb"), ("A100.*80", "a100-80gb"), ("A100", "a100-40gb"),
                ("L4", "l4"), ("V100", "v100-32gb")]


@dataclass(frozen=True)
class Settings:
    """What one run of the check uses; GPU and dry-run settings differ only in sizes and names."""

    device: str  # "cuda" | "cpu"
    hardware: str
    check_model: str
    check_seq: int
    perf_model: str
    perf_seq: int
    perf_batch: int
    mfu_models: tuple[str, ...]
    mfu_seq: int
    mfu_batch: int
    warmup: int
    timed: int
    devices: int  # devices available for the multi-device section

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"


def settings_for(args: argparse.Namespace) -> Settings:
    if args.dry_run or not torch.cuda.is_available():
        return Settings("cpu", args.hardware or "cpu", "gpt-tiny", 16, "gpt-tiny", 64, 8, ("gpt-tiny", "llama-tiny"),
                        64, 8, 1, 2, 4)
    return Settings("cuda", args.hardware or _profile_of(torch.cuda.get_device_name(0)), "gpt-small", 256,
                    args.perf_model, 2048, 8, ("gpt2-1.3b", "llama-1.3b"), 2048, args.mfu_batch, 2, 5,
                    torch.cuda.device_count())


def _profile_of(device_name: str) -> str:
    import re

    for pattern, profile in GPU_PROFILES:
        if re.search(pattern, device_name):
            return profile
    raise SystemExit(f"gpu_check: no shipped profile for {device_name!r}; pass --hardware (e.g. a `mistc profile` file)")


# --------------------------------------------------------------------------- plans

def plan_dict(model: str, seq: int, batch: int, grad_accum: int, stages: list[dict], dtype: str) -> dict:
    for stage in stages:
        stage.setdefault("micro_batch", batch // (grad_accum * stage["dp"]))
        stage.setdefault("nodes", 1)
        stage["gpus_per_node"] = stage["dp"] * stage["tp"]
    return {"model": model, "seq_len": seq, "global_batch": batch, "dtype": dtype, "grad_accum": grad_accum,
            "stages": stages}


def _layers(model: str) -> int:
    from mist_compiler.models import zoo_config

    return zoo_config(model).layers


def one_device_kinds(model: str, seq: int, batch: int, extra: dict[str, dict] | None = None) -> list[tuple[str, dict]]:
    """(kind, plan) for every one-device plan kind; bf16 unless the kind says otherwise. ``extra`` adds
    kinds by the stage fields they set (``--extra-kinds``: e.g. per-tensor policies solved elsewhere)."""
    n = _layers(model)

    def one(dtype="bfloat16", grad_accum=2, **stage):
        return plan_dict(model, seq, batch, grad_accum, [{"layers": [0, n], "dp": 1, "tp": 1, **stage}], dtype)

    half = lambda kind: {"offload": {kind: 0.5}}  # noqa: E731
    return [("bf16", one()), ("fp16 + loss scaling", one("float16")), ("fp32", one("float32")),
            ("ZeRO-1", one(zero=1)), ("ZeRO-2", one(zero=2)), ("ZeRO-3", one(zero=3)),
            ("checkpointing (all)", one(ckpt_layers=n)),
            ("offload weights 50%", one(**half("weights"))), ("offload grads 50%", one(zero=2, **half("grads"))),
            ("offload opt 50%", one(**half("opt"))), ("offload acts 50%", one(**half("acts")))] + \
        [(kind, one(**fields)) for kind, fields in (extra or {}).items()]


def multi_device_kinds(model: str, seq: int, batch: int, devices: int, dtype: str) -> list[tuple[str, int, dict]]:
    """(kind, ranks, plan) of DP, TP, PP and mixed plans that fit in ``devices``."""
    n = _layers(model)
    half = n // 2
    kinds = [
        ("DP 2 (ZeRO-1)", 2, plan_dict(model, seq, batch, 2, [{"layers": [0, n], "dp": 2, "tp": 1, "zero": 1}], dtype)),
        ("TP 2", 2, plan_dict(model, seq, batch, 2, [{"layers": [0, n], "dp": 1, "tp": 2}], dtype)),
        ("PP 2 (1F1B)", 2, plan_dict(model, seq, batch, 4, [{"layers": [0, half], "dp": 1, "tp": 1},
                                                             {"layers": [half, n], "dp": 1, "tp": 1}], dtype)),
        ("mixed: DP 2 -> TP 2", 4, plan_dict(model, seq, batch, 2, [{"layers": [0, half], "dp": 2, "tp": 1, "zero": 2},
                                                                    {"layers": [half, n], "dp": 1, "tp": 2}], dtype)),
    ]
    return [kind for kind in kinds if kind[1] <= devices]


# --------------------------------------------------------------------------- one run, on every rank

@dataclass
class Job:
    plan: dict
    device: str  # "cuda" (the rank's GPU) or "cpu"
    warmup: int = 0  # steps before the measured ones (their losses count for the check)
    timed: int = 0
    check: bool = False  # rank 0 trains the same model on the CPU in fp32 and compares
    memory: bool = False
    compile_units: bool | None = None  # None: as the plan says (compiled by default); False: eager units
    trace: str = ""  # path stem: rank 0 profiles one more step into <stem>.txt (top ops) and <stem>.json.gz


@dataclass
class Outcome:
    losses: list[float] = field(default_factory=list)
    step_s: float = float("nan")
    allocated: list[float] = field(default_factory=list)  # per stage, the largest over its ranks
    reserved: list[float] = field(default_factory=list)
    worst: float = float("nan")  # the check's largest difference / its allowed difference (ok: <= 1)
    where: str = ""
    ok: bool | None = None
    kernel: str = ""
    startup_s: float = float("nan")  # compile_model and the first step (units compile at their first call)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _attention_kernel(engine, plan) -> str:
    from mist_compiler.models import zoo_config
    from mist_compiler.models.attention import attention_kernel
    from mist_compiler.ir.vocabulary import TORCH_DTYPES

    head_dim = zoo_config(plan.model).head_dim
    return attention_kernel(torch.empty(1, 1, 1, head_dim, device=engine.device, dtype=TORCH_DTYPES[plan.dtype]))


def run_job(rank: int, world: int, job: Job) -> dict:
    """Compile and train ``job.plan`` on this rank as ``mistc run`` does; measure what the job asks for."""
    import torch.distributed as dist

    from mist_compiler import driver
    from mist_compiler.ir.plan import Plan
    from mist_compiler.profiling.live_memory import DevicePeakMemory
    from mist_compiler.runtime.optimizer import AdamWConfig
    from mist_compiler.verify.check import Run, check_run, synthetic_batch, vocab_size

    plan = Plan.from_dict(job.plan)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if job.device == "cuda" else torch.device("cpu")
    result: dict = {"losses": [], "times": [], "allocated": float("nan"), "reserved": float("nan")}
    gradients = None
    started = time.perf_counter()
    with DevicePeakMemory(device) as probe:  # entered before the model exists (CPU counts what it sees)
        compiled = driver.compile_model(plan.model, plan=plan, optimizer=AdamWConfig(**LR), device=device,
                                        timeout_s=600.0, compile_units=job.compile_units)
        engine = compiled.engine
        vocab = vocab_size(compiled.program)
        gc.collect()
        batches = [synthetic_batch(vocab, plan.global_batch, plan.seq_len, step) for step in range(job.warmup + 1)]
        for step in range(job.warmup):
            result["losses"].append(engine.forward_backward(batches[step]))
            if step == 0:
                _sync(device)
                result["startup_s"] = time.perf_counter() - started
            if step == 0 and job.check:
                gradients = engine.gather_full_gradients()
            engine.optimizer_step()
        if job.memory:
            probe.reset_peak()
            engine.step(batches[-1])
            result["allocated"] = float(probe.peak_bytes)
            if device.type == "cuda":
                result["reserved"] = float(torch.cuda.max_memory_reserved(device))
    for step in range(job.timed):
        if world > 1:
            dist.barrier()
        _sync(device)
        start = time.perf_counter()
        engine.step(batches[step % len(batches)])
        _sync(device)
        result["times"].append(time.perf_counter() - start)
    if job.trace and rank == 0:
        trace_step(engine, batches[0], device, job.trace)
    result["stage"], result["kernel"] = engine.coord.stage, _attention_kernel(engine, plan)
    weights = engine.gather_full_state() if job.check else None
    engine.close()
    if job.check and rank == 0:  # --check's comparison: one-process runs on the CPU, float64 and the plan's dtype
        verdict = check_run(plan.model, plan, batches[:job.warmup], Run(result["losses"], gradients, weights), LR)
        result["worst"], result["where"], result["ok"] = verdict.worst_ratio, verdict.where, verdict.ok
    return result


def trace_step(engine, batch, device: torch.device, stem: str) -> None:
    """One step under ``torch.profiler`` (CPU, and CUDA on a GPU): the ops by self time and the runtime's
    own ranges (``mist.*``: host writes, host AdamW, offload copies) as text, the whole timeline as a
    gzipped Chrome trace, for what a step's table cannot say (which copies are exposed, and why)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    try:  # the host workers' threads too (an option of recent torch; without it, the main thread's)
        threads = {"experimental_config": torch._C._profiler._ExperimentalConfig(profile_all_threads=True)}
    except TypeError:
        threads = {}
    with profile(activities=activities, **threads) as prof:
        engine.step(batch)
        _sync(device)
    averages = prof.key_averages()
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    ours = [event for event in averages if event.key.startswith("mist.")]
    with open(stem + ".txt", "w") as handle:
        handle.write(averages.table(sort_by=sort, row_limit=40) + "\n\nthe runtime's ranges (mist.*), CPU time:\n")
        handle.writelines(f"{event.key}: {event.count} calls, {event.cpu_time_total / 1e3:.1f} ms\n" for event in ours)
    prof.export_chrome_trace(stem + ".json.gz")  # torch gzips by the suffix


def _trace_stem(report: "Report", kind: str) -> str:
    """Where a traced kind's step goes (``--trace``): under ``--out``, named after the kind."""
    if kind not in report.traced or not report.folder:
        return ""
    os.makedirs(report.folder, exist_ok=True)
    return os.path.join(report.folder, "trace-" + "".join(ch if ch.isalnum() else "-" for ch in kind).strip("-"))


def run(job: Job, world: int, settings: Settings) -> Outcome:
    from mist_compiler.ir.plan import Plan
    from mist_compiler.launch.local_ranks import run_ranks

    results = run_ranks(run_job, world=world, args=(job,), timeout_s=1800.0, collective_timeout_s=600.0,
                        backend=settings.backend if world > 1 else "gloo")
    stages = Plan.from_dict(job.plan).pp
    outcome = Outcome(losses=results[0]["losses"], kernel=results[0]["kernel"],
                      startup_s=max(r.get("startup_s", float("nan")) for r in results),
                      worst=results[0].get("worst", float("nan")), where=results[0].get("where", ""),
                      ok=results[0].get("ok"))
    if job.timed:
        outcome.step_s = statistics.median(max(r["times"][i] for r in results) for i in range(job.timed))
    for key in ("allocated", "reserved"):
        per_stage = [max((r[key] for r in results if r["stage"] == s), default=float("nan")) for s in range(stages)]
        setattr(outcome, key, per_stage)
    return outcome


# --------------------------------------------------------------------------- predictions, rows, tables

def calibrated(settings: Settings):
    """The hardware profile with its compute side measured on this device now (seconds)."""
    from mist_compiler.cost.hardware import load_profile
    from mist_compiler.profiling.profiler import ProfilerOptions, recalibrate_compute

    base = load_profile(settings.hardware)
    options = ProfilerOptions(quick=settings.device == "cpu", device=settings.device, log=lambda message: None)
    return recalibrate_compute(base, options)


_COST_MODELS: dict = {}


def predict(plan_data: dict, profile) -> tuple[float, list[float]]:
    """``analyze`` of the plan (one stage cost model per model, sequence and dtype, built once)."""
    from mist_compiler.cost.analyze import analyze
    from mist_compiler.driver import price
    from mist_compiler.ir.plan import Plan

    plan = Plan.from_dict(plan_data)
    key = (plan.model, plan.seq_len, plan.dtype, profile.name, plan.compiled)
    if key not in _COST_MODELS:
        _COST_MODELS[key] = price(plan.model, profile, seq_len=plan.seq_len, dtype=plan.dtype,
                                  compiled=plan.compiled)[1]
    estimate = analyze(None, plan, profile, cost_model=_COST_MODELS[key])
    return estimate.iteration_time_s, [stage.peak_memory_mb * 1e6 for stage in estimate.stages]


def _error(predicted: float, measured: float) -> float:
    return predicted / measured - 1.0 if measured and measured == measured else float("nan")


def accuracy_row(kind: str, plan_data: dict, outcome: Outcome, check: Outcome | None, profile, gpu: bool) -> dict:
    predicted_s, predicted_mem = predict(plan_data, profile)
    worst = max(range(len(predicted_mem)), key=lambda s: abs(_error(predicted_mem[s], outcome.allocated[s]))
                if outcome.allocated[s] == outcome.allocated[s] else -1)
    row = {"kind": kind, "dtype": plan_data["dtype"],
           "check": "-" if check is None else f"{check.worst:.2f}",
           "check ok": None if check is None else check.ok,
           "predicted s": predicted_s, "measured s": outcome.step_s, "time err": _error(predicted_s, outcome.step_s),
           "predicted MB": predicted_mem[worst] / 1e6, "allocated MB": outcome.allocated[worst] / 1e6,
           "memory err": _error(predicted_mem[worst], outcome.allocated[worst]),
           "reserved MB": outcome.reserved[worst] / 1e6, "kernel": outcome.kernel}
    if gpu:
        row["targets met"] = abs(row["time err"]) <= TIME_TARGET and abs(row["memory err"]) <= MEMORY_TARGET
    return row


def format_table(title: str, rows: list[dict]) -> str:
    if not rows:
        return f"## {title}\n(nothing to run)\n"
    columns = list(dict.fromkeys(column for row in rows for column in row))  # an error row has fewer

    def cell(column: str, value) -> str:
        if isinstance(value, bool) or value is None:
            return {True: "yes", False: "NO", None: "-"}[value]
        if isinstance(value, float):
            if value != value:
                return "-"
            return f"{value:+.1%}" if "err" in column else f"{value:.1%}" if "MFU" in column else f"{value:,.4g}"
        return str(value)

    def render(row: dict) -> list[str]:
        return [cell(column, row.get(column, float("nan"))) for column in columns]

    lines = [f"## {title}", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(render(row)) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- sections

def environment(settings: Settings) -> list[dict]:
    from mist_compiler.models.attention import FLASH_ATTN_VERSION

    rows = [{"item": "date", "value": datetime.datetime.now().isoformat(timespec="seconds")},
            {"item": "host", "value": platform.node()},
            {"item": "torch", "value": torch.__version__},
            {"item": "hardware profile", "value": settings.hardware},
            {"item": "flash-attn", "value": FLASH_ATTN_VERSION or "not installed"}]
    if settings.device == "cuda":
        rows += [{"item": "device", "value": f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}"},
                 {"item": "CUDA", "value": torch.version.cuda},
                 {"item": "NCCL", "value": ".".join(map(str, torch.cuda.nccl.version()))}]
    else:
        rows.append({"item": "device", "value": f"CPU dry run ({platform.processor() or platform.machine()}), gloo"})
    return rows


class Report:
    """The sections so far, printed and (``--out``) written after every row: a run cut short by its
    time limit still leaves what it measured. Rows start only before ``deadline`` (a monotonic time)."""

    def __init__(self, settings: Settings, folder: str | None, deadline: float, log) -> None:
        self.settings, self.folder, self.deadline, self.log = settings, folder, deadline, log
        self.sections: list[tuple[str, list[dict]]] = []
        self.traced: set[str] = set()  # kinds whose timed run also profiles a step (--trace)

    def section(self, title: str) -> list[dict]:
        self.sections.append((title, []))
        return self.sections[-1][1]

    def text(self) -> str:
        return "\n".join(format_table(title, rows) for title, rows in self.sections)

    def flush(self) -> None:
        if self.folder:
            _write(self.folder, self.settings, self.sections, self.text())

    def add(self, rows: list[dict], label: str, measure) -> None:
        """Append ``measure()``'s row; its failure becomes a row that says why, not the end of the run."""
        if time.monotonic() > self.deadline:
            self.log(f"{label}: skipped (past --deadline-s)")
            return
        self.log(label)
        started = time.monotonic()
        try:
            row = measure()
        except Exception as error:  # noqa: BLE001 - one plan kind failing must not hide the others
            self.log(traceback.format_exc())
            row = {"kind": label, "error": f"{type(error).__name__}: {str(error)[:300]}"}
        self.log(f"{label}: done in {time.monotonic() - started:.0f} s")
        rows.append(row)
        self.flush()


def _wanted(kinds: list, only: set[str] | None) -> list:
    return [kind for kind in kinds if only is None or kind[0] in only]


def one_device_section(settings: Settings, profile, report: Report, only: set[str] | None,
                       extra: dict[str, dict]) -> None:
    rows = report.section("one device: every plan kind")
    checks = dict(one_device_kinds(settings.check_model, settings.check_seq, 8, extra))

    def measure(kind: str, plan_data: dict) -> dict:
        check = run(Job(checks[kind], settings.device, warmup=3, check=True), 1, settings)
        outcome = run(Job(plan_data, settings.device, warmup=settings.warmup, timed=settings.timed, memory=True,
                          trace=_trace_stem(report, kind)), 1, settings)
        return accuracy_row(kind, plan_data, outcome, check, profile, settings.device == "cuda")

    for kind, plan_data in _wanted(one_device_kinds(settings.perf_model, settings.perf_seq, settings.perf_batch, extra),
                                   only):
        report.add(rows, f"one device: {kind}", lambda kind=kind, plan_data=plan_data: measure(kind, plan_data))


def tuning_space():
    """The full search space; per-tensor activation policies only where python-mip can solve them (a
    GPU image without its CBC wheel, too large to carry, tunes layer-level checkpointing instead)."""
    import importlib.util

    from mist_compiler.tuner.space import SearchSpace

    return SearchSpace(per_tensor=importlib.util.find_spec("mip") is not None)


def mfu_section(settings: Settings, profile, report: Report) -> None:
    """Each model with the plan the tuner picks for it, trained with compiled units and with eager
    ones (``compile_units=False``): the codegen's gain measured, and its start-up cost."""
    from mist_compiler.cost.flops import model_flops_per_iteration
    from mist_compiler.driver import tune_model
    from mist_compiler.ir.plan import Plan
    from mist_compiler.models import zoo_config

    rows = report.section("MFU on one device: compiled vs eager units")
    dtype = "bfloat16"
    peak = profile.peak_flops.get(dtype, max(profile.peak_flops.values()))
    for model in settings.mfu_models:
        tuned: dict = {}

        def measure(model: str, units: str) -> dict:
            if "plan" not in tuned:
                tuning = tune_model(model, profile, gpus_per_node=1, global_batch=settings.mfu_batch,
                                    seq_len=settings.mfu_seq, dtype=dtype, space=tuning_space())
                tuned["plan"], tuned["predicted"], tuned["mfu"] = tuning.plan, tuning.predicted_time_s, tuning.mfu
            plan = tuned["plan"]
            data = plan.to_dict()
            outcome = run(Job(data, settings.device, warmup=settings.warmup, timed=settings.timed, memory=True,
                              compile_units=None if units == "compiled" else False), 1, settings)
            flops = model_flops_per_iteration(zoo_config(model), Plan.from_dict(data))
            stage = plan.stages[0]
            predicted = tuned["predicted"] if units == "compiled" else float("nan")  # the tuner priced compiled units
            return {"model": model, "units": units, "seq": settings.mfu_seq, "global batch": settings.mfu_batch,
                    "plan": f"mb {stage.micro_batch} x G {plan.grad_accum}, ckpt {stage.ckpt_layers}, ZeRO-{stage.zero}",
                    "predicted s": predicted, "step s": outcome.step_s,
                    "time err": _error(predicted, outcome.step_s), "start-up s": outcome.startup_s,
                    "TFLOP/s": flops / outcome.step_s / 1e12, "MFU": flops / outcome.step_s / peak,
                    "predicted MFU": tuned["mfu"] if units == "compiled" else float("nan"),
                    "allocated MB": outcome.allocated[0] / 1e6, "reserved MB": outcome.reserved[0] / 1e6,
                    "kernel": outcome.kernel}

        for units in ("compiled", "eager"):
            report.add(rows, f"MFU: {model}, {units} units", lambda model=model, units=units: measure(model, units))


def multi_device_section(settings: Settings, profile, report: Report, only: set[str] | None) -> None:
    rows = report.section(f"{settings.backend}: DP, TP, PP and mixed plans")
    checks = {kind: plan for kind, _, plan in multi_device_kinds(settings.check_model, settings.check_seq, 8,
                                                                   settings.devices, "float32")}
    dtype = "bfloat16" if settings.device == "cuda" else "float32"

    def measure(kind: str, world: int, plan_data: dict) -> dict:
        check = run(Job(checks[kind], settings.device, warmup=3, check=True), world, settings)
        outcome = run(Job(plan_data, settings.device, warmup=settings.warmup, timed=settings.timed, memory=True),
                      world, settings)
        return {"ranks": world, **accuracy_row(kind, plan_data, outcome, check, profile, settings.device == "cuda")}

    for kind, world, plan_data in _wanted(multi_device_kinds(settings.perf_model, settings.perf_seq,
                                                             settings.perf_batch, settings.devices, dtype), only):
        report.add(rows, f"{world} devices: {kind}",
                   lambda kind=kind, world=world, plan_data=plan_data: measure(kind, world, plan_data))


def smoke() -> int:
    """CUDA, NCCL over every local GPU, flash-attn: present and working."""
    from mist_compiler.launch.local_ranks import run_ranks
    from mist_compiler.models.attention import FLASH_ATTN_VERSION

    if not torch.cuda.is_available():
        print("smoke: no CUDA device visible", file=sys.stderr)
        return 1
    count = torch.cuda.device_count()
    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close((a @ a).float().cpu(), a.float().cpu() @ a.float().cpu(), rtol=5e-2, atol=5e-1)
    sums = run_ranks(_smoke_rank, world=count, backend="nccl", timeout_s=300.0) if count > 1 else [1.0]
    print(f"smoke: {torch.cuda.get_device_name(0)} x {count}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, all-reduce over {count} GPU(s) = {sums[0]:.0f}, "
          f"flash-attn {FLASH_ATTN_VERSION or 'not installed'}: ok")
    return 0


def _smoke_rank(rank: int, world: int) -> float:
    import torch.distributed as dist

    value = torch.ones(1, device=torch.device("cuda", rank))
    dist.all_reduce(value)
    assert value.item() == world
    return value.item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="the same code on CPU/gloo with tiny models")
    parser.add_argument("--smoke", action="store_true", help="only check CUDA, NCCL and flash-attn")
    parser.add_argument("--hardware", help="hardware profile (default: the shipped profile of the GPU; cpu for --dry-run)")
    parser.add_argument("--perf-model", default="gpt2-1.3b", help="model of the timed plans on a GPU (default gpt2-1.3b)")
    parser.add_argument("--mfu-batch", type=int, default=16, help="global batch of the MFU runs on a GPU (default 16)")
    parser.add_argument("--sections", default="one,mfu,multi", help="comma-separated, run in this order: one, mfu, multi")
    parser.add_argument("--kinds", help="comma-separated plan kinds of the one/multi sections (default: all)")
    parser.add_argument("--deadline-s", type=float, default=float("inf"),
                        help="start no row after this many seconds (a lent GPU's time is short); rows so far are kept")
    parser.add_argument("--trace", help="comma-separated kinds of the one-device section whose timed run also "
                        "profiles one step (top ops as text, a gzipped Chrome trace) under --out")
    parser.add_argument("--out", help="directory to write the tables to (markdown and JSON), after every row")
    parser.add_argument("--extra-kinds", help="JSON file {kind: stage fields} of more one-device kinds (e.g. "
                        "benchmarks/plans/gpt2-per-tensor.json: per-tensor policies solved where python-mip is)")
    args = parser.parse_args(argv)
    if args.smoke:
        return smoke()
    names = args.sections.split(",")
    unknown = [name for name in names if name not in ("one", "mfu", "multi")]
    if unknown:  # before the calibration: a lent GPU's minutes are not spent on a typo
        raise SystemExit(f"gpu_check: --sections: unknown section {unknown[0]!r} (one, mfu, multi)")
    extra = _extra_kinds(args.extra_kinds)
    known = [kind for kind, _ in one_device_kinds("gpt-tiny", 16, 8, extra)] + \
        [kind for kind, _, _ in multi_device_kinds("gpt-tiny", 16, 8, 64, "bfloat16")]
    for option, value in (("--kinds", args.kinds), ("--trace", args.trace)):
        wrong = [kind for kind in (value.split(",") if value else []) if kind not in known]
        if wrong:
            raise SystemExit(f"gpu_check: {option}: unknown plan kind {wrong[0]!r} (one of: {', '.join(known)})")
    settings = settings_for(args)
    log = lambda message: print(f"[gpu_check] {message}", file=sys.stderr, flush=True)  # noqa: E731
    report = Report(settings, args.out, time.monotonic() + args.deadline_s, log)
    report.traced = set(args.trace.split(",")) if args.trace else set()
    started = time.monotonic()
    profile = calibrated(settings)
    report.section("environment").extend(
        environment(settings) + [{"item": "calibration", "value": f"{time.monotonic() - started:.0f} s"},
                                 {"item": "per-tensor activation policies", "value": tuning_space().per_tensor}])
    report.section("calibrated compute side").extend(
        [{"item": f"efficiency {name}", "value": f"{value:.3f}"} for name, value in sorted(profile.efficiency.items())]
        + [{"item": "memory copy GB/s", "value": f"{profile.memory_bandwidth / 1e9:.0f}"}])
    report.flush()
    if args.out:  # the measured profile itself, to re-anchor the shipped one without another run
        from mist_compiler.cost.hardware import save_profile

        save_profile(profile, os.path.join(args.out, f"calibrated-{settings.hardware}.yaml"))
    only = set(args.kinds.split(",")) if args.kinds else None
    for name in names:
        if name == "one":
            one_device_section(settings, profile, report, only, extra)
        elif name == "mfu":
            mfu_section(settings, profile, report)
        elif settings.devices > 1:
            multi_device_section(settings, profile, report, only)
    print(report.text())
    if args.out:
        print(f"wrote the tables under {args.out}", file=sys.stderr)
    return 0


def _extra_kinds(path: str | None) -> dict[str, dict]:
    """``--extra-kinds``: read as data (JSON), each kind's stage fields checked by the plan schema when
    its plan is built; a bad file stops the run before the calibration."""
    if not path:
        return {}
    try:
        with open(path) as handle:
            data = json.load(handle)
    except (OSError, ValueError) as error:
        raise SystemExit(f"gpu_check: --extra-kinds: cannot read {path}: {error}") from None
    if not isinstance(data, dict) or not all(isinstance(fields, dict) for fields in data.values()):
        raise SystemExit(f"gpu_check: --extra-kinds: {path} must hold an object {{kind: {{stage fields}}}}")
    from mist_compiler.ir.plan import Plan, PlanError

    plans = dict(one_device_kinds("gpt-tiny", 16, 8, data))  # (the extra kinds come last: theirs are kept)
    for kind in data:
        try:
            Plan.from_dict(plans[kind])
        except PlanError as error:
            raise SystemExit(f"gpu_check: --extra-kinds: {kind!r}: {error}") from None
    return data


def _write(folder: str, settings: Settings, sections, text: str) -> None:
    os.makedirs(folder, exist_ok=True)
    name = "dry-run" if settings.device == "cpu" else torch.cuda.get_device_name(0).replace(" ", "-")
    stem = os.path.join(folder, f"gpu_check-{name}-{datetime.date.today().isoformat()}")
    with open(stem + ".md", "w") as handle:
        handle.write(f"# gpu_check on {name}, {datetime.date.today().isoformat()}\n\n{text}")
    with open(stem + ".json", "w") as handle:
        json.dump({"settings": asdict(settings), "sections": dict(sections)}, handle, indent=2, default=str)


if __name__ == "__main__":
    sys.exit(main())
