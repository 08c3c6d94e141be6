"""The compiler in one list: capture -> analysis -> tune -> check -> lowering -> runtime.

:func:`compile_model` is the whole pipeline, used alike by the command line, the Python API, the
Trainer and the ``torch.compile`` backend; each step is one call into the sub-package that owns it::

    program = capture(model)                  # frontend: one trace -> the captured program (MistProgram)
                                              #   (torch.compile: cut from the graph dynamo traced, capture_graph)
    cost_model = analyse(program, hardware)   # cost: analysis passes -> vectorised time/memory model
    plan = tune(cost_model, cluster)          # tuner (skipped when a plan is given) -> Plan
    check_plan(program, plan)                 # verify: the plan fits the captured model; TP splits proven
    world = join_world(plan)                  # runtime: this rank's device and process groups
    stage = lower(program, plan, world)       # lowering passes -> this rank's StageProgram, its weights
    engine = Engine(stage, plan, world)       # runtime: schedules, ZeRO, offload, AdamW

``until`` stops early (``"plan"``: nothing runs, for ``mistc tune``/``analyze`` and the parent of
``mistc run``, which checks the plan, proofs included, before it starts any rank; the ranks
check it again without the proofs).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from .ir.plan import Plan, PlanError, load_plan
from .ir.program import MistProgram
from .ir.vocabulary import COMPILED_DEFAULT, DEFAULT_DTYPE


@dataclass
class Compiled:
    """What the pipeline produced, as far as it ran."""

    program: MistProgram
    plan: Plan
    tuning: Any = None  # the TuneResult when the plan was tuned
    cost_model: Any = None
    engine: Any = None
    captured_from: str = "module"  # "graph": cut from dynamo's graph; "module (why not the graph)"; "program": given


@dataclass(frozen=True)
class IRShape:
    """Sizes of a captured model, read from its IR (for MFU and the tuner's workload)."""

    params: int
    layers: int
    hidden: int
    heads: int


def ir_shape(program: MistProgram) -> IRShape:
    layer = next(program.block_class(b.class_id) for b in program.blocks if b.kind == "layer")
    heads = int(layer.attention[0].heads) if layer.attention else 0
    graph = program.model_graph
    hidden = 0
    if graph is not None:
        value = graph.node(graph.regions[0].carried_in).meta.get("example_value")
        hidden = int(value.shape[-1]) if value is not None else 0
    return IRShape(program.params, len(program.layers), hidden, heads)


def capture(model, *, dtype: str | None = DEFAULT_DTYPE, attention: str = "flash",
            seq_len: int | None = None, analyse: bool = True) -> MistProgram:
    """Step 1 (frontend): the model (module or name) as one captured program (``analyse=False``:
    only the program that runs, for a rank or a check whose pricing is done elsewhere)."""
    from .frontend.capture import capture as capture_program

    return capture_program(model, dtype=dtype, attention=attention, seq_len=seq_len, analyse=analyse)


def capture_graph(gm, example_inputs: list, model, *, dtype: str | None = None, attention: str = "flash",
                  seq_len: int | None = None, analyse: bool = True) -> MistProgram:
    """Step 1 for the ``torch.compile`` backend: the program cut from ``gm``, the graph dynamo traced
    of a call of ``model``, with the ``example_inputs`` it handed the backend (no second trace);
    ``frontend.dynamo_graph.GraphCaptureUnsupported`` says why a graph cannot give it."""
    from .frontend.dynamo_graph import capture_graph as cut_program

    return cut_program(gm, example_inputs, model, dtype=dtype, attention=attention, seq_len=seq_len, analyse=analyse)


def _capture_either(model, graph: tuple | None, *, dtype: str, attention: str, seq_len: int | None,
                    analyse: bool) -> tuple[MistProgram, str]:
    """The program from dynamo's ``graph`` ``(gm, example_inputs)`` where it holds what a plan needs,
    else captured from the module; and which of the two (with the reason the graph was not used)."""
    if graph is not None:
        from .frontend.dynamo_graph import GraphCaptureUnsupported

        try:
            return capture_graph(*graph, model, dtype=dtype, attention=attention, seq_len=seq_len,
                                 analyse=analyse), "graph"
        except GraphCaptureUnsupported as why:
            reason = f"module ({why})"
    else:
        reason = "module"
    return capture(model, dtype=dtype, attention=attention, seq_len=seq_len, analyse=analyse), reason


def analyse(program: MistProgram, hardware, *, seq_len: int, attention: str = "flash", grad_dtype: str = "float32",
            compiled: bool = COMPILED_DEFAULT):
    """Step 2 (analysis passes): the program's vectorised stage cost model on ``hardware`` (``grad_dtype``:
    the plans' gradient dtype, ``float32`` or the program's dtype, see ``ir.plan``; ``compiled``: price
    units as compiled code, else eager ops)."""
    from .cost.stage_model import build_stage_cost_model

    return build_stage_cost_model(program, hardware, seq_len=seq_len, dtype=program.dtype, attention=attention,
                                  grad_dtype=grad_dtype, compiled=compiled)


def workload(program: MistProgram, global_batch: int, seq_len: int):
    """Layer count and tensor-parallel granularity read from the captured program (not from
    config attribute names): the tuner offers only degrees the lowering can run."""
    from .tuner.space import Workload

    graph = program.model_graph
    tp = graph.tp if graph is not None else None
    divisor = tp.granularity if tp is not None and tp.supported else 1
    return Workload(len(program.layers), max(divisor, 1), global_batch, seq_len, program.dtype, program.model_name,
                    tied_embeddings=bool(graph is not None and graph.tied_parameters()))


def tune(program: MistProgram, cost_model, *, nodes: int, gpus_per_node: int, global_batch: int, seq_len: int,
         space=None, baseline: str | None = None, progress: Callable[[str], None] | None = None):
    """Step 3 (tuner): the fastest plan the cost model predicts, and why (``baseline``: the best plan
    of a baseline's restricted spaces instead, e.g. ``megatron``, see ``tuner.baselines``)."""
    from .tuner.api import tune as search
    from .tuner.baselines import tune_baseline
    from .tuner.space import Cluster

    work, cluster, shape = workload(program, global_batch, seq_len), Cluster(nodes, gpus_per_node), ir_shape(program)
    if baseline is None:
        return search(cost_model, work, cluster, space=space, progress=progress, model_config=shape)
    return tune_baseline(baseline, cost_model, work, cluster, progress=progress, space_override=space,
                         model_config=shape)


def check_sequence(program: MistProgram, seq_len: int, field: str = "--seq") -> None:
    """Refuse a sequence longer than the model's position table (it would fail at run time)."""
    if program.max_positions is not None and seq_len > program.max_positions:
        raise PlanError(f"{field}: {seq_len} exceeds the {program.max_positions} positions {program.model_name} takes")


def check_plan(program: MistProgram, plan: Plan, *, model_name: str | None = None, prove: bool = True) -> None:
    """Step 4: refuse a plan made for another model or one the captured model cannot run."""
    from .lowering.lower import check_plan_against_program
    from .verify.tp_check import prove_tensor_parallel

    if model_name is not None and plan.model != model_name:
        raise PlanError(f"plan field model: the plan was made for {plan.model!r}, not for {model_name!r}")
    check_plan_against_program(plan, program)
    if prove:
        degrees = sorted({(stage.tp, stage.sp) for stage in plan.stages if stage.tp > 1})
        for degree, sp in degrees:
            prove_tensor_parallel(program, degree, sp=sp)
        if degrees:  # the proof's models (real weights, in reference cycles) go before the stage's weights are made
            import gc

            gc.collect()


def lower(program: MistProgram, plan: Plan, world, model=None, source=None, compile_units: bool | None = None):
    """Step 6 (lowering): this rank's stage program, its modules holding this rank's slices of the
    weights of ``source`` (default: the module's own tensors, or a model name's initialisation), its
    units compiled by inductor as the plan says (``compile_units=False``: eager, for debugging;
    ``MIST_COMPILE=0`` makes eager the default, as the test suite does)."""
    from .lowering.compile import compile_stage, default_enabled
    from .lowering.lower import lower as lower_program
    from .lowering.materialize import tensor_source

    source = source if source is not None else tensor_source(model, plan.seq_len)
    stage = lower_program(program, plan, world.coord, source, device=world.device, tp_group=world.tp_group)
    enabled = plan.compiled and default_enabled() if compile_units is None else compile_units
    stage.compile_stats = compile_stage(stage, enabled=enabled)
    return stage


def compile_model(model, *, plan: Plan | str | None = None, hardware=None, nodes: int = 1, gpus_per_node: int = 1,
                  global_batch: int | None = None, seq_len: int | None = None, dtype: str | None = None,
                  attention: str = "flash", space=None, baseline: str | None = None, grad_dtype: str = "float32",
                  compiled: bool = COMPILED_DEFAULT, until: str = "run", model_name: str | None = None,
                  progress: Callable[[str], None] | None = None,
                  program: MistProgram | None = None, prove: bool = True, optimizer=None, device=None,
                  timeout_s: float | None = None, source=None, compile_units: bool | None = None,
                  graph: tuple | None = None) -> Compiled:
    """The whole pipeline (see the module docstring). ``model``: an ``nn.Module`` (trained from its
    own weights) or a model name; ``plan``: run this plan instead of tuning (else tune for
    ``hardware`` and the cluster, in ``space`` or a ``baseline``'s spaces, with ``grad_dtype``
    gradients, pricing units ``compiled`` or eager); ``optimizer`` (AdamW
    settings), ``device``, ``timeout_s``, ``source`` (where the initial weights come from) and
    ``compile_units`` (None: as the plan says; False: eager units, for debugging) are for the runtime.
    ``graph``: ``(gm, example_inputs)``, what dynamo handed the ``torch.compile`` backend: the program is
    cut from it where it holds what a plan needs, else captured from ``model`` (``Compiled.captured_from``)."""
    if isinstance(plan, str):
        plan = load_plan(plan)
    if plan is not None and not isinstance(plan, Plan):
        raise PlanError(f"plan: expected a Plan or a path to a plan file, got {type(plan).__name__}")
    dtype = plan.dtype if plan is not None else (dtype or DEFAULT_DTYPE)
    seq_len = plan.seq_len if plan is not None else seq_len
    captured_from = "program"
    if program is None:
        program, captured_from = _capture_either(model, graph, dtype=dtype, attention=attention, seq_len=seq_len,
                                                 analyse=plan is None)
    tuning = cost_model = None
    if plan is None:
        if hardware is None or global_batch is None:
            raise PlanError("without a plan, compiling needs the hardware and the global batch to tune one")
        seq = seq_len or program.seq_len
        check_sequence(program, seq, "seq_len")
        started = time.perf_counter()
        cost_model = analyse(program, hardware, seq_len=seq, attention=attention, grad_dtype=grad_dtype,
                             compiled=compiled)
        analysis_s = time.perf_counter() - started
        tuning = tune(program, cost_model, nodes=nodes, gpus_per_node=gpus_per_node, global_batch=global_batch,
                      seq_len=seq, space=space, baseline=baseline, progress=progress)
        tuning.stats["analysis_s"] = analysis_s
        plan = tuning.plan
    check_plan(program, plan, model_name=model_name, prove=prove)
    result = Compiled(program, plan, tuning, cost_model, captured_from=captured_from)
    if until == "plan":
        return result
    from .runtime.engine import Engine
    from .runtime.world import DEFAULT_TIMEOUT_S, join_world

    world = join_world(plan, tied=bool(program.model_graph.tied_parameters()), device=device,
                       timeout_s=DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
    stage = lower(program, plan, world, model, source, compile_units)
    result.engine = Engine(stage, plan, world, optimizer=optimizer)
    return result


def tune_model(model, hardware, *, nodes: int = 1, gpus_per_node: int = 1, global_batch: int, seq_len: int | None = None,
               dtype: str = DEFAULT_DTYPE, attention: str = "flash", space=None, baseline: str | None = None,
               grad_dtype: str = "float32", compiled: bool = COMPILED_DEFAULT,
               progress: Callable[[str], None] | None = None):
    """``mist_compiler.tune``: the pipeline up to the plan; returns the tuner's result (plan, times, why)."""
    compiled = compile_model(model, hardware=hardware, nodes=nodes, gpus_per_node=gpus_per_node,
                             global_batch=global_batch, seq_len=seq_len, dtype=dtype, attention=attention, space=space,
                             baseline=baseline, grad_dtype=grad_dtype, compiled=compiled, until="plan", progress=progress,
                             prove=False)
    return compiled.tuning


def price(model, hardware, *, seq_len: int, dtype: str = DEFAULT_DTYPE, attention: str = "flash",
          grad_dtype: str = "float32", compiled: bool = COMPILED_DEFAULT) -> tuple[MistProgram, Any]:
    """Steps 1 and 2 for benchmarks and tools that search or price many plans of one model: the
    captured program and its stage cost model on ``hardware``."""
    program = capture(model, dtype=dtype, attention=attention, seq_len=seq_len)
    return program, analyse(program, hardware, seq_len=seq_len, attention=attention, grad_dtype=grad_dtype,
                            compiled=compiled)


def analyze_plan(model, plan: Plan | str, hardware, *, attention: str = "flash"):
    """``mist_compiler.analyze``: a plan's predicted iteration time and per-stage memory on ``hardware``."""
    from .cost.analyze import analyze, check_plan_hardware
    from .cost.hardware import HardwareProfile, load_profile

    plan = load_plan(plan) if isinstance(plan, str) else plan
    hardware = hardware if isinstance(hardware, HardwareProfile) else load_profile(hardware)
    check_plan_hardware(plan, hardware)
    program = model if isinstance(model, MistProgram) else capture(model, dtype=plan.dtype, attention=attention,
                                                                     seq_len=plan.seq_len)
    check_plan(program, plan, model_name=model if isinstance(model, str) else None, prove=False)
    return analyze(program, plan, hardware, attention=attention)


def build_engine(model, plan: Plan | str, *, optimizer=None, device=None, timeout_s: float | None = None,
                 source=None, compile_units: bool | None = None):
    """``mist_compiler.compile``: this rank's training engine for ``model`` (a module, trained from its
    own weights, or a model name, built and initialised shard by shard) under ``plan`` (a Plan or a
    path). Collective under torchrun: every rank calls it."""
    return compile_model(model, plan=plan, optimizer=optimizer, device=device, timeout_s=timeout_s,
                         source=source, compile_units=compile_units).engine


__all__ = ["Compiled", "IRShape", "analyse", "analyze_plan", "build_engine", "capture", "capture_graph", "check_plan",
           "compile_model",
           "ir_shape", "lower", "price", "tune", "tune_model", "workload"]
