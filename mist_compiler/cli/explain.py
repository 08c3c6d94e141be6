"""mistc explain PLAN [--model M] [--hardware HW] [-o DIR]: a plan in words, its breakdown and timeline.

Says what every stage does and which schedule runs them, and — with per-stage predictions from
``--hardware`` (the cost model) or from the ``<plan>.frontiers.json`` side file that ``mistc tune
-o`` writes — the per-stage breakdown and the predicted timeline of one iteration under the
plan's schedule (its action lists simulated, ``cost/schedule.py``). With ``-o DIR`` it writes
``timeline.json`` (Chrome trace; open in Perfetto), ``timeline.png`` and, when the side file
exists, ``frontiers.png`` (the Pareto frontiers the tuner chose from).
"""
from __future__ import annotations

import argparse
import json
import os

from ..cost.schedule import Simulation, simulate_estimates
from ..cost.stage_api import pipeline_iteration_time
from ..ir.files import check_output_dir
from ..ir.plan import Plan, PlanError, load_plan
from ..ir.schedule import SCHEDULES, action_table, build_schedule
from ..ir.vocabulary import ATTENTION_KERNELS
from ..tuner.report import describe_stage, frontier_path
from ..tuner.timeline import iteration_time, plot_frontiers, plot_timeline, timeline_slots, write_chrome_trace


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", help="plan file (JSON or YAML)")
    parser.add_argument("--model", help="model to price the plan with (default: the plan's model)")
    parser.add_argument("--hardware", help="hardware profile: price the plan with the cost model")
    parser.add_argument("--attention", choices=ATTENTION_KERNELS, default="flash", help="target attention kernel")
    parser.add_argument("-o", "--output-dir", help="write timeline.json, timeline.png and frontiers.png here")


def plan_in_words(plan: Plan) -> list[str]:
    chunks = (f", each group of devices running {plan.virtual_stages} of the {len(plan.stages)} stages"
              if plan.virtual_stages > 1 else "")
    lines = [
        f"{plan.model} trained with global batch {plan.global_batch} x {plan.seq_len} tokens ({plan.dtype}) on "
        f"{plan.world_size} devices as a {plan.pp}-stage pipeline{chunks}; each stage accumulates gradients over "
        f"{plan.grad_accum} micro-batch step(s) (schedule {plan.schedule}: {SCHEDULES[plan.schedule].summary}).",
    ]
    for i, stage in enumerate(plan.stages):
        where = f" (devices of stage {plan.placement[i]})" if plan.virtual_stages > 1 else ""
        lines.append("  " + describe_stage(i, stage, plan.grad_accum) + where)
    schedule = build_schedule(plan.schedule, plan.pp, plan.virtual_stages, plan.grad_accum)
    if sum(len(actions) for actions in schedule.actions) <= 400:  # small enough to read
        lines += ["", "actions (F forward, B backward, I/W its input/weight halves; .c: chunk c):"]
        lines += ["  " + line for line in action_table(schedule)]
    return lines


def stage_predictions(plan: Plan, args: argparse.Namespace) -> tuple[list[dict], Simulation, str] | None:
    """Per-stage stable/delta/memory and the simulated schedule, from the cost model or the side file."""
    if args.hardware:
        from .. import driver
        from ..cost.schedule import price_plan

        program = driver.capture(model_to_price(plan, args.model), dtype=plan.dtype, attention=args.attention,
                                 seq_len=plan.seq_len)
        driver.check_plan(program, plan, prove=False)  # layers, positions, tp degrees: as analyze and run refuse
        cost_model = driver.analyse(program, args.hardware, seq_len=plan.seq_len, attention=args.attention)
        price = price_plan(cost_model, plan, spans=True)
        stages = []
        for i in range(len(plan.stages)):
            group = plan.placement[i]
            breakdown = {k: float(v[i]) for k, v in price.chunks.breakdown.items()}
            stages.append({"stable_s": float(price.chunks.stable_s[i]), "delta_s": float(price.delta_s[group]),
                           "peak_memory_bytes": float(price.peak_memory_bytes[group]), "breakdown": breakdown})
        return stages, price.simulation, f"cost model ({args.hardware})"
    side = frontier_path(args.plan)
    if os.path.isfile(side):
        estimates = read_side_file(side)["stage_estimates"]
        if len(estimates) == len(plan.stages):
            delta = [estimates[plan.chunks(group)[0]]["delta_s"] for group in range(plan.pp)]
            simulation = simulate_estimates(plan, [s["stable_s"] for s in estimates],
                                            [s.get("breakdown", {}) for s in estimates], delta)
            return estimates, simulation, f"tuner predictions in {side}"
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


def run(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)
    if args.output_dir:
        check_output_dir(args.output_dir, "-o")  # before any work
    side = frontier_path(args.plan)
    if args.hardware:  # bad input is named before anything is printed
        from ..cost.hardware import load_profile

        load_profile(args.hardware)
    elif os.path.isfile(side):
        read_side_file(side)
    print("\n".join(plan_in_words(plan)))
    predictions = stage_predictions(plan, args)
    if predictions is None:
        print("\n(no timing: pass --hardware HW, or tune with -o to get a frontiers side file)")
        return 0
    stages, simulation, source = predictions
    delta = [stages[plan.chunks(group)[0]]["delta_s"] for group in range(plan.pp)]
    slots = timeline_slots(simulation, delta)
    total = iteration_time(slots)
    line = f"\npredicted iteration ({source}): {total:.4f} s by simulating the {plan.schedule} schedule"
    if plan.schedule == "1f1b":
        formula = pipeline_iteration_time([s["stable_s"] for s in stages], [s["delta_s"] for s in stages],
                                          plan.grad_accum)
        line += f" ({formula:.4f} s by 1F1B's closed form)"
    print(line)
    print(f"{'stage':>5} {'devices':>7} {'stable s':>9} {'delta s':>9} {'busy %':>7} {'in flight':>9} {'peak GB':>8}")
    for i, stage in enumerate(stages):
        group = plan.placement[i]
        busy = (float(simulation.busy_s[group, 0]) + delta[group]) / total if total > 0 else 0.0
        print(f"{i:>5} {group:>7} {stage['stable_s']:>9.4f} {stage['delta_s']:>9.4f} {busy:>7.1%} "
              f"{float(simulation.inflight[group, 0]):>9.2f} {stage.get('peak_memory_bytes', 0) / 1e9:>8.2f}")
    if args.output_dir:
        check_output_dir(args.output_dir, "-o")
        names = [f"stage {g}: " + ", ".join(f"layers {plan.stages[j].layers[0]}..{plan.stages[j].layers[1] - 1}"
                                            for j in plan.chunks(g)) + f", {plan.stages[g].devices} GPUs"
                 for g in range(plan.pp)]
        trace = os.path.join(args.output_dir, "timeline.json")
        write_chrome_trace(slots, trace, names)
        picture = os.path.join(args.output_dir, "timeline.png")
        plot_timeline(slots, picture, f"{plan.model}: predicted {plan.schedule} iteration, {total:.3f} s")
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
