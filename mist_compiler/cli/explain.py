"""mistc explain PLAN [--model M] [--hardware HW] [-o DIR]: a plan in words, its breakdown and timeline.

Says what every stage does, and — with per-stage predictions from ``--hardware`` (the cost
model) or from the ``<plan>.frontiers.json`` side file that ``mistc tune -o`` writes — the
per-stage breakdown and a predicted 1F1B timeline of one iteration. With ``-o DIR`` it writes
``timeline.json`` (Chrome trace; open in Perfetto), ``timeline.png`` and, when the side file
exists, ``frontiers.png`` (the Pareto frontiers the tuner chose from).
"""
from __future__ import annotations

import argparse
import json
import os

from ..cost.stage_api import pipeline_iteration_time
from ..ir.files import check_output_dir
from ..ir.plan import Plan, PlanError, load_plan
from ..ir.vocabulary import ATTENTION_KERNELS
from ..tuner.report import describe_stage, frontier_path
from ..tuner.timeline import iteration_time, plot_frontiers, plot_timeline, simulate, write_chrome_trace


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", help="plan file (JSON or YAML)")
    parser.add_argument("--model", help="model to price the plan with (default: the plan's model)")
    parser.add_argument("--hardware", help="hardware profile: price the plan with the cost model")
    parser.add_argument("--attention", choices=ATTENTION_KERNELS, default="flash", help="target attention kernel")
    parser.add_argument("-o", "--output-dir", help="write timeline.json, timeline.png and frontiers.png here")


def plan_in_words(plan: Plan) -> list[str]:
    lines = [
        f"{plan.model} trained with global batch {plan.global_batch} x {plan.seq_len} tokens ({plan.dtype}) on "
        f"{plan.world_size} devices as a {plan.pp}-stage pipeline; each stage accumulates gradients over "
        f"{plan.grad_accum} micro-batch step(s) (1F1B schedule).",
    ]
    lines += ["  " + describe_stage(i, stage, plan.grad_accum) for i, stage in enumerate(plan.stages)]
    return lines


def stage_predictions(plan: Plan, args: argparse.Namespace) -> tuple[list[dict], str] | None:
    """Per-stage stable/delta/forward/backward/memory, from the cost model or the side file."""
    if args.hardware:
        from .. import driver
        from ..cost.analyze import plan_candidates

        program = driver.capture(model_to_price(plan, args.model), dtype=plan.dtype, attention=args.attention,
                                 seq_len=plan.seq_len)
        driver.check_plan(program, plan, prove=False)  # layers, positions, tp degrees: as analyze and run refuse
        cost_model = driver.analyse(program, args.hardware, seq_len=plan.seq_len, attention=args.attention)
        estimates = cost_model.evaluate(plan_candidates(plan))
        stages = []
        for i in range(plan.pp):
            breakdown = {k: float(v[i]) for k, v in estimates.breakdown.items()}
            stages.append({"stable_s": float(estimates.stable_s[i]), "delta_s": float(estimates.delta_s[i]),
                           "peak_memory_bytes": float(estimates.peak_memory_bytes[i]), "breakdown": breakdown})
        return stages, f"cost model ({args.hardware})"
    side = frontier_path(args.plan)
    if os.path.isfile(side):
        estimates = read_side_file(side)["stage_estimates"]
        if len(estimates) == plan.pp:
            return estimates, f"tuner predictions in {side}"
    return None


