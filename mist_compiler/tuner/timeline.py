"""A predicted timeline of one training iteration under 1F1B, as events, Chrome trace and PNG.

Each stage runs ``G`` forward and ``G`` backward slots (its predicted forward / backward time per
micro-batch) in the 1F1B order: ``min(S - i - 1, G)`` warm-up forwards, then one forward / one
backward alternately, then the remaining backwards. A forward waits for the previous stage's
forward of the same micro-batch, a backward for the next stage's backward. After its last
backward each stage does its per-iteration ``delta`` work (gradient sync, optimizer step).
"""
from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Slot:
    stage: int
    kind: str  # "F", "B" or "step"
    micro_batch: int  # -1 for the step
    start_s: float
    end_s: float


def one_f_one_b_order(stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    warmup = min(stages - stage - 1, micro_batches)
    order = [("F", m) for m in range(warmup)]
    for m in range(micro_batches - warmup):
        order += [("F", warmup + m), ("B", m)]
    order += [("B", m) for m in range(micro_batches - warmup, micro_batches)]
    return order


def simulate(forward_s: list[float], backward_s: list[float], delta_s: list[float], micro_batches: int) -> list[Slot]:
    """Start and end of every slot, stage by stage, honouring the pipeline dependencies."""
    stages = len(forward_s)
    orders = [one_f_one_b_order(i, stages, micro_batches) for i in range(stages)]
    done: dict[tuple[str, int, int], float] = {}
    position = [0] * stages
    free = [0.0] * stages
    slots: list[Slot] = []
    remaining = sum(len(order) for order in orders)
    while remaining:
        progressed = False
        for i in range(stages):
            while position[i] < len(orders[i]):
                kind, m = orders[i][position[i]]
                dependency = ("F", i - 1, m) if kind == "F" and i > 0 else ("B", i + 1, m) if kind == "B" and i < stages - 1 else None
                if kind == "B" and i == stages - 1:
                    dependency = ("F", i, m)
                if dependency is not None and dependency not in done:
                    break
                start = max(free[i], done.get(dependency, 0.0))
                end = start + (forward_s[i] if kind == "F" else backward_s[i])
                done[(kind, i, m)] = end
                free[i] = end
                slots.append(Slot(i, kind, m, start, end))
                position[i] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("1F1B simulation deadlocked (inconsistent schedule)")
    for i in range(stages):
        slots.append(Slot(i, "step", -1, free[i], free[i] + delta_s[i]))
    return slots


def iteration_time(slots: list[Slot]) -> float:
    return max(slot.end_s for slot in slots)


def chrome_trace(slots: list[Slot], stage_names: list[str] | None = None) -> dict:
    """Chrome trace-event JSON (opens in Perfetto / chrome://tracing); times in microseconds."""
    events = []
    for i in sorted({slot.stage for slot in slots}):
        name = stage_names[i] if stage_names else f"stage {i}"
        events.append({"name": "process_name", "ph": "M", "pid": i, "tid": 0, "args": {"name": name}})
    for slot in slots:
        label = "optimizer step + grad sync" if slot.kind == "step" else f"{slot.kind}{slot.micro_batch}"
        events.append({
            "name": label, "cat": {"F": "forward", "B": "backward", "step": "step"}[slot.kind], "ph": "X",
            "ts": slot.start_s * 1e6, "dur": (slot.end_s - slot.start_s) * 1e6, "pid": slot.stage, "tid": 0,
            "args": {"micro_batch": slot.micro_batch},
        })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(slots: list[Slot], path: str, stage_names: list[str] | None = None) -> None:
    with open(path, "w") as handle:
        json.dump(chrome_trace(slots, stage_names), handle)


def plot_timeline(slots: list[Slot], path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = max(slot.stage for slot in slots) + 1
    fig, ax = plt.subplots(figsize=(12, 0.6 * stages + 1.5))
    colours = {"F": "#4c72b0", "B": "#dd8452", "step": "#55a868"}
    for kind in ("F", "B", "step"):
        for slot in (s for s in slots if s.kind == kind):
            ax.broken_barh([(slot.start_s, slot.end_s - slot.start_s)], (slot.stage - 0.4, 0.8),
                           facecolors=colours[kind], edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(stages))
    ax.set_yticklabels([f"stage {i}" for i in range(stages)])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title or "predicted 1F1B iteration (blue forward, orange backward, green step)")
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
