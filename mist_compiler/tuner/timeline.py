"""A predicted timeline of one training iteration under the plan's schedule, as events, Chrome trace and PNG.

The slots come from the schedule simulation of the cost model (``cost/schedule.py``): every
action of every stage (``F`` forward, ``B`` whole backward, ``I`` / ``W`` its input and weight
halves; a chunk's virtual stage is named when stages share devices) with its predicted start and
end, then each stage's per-iteration ``delta`` work (gradient sync, optimizer step) after its last
action.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from ..cost.schedule import Simulation


@dataclass(frozen=True)
class Slot:
    stage: int
    kind: str  # "F", "B", "I", "W" or "step"
    micro_batch: int  # -1 for the step
    start_s: float
    end_s: float
    chunk: int = 0  # which of the stage's virtual stages


def timeline_slots(simulation: Simulation, delta_s: np.ndarray, column: int = 0) -> list[Slot]:
    """The simulated actions of candidate ``column`` as slots, then each stage's step."""
    schedule = simulation.schedule
    slots = []
    for stage, spans in enumerate(simulation.spans):
        for action, (kind, start, end) in zip(schedule.compute(stage), spans):
            slots.append(Slot(stage, kind, action.micro, float(start[column]), float(end[column]), action.chunk))
        finish = float(simulation.finish_s[stage, column])
        slots.append(Slot(stage, "step", -1, finish, finish + float(np.asarray(delta_s)[stage]), 0))
    return slots


def iteration_time(slots: list[Slot]) -> float:
    return max(slot.end_s for slot in slots)


CATEGORIES = {"F": "forward", "B": "backward", "I": "backward (input half)", "W": "backward (weight half)",
              "step": "step"}
COLOURS = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#8172b3", "step": "#55a868"}


def chrome_trace(slots: list[Slot], stage_names: list[str] | None = None) -> dict:
    """Chrome trace-event JSON (opens in Perfetto / chrome://tracing); times in microseconds."""
    events = []
    for i in sorted({slot.stage for slot in slots}):
        name = stage_names[i] if stage_names else f"stage {i}"
        events.append({"name": "process_name", "ph": "M", "pid": i, "tid": 0, "args": {"name": name}})
    for slot in slots:
        label = ("optimizer step + grad sync" if slot.kind == "step"
                 else f"{slot.kind}{slot.micro_batch}" + (f".{slot.chunk}" if slot.chunk else ""))
        events.append({
            "name": label, "cat": CATEGORIES[slot.kind], "ph": "X",
            "ts": slot.start_s * 1e6, "dur": (slot.end_s - slot.start_s) * 1e6, "pid": slot.stage, "tid": 0,
            "args": {"micro_batch": slot.micro_batch, "chunk": slot.chunk},
        })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(slots: list[Slot], path: str, stage_names: list[str] | None = None) -> None:
    with open(path, "w") as handle:
        json.dump(chrome_trace(slots, stage_names), handle)


def plot_timeline(slots: list[Slot], path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.patches
    import matplotlib.pyplot as plt

    stages = max(slot.stage for slot in slots) + 1
    fig, ax = plt.subplots(figsize=(12, 0.6 * stages + 1.5))
    for kind in COLOURS:
        for slot in (s for s in slots if s.kind == kind):
            shade = 0.8 if slot.chunk % 2 == 0 else 0.55  # a stage's chunks told apart
            ax.broken_barh([(slot.start_s, slot.end_s - slot.start_s)], (slot.stage - 0.4, 0.8),
                           facecolors=COLOURS[kind], alpha=shade, edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(stages))
    ax.set_yticklabels([f"stage {i}" for i in range(stages)])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title or "predicted iteration")
    ax.legend(handles=[matplotlib.patches.Patch(color=COLOURS[k], label=CATEGORIES[k]) for k in COLOURS
                       if any(s.kind == k for s in slots)], fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_frontiers(frontiers: dict, path: str) -> None:
    """Each stage's Pareto frontier of (stable, delta), the chosen point marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = frontiers.get("stages", [])
    fig, ax = plt.subplots(figsize=(7, 5))
    for entry in stages:
        points = sorted((p["stable_s"], p["delta_s"]) for p in entry["points"])
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", markersize=3, linewidth=1,
                    label=f"stage {entry['stage']} ({entry['layers']} layers, {entry['devices']} GPUs)")
        chosen = entry["chosen"]
        ax.plot([chosen["stable_s"]], [chosen["delta_s"]], marker="*", markersize=12, color="black")
    ax.set_xlabel("stable: one micro-batch forward+backward (s)")
    ax.set_ylabel("delta: per-iteration extra work (s)")
    ax.set_title(f"Pareto frontiers considered (G = {frontiers.get('grad_accum')}); star = chosen")
    if stages:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