def _number(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or value == float("inf"):
        raise PlanError(f"{where}: expected a finite number >= 0, got {value!r}")
    return float(value)


def read_side_file(path: str) -> dict:
    """The ``<plan>.frontiers.json`` that ``mistc tune -o`` writes, checked: errors name the file and the field."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise PlanError(f"frontiers side file {path}: cannot be read as JSON ({error}); delete it or tune again "
                        f"with -o") from error
    where = f"frontiers side file {path}"
    if not isinstance(data, dict):
        raise PlanError(f"{where}: expected an object, got {type(data).__name__}")
    estimates = data.get("stage_estimates", [])
    if not isinstance(estimates, list):
        raise PlanError(f"{where}: stage_estimates: expected a list, got {type(estimates).__name__}")
    for i, stage in enumerate(estimates):
        field = f"{where}: stage_estimates[{i}]"
        if not isinstance(stage, dict):
            raise PlanError(f"{field}: expected an object, got {stage!r}")
        for key in ("stable_s", "delta_s"):
            stage[key] = _number(stage.get(key), f"{field}.{key}")
        stage["peak_memory_bytes"] = _number(stage.get("peak_memory_bytes", 0), f"{field}.peak_memory_bytes")
        breakdown = stage.get("breakdown", {})
        if not isinstance(breakdown, dict):
            raise PlanError(f"{field}.breakdown: expected an object, got {breakdown!r}")
        stage["breakdown"] = {k: _number(v, f"{field}.breakdown.{k}") for k, v in breakdown.items()}
    frontiers = data.get("frontiers") or []
    if not isinstance(frontiers, list):
        raise PlanError(f"{where}: frontiers: expected a list, got {type(frontiers).__name__}")
    for i, entry in enumerate(frontiers):
        field = f"{where}: frontiers[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("points"), list) or \
                not isinstance(entry.get("chosen"), dict) or not {"stage", "layers", "devices"} <= set(entry):
            raise PlanError(f"{field}: expected an object with stage, layers, devices, points (a list) and chosen")
        for j, point in enumerate([*entry["points"], entry["chosen"]]):
            if not isinstance(point, dict):
                raise PlanError(f"{field}.points[{j}]: expected an object, got {point!r}")
            for key in ("stable_s", "delta_s"):
                _number(point.get(key), f"{field}.points[{j}].{key}")
    data["stage_estimates"], data["frontiers"] = estimates, frontiers
    return data


def model_to_price(plan: Plan, model: str | None) -> str:
    """The model comes from the command line; a plan's ``model`` is only compared with it. A
    built-in zoo name needs no loading, so a plan naming one is priced as it is; anything else a
    plan names (a module to import, a config path) is never loaded from the plan file."""
    from ..models import known_model_names

    if model is not None:
        if model != plan.model:
            raise PlanError(f"plan field model: the plan was made for {plan.model!r}, not for {model!r}")
        return model
    if plan.model in known_model_names():
        return plan.model
    raise PlanError(f"the plan names the model {plan.model!r}; a plan's model is never loaded from the plan file: "
                    f"pass --model {plan.model} to price it")


def forward_backward(stage: dict) -> tuple[float, float]:
    """Split of ``stable`` into forward and backward (the cost model's own split when it gives one)."""
    parts = stage.get("breakdown", {})
    forward, backward = parts.get("forward"), parts.get("backward")
    if forward is not None and backward is not None and forward + backward > 0:
        scale = stage["stable_s"] / (forward + backward)
        return forward * scale, backward * scale
    return stage["stable_s"] / 3, 2 * stage["stable_s"] / 3


def run(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)
    if args.output_dir:
        check_output_dir(args.output_dir, "-o")  # before any work
    print("\n".join(plan_in_words(plan)))
    predictions = stage_predictions(plan, args)
    if predictions is None:
        print("\n(no timing: pass --hardware HW, or tune with -o to get a frontiers side file)")
        return 0
    stages, source = predictions
    formula = pipeline_iteration_time([s["stable_s"] for s in stages], [s["delta_s"] for s in stages], plan.grad_accum)
    halves = [forward_backward(s) for s in stages]
    slots = simulate([f for f, _ in halves], [b for _, b in halves], [s["delta_s"] for s in stages], plan.grad_accum)
    print(f"\npredicted iteration ({source}): {formula:.4f} s by the tuner's formula, {iteration_time(slots):.4f} s "
          f"by the 1F1B timeline simulation")
    print(f"{'stage':>5} {'forward s':>10} {'backward s':>10} {'delta s':>9} {'busy %':>7} {'peak GB':>8}  breakdown")
    total = iteration_time(slots)
    for i, (stage, (forward, backward)) in enumerate(zip(stages, halves)):
        busy = (plan.grad_accum * (forward + backward) + stage["delta_s"]) / total if total > 0 else 0.0
        parts = ", ".join(f"{k} {v:.4g}" for k, v in sorted(stage.get("breakdown", {}).items())
                          if k not in ("forward", "backward"))
        print(f"{i:>5} {forward:>10.4f} {backward:>10.4f} {stage['delta_s']:>9.4f} {busy:>7.1%} "
              f"{stage.get('peak_memory_bytes', 0) / 1e9:>8.2f}  {parts}")
    if args.output_dir:
        check_output_dir(args.output_dir, "-o")
        names = [f"stage {i}: layers {s.layers[0]}..{s.layers[1] - 1}, {s.devices} GPUs" for i, s in enumerate(plan.stages)]
        trace = os.path.join(args.output_dir, "timeline.json")
        write_chrome_trace(slots, trace, names)
        picture = os.path.join(args.output_dir, "timeline.png")
        plot_timeline(slots, picture, f"{plan.model}: predicted 1F1B iteration, {total:.3f} s")
        written = [trace, picture]
        side = frontier_path(args.plan)
        if os.path.isfile(side):
            frontiers = read_side_file(side)
            if frontiers.get("frontiers"):
                path = os.path.join(args.output_dir, "frontiers.png")
                plot_frontiers({"grad_accum": frontiers.get("grad_accum"), "stages": frontiers["frontiers"]}, path)
                written.append(path)
        print("\nwrote " + ", ".join(written))
    return 0
