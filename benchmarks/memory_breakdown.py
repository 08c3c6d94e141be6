"""Where the memory of Mist's base case goes: our runtime, part by part, against Mist's (issue 16).

The plan (Mist's README, FACTS.md "Mist's own base case"): GPT-1.3B, sequence 2048, global batch
32, micro-batch 8, DP 2, ZeRO-1 (optimizer states sharded), all 24 layers checkpointed, fp16,
math attention, 2 L4 GPUs (so 2 micro-batches per step). Mist's runtime measured 19,273.83 "MB"
peak allocated; its analysis said 19,255 (forward) and 19,503 (backward). Mist's MB are mebibytes
(``torch.cuda.max_memory_allocated() / 2**20``, ``mist/utils/common.py``): 20,210 / 20,190 / 20,450 MB
of 1e6 bytes, the unit of every column here.

Columns (MB, 1 MB = 1e6 bytes):
- ``seed``: our runtime as it was: the LM head's fp32 logits and the unfused loss, fp32 gradient
  accumulators (today's cost model with the loss left unfused and ``grad_dtype`` float32: it
  reproduces the seed's 28,655 MB, whose peak was the loss backward);
- ``now``: the fused, chunked head + loss (``mist::linear_cross_entropy``) and the plan's
  ``grad_dtype`` float16 (ZeRO-1 keeps the micro-batches' gradients in the fp16 buffer, as Mist);
- ``Mist``: closed forms of what Mist's runtime keeps (its ``gpt.py`` / ``losses.py``: the head's
  fp16 logits into Megatron's vocab-parallel cross-entropy, which exponentiates a shifted copy in
  place and saves it as the softmax; fp16 ``.grad``; ZeRO-1 shards the fp32 master and moments).
  Its activation rows at its backward peak are what its own analysis implies (19,503 minus the
  states and the checkpoint inputs), a closed form beside them for the reader.

Runtime status: the fused loss runs wherever the captured graph runs (``torch.compile(backend="mist")``
without a plan today; every plan once the lowering runs the captured graph); plans executed through
the fx re-trace still compute the unfused loss (the ``fused loss`` / ``now`` columns' logits row is
then the seed's). ``grad_dtype`` and the attention accounting hold for every runtime path.

Each of our columns is read off the cost model at its peak point (``mistc analyze``'s numbers);
the activation part is split into the checkpointed layers' inputs and the block running at that
point, and the rows are checked to add up to the model's peak. Every formula is printed.

Usage: ``PYTHONPATH=. python benchmarks/memory_breakdown.py``
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

import numpy as np
import sympy

from mist_compiler.cost.analyze import plan_candidates
from mist_compiler.cost.stage_model import build_stage_cost_model
from mist_compiler.frontend.joint import loss_fusion
from mist_compiler.ir.plan import Offload, Plan, StagePlan
from mist_compiler.models import parameter_count, zoo_config
from mist_compiler.passes.cost_annotation import B, S, T

MB = 1e6
MODEL, SEQ, MICRO, DP, GRAD_ACCUM, HARDWARE = "gpt2-1.3b", 2048, 8, 2, 2, "l4"
MIB = 2 ** 20
MIST_MEASURED, MIST_FORWARD, MIST_BACKWARD = (mib * MIB / MB for mib in (19_273.83, 19_255.0, 19_503.0))


def base_plan(grad_dtype: str) -> Plan:
    stage = StagePlan(layers=(0, 24), nodes=1, gpus_per_node=DP, micro_batch=MICRO, dp=DP, tp=1, zero=1,
                      ckpt_layers=24, offload=Offload())
    return Plan(MODEL, SEQ, MICRO * DP * GRAD_ACCUM, "float16", GRAD_ACCUM, (stage,), grad_dtype)


@dataclass
class Column:
    """One of our configurations at its predicted peak point."""

    name: str
    parts: dict[str, float]  # row -> MB
    point: str
    peak: float


def _value(expr, b: int = MICRO, s: int = SEQ) -> float:
    return float(sympy.sympify(expr).subs({B: b, S: s, T: 1}))


def _largest(exprs) -> float:
    return max((_value(e) for e in exprs), default=0.0)


def our_column(name: str, fused: bool, grad_dtype: str) -> Column:
    """Our cost model's peak for the base plan, split into the breakdown's rows."""
    with loss_fusion(fused):
        from mist_compiler.cost.analysis import analyse_program
        from mist_compiler.driver import capture as capture_program

        blocks, layers = analyse_program(capture_program(MODEL, seq_len=SEQ, dtype="float16"))
    from mist_compiler.cost.stage_model import StageCostModel
    from mist_compiler.cost.hardware import load_profile

    model = StageCostModel(blocks, load_profile(HARDWARE), SEQ, "float16", "math", MODEL, layers)
    estimate = model.evaluate(plan_candidates(base_plan(grad_dtype)))
    part = {key: float(value[0]) / MB for key, value in estimate.breakdown.items()}
    layer, post = blocks["layer"].memory, blocks["post"].memory
    checkpoint_input = _value(layer.input) / MB
    loss_forward = _largest(post.forward_peaks["math"]) / MB
    loss_backward = _largest(post.backward_peaks["math"]) / MB
    recomputed = max(_largest(layer.forward_peaks["math"]), _largest(layer.backward_peaks["math"])) / MB
    pre = _value(blocks["pre"].memory.saved["math"]) / MB
    candidates = {  # (activation MB at the point, checkpointed inputs alive, row of the running block)
        "the loss forward": (24 * checkpoint_input + loss_forward, 24, "logits and loss"),
        "the loss backward": (24 * checkpoint_input + loss_backward, 24, "logits and loss"),
        "layer 23 recomputed + backward": (23 * checkpoint_input + pre + recomputed, 23, "recomputed layer"),
    }
    point, (value, inputs, row) = min(candidates.items(), key=lambda item: abs(item[1][0] - part["acts"]))
    if abs(value - part["acts"]) > 0.5:
        raise AssertionError(f"{name}: activations at the peak ({part['acts']:.1f} MB) are none of {candidates}")
    parts = {"weights": part["params"], "gradients": part["grads"], "optimizer shards": part["opt"],
             "checkpoint inputs": inputs * checkpoint_input + (pre if row == "recomputed layer" else 0.0),
             "recomputed layer": 0.0, "logits and loss": 0.0, "communication / prefetch buffers": part["buffers"]}
    parts[row] = part["acts"] - parts["checkpoint inputs"]
    total = sum(parts.values())
    if abs(total - part["params"] - part["grads"] - part["opt"] - part["buffers"] - part["acts"]) > 0.5 \
            or abs(total * MB - float(estimate.peak_memory_bytes[0])) > 0.5 * MB:
        raise AssertionError(f"{name}: the rows add up to {total:.1f} MB, the model says "
                             f"{float(estimate.peak_memory_bytes[0]) / MB:.1f}")
    return Column(name, parts, point, total)


def mist_column() -> tuple[dict[str, float], list[str]]:
    """Closed forms of Mist's runtime (module docstring); its rows at its backward peak."""
    cfg = zoo_config(MODEL, SEQ)
    p = parameter_count(cfg)
    b, s, h, v, a = MICRO, SEQ, cfg.hidden, cfg.vocab, cfg.heads
    hidden = b * s * h * 2 / MB
    states = {"weights": 2 * p / MB, "gradients": 2 * p / MB, "optimizer shards": 12 * p / DP / MB}
    static = sum(states.values())
    logits = b * s * v * 2 / MB
    layer_saved = (32 * b * s * h + 2 * a * b * s * s) / MB  # Megatron's sbh(34 + 5as/h) bytes less its dropout terms
    implied_layer = MIST_BACKWARD - static - 23 * hidden
    rows = {**states, "checkpoint inputs": 23 * hidden, "recomputed layer": implied_layer, "logits and loss": 0.0,
            "communication / prefetch buffers": 0.0}
    notes = [
        f"P = {p:,} parameters; b*s*h*2 = {hidden:,.1f} MB (one checkpointed layer's fp16 input)",
        f"weights 2P, fp16 .grad 2P, fp32 master + Adam moments 12P/dp (dp = {DP}): {static:,.1f} MB",
        f"forward peak, at the loss: 24 inputs {24 * hidden:,.1f} + fp16 logits b*s*V*2 {logits:,.1f} + their shifted, "
        f"exponentiated copy {logits:,.1f} = {24 * hidden + 2 * logits:,.1f} MB of activations; the states + this = "
        f"{static + 24 * hidden + 2 * logits:,.1f} MB (Mist's analysis: {MIST_FORWARD:,.0f})",
        f"backward peak, layer 23 recomputed: {MIST_BACKWARD:,.0f} - states {static:,.1f} - 23 inputs {23 * hidden:,.1f} "
        f"= {implied_layer:,.1f} MB for the recomputed layer: its saved activations (Megatron's sbh(34+5as/h) bytes "
        f"less the dropout terms: 32sbh + 2as^2b = {layer_saved:,.1f} MB) and, in its backward, the gradient of the "
        f"probabilities (2as^2b = {2 * a * b * s * s / MB:,.1f} MB; Megatron's fused softmax backward runs in place)",
        f"the fp16 softmax of the loss ({logits:,.1f} MB) is released by the loss backward, before layer 23's recompute",
    ]
    return rows, notes


def our_notes() -> list[str]:
    cfg = zoo_config(MODEL, SEQ)
    p = parameter_count(cfg)
    b, s, h, v, a = MICRO, SEQ, cfg.hidden, cfg.vocab, cfg.heads
    probs = 2 * a * b * s * s / MB
    return [
        f"weights 2P = {2 * p / MB:,.1f}; optimizer 12P/dp = {12 * p / DP / MB:,.1f}",
        f"gradients: seed 4P = {4 * p / MB:,.1f} (an fp32 accumulator of every parameter from the first micro-batch to "
        f"the last reduce-scatter; at the fused-loss column's point, the last micro-batch's, the head's accumulator is "
        f"already traded for its 1/dp shard and the running layer adds its fp16 buffer); now 2P = {2 * p / MB:,.1f} "
        f"(the fp16 buffers, which accumulate; the last micro-batch casts each unit to fp32 only to reduce it)",
        f"logits and loss, seed: the loss backward holds the fp32 log-probabilities, the NLL gradient and the "
        f"log-softmax gradient, 3 x b*s*V*4 = {3 * b * s * v * 4 / MB:,.1f}, and the final norm's and head's "
        f"inputs and statistics (the rest of the row)",
        f"logits and loss, now (at its own points, not the peak): a chunk of ~N*H logits b*s*h*2 = "
        f"{b * s * h * 2 / MB:,.1f}; backward also the fp32 [V, H] weight-gradient accumulator {v * h * 4 / MB:,.1f} "
        f"and one fp32 ~N*H product {b * s * h * 4 / MB:,.1f}",
        f"recomputed layer (torch's math SDPA): saved 32sbh + 2as^2b = {(32 * b * s * h * 1 + 2 * a * b * s * s) / MB:,.1f}; "
        f"at the softmax backward also the probabilities' and the scores' gradients (2 x {probs:,.1f}), while the "
        f"MLP's and the output projection's saved tensors are already released",
    ]


def main() -> int:
    columns = [our_column("seed", fused=False, grad_dtype="float32"),
               our_column("fused loss", fused=True, grad_dtype="float32"),
               our_column("now", fused=True, grad_dtype="float16")]
    mist, notes = mist_column()
    rows = list(mist)
    print(f"Mist's base case: {MODEL}, seq {SEQ}, micro-batch {MICRO}, DP {DP}, ZeRO-1, 24/24 layers checkpointed, "
          f"fp16, math attention, {GRAD_ACCUM} micro-batches per step ({HARDWARE} profile)\n")
    header = f"{'part (MB)':<34}" + "".join(f"{c.name:>13}" for c in columns) + f"{'Mist (bwd)':>13}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row:<34}" + "".join(f"{c.parts[row]:>13,.1f}" for c in columns) + f"{mist[row]:>13,.1f}")
    print("-" * len(header))
    print(f"{'peak':<34}" + "".join(f"{c.peak:>13,.1f}" for c in columns)
          + f"{sum(mist.values()):>13,.1f}")
    print(f"{'peak point':<34}" + "".join(f"{c.point[:12]:>13}" for c in columns) + f"{'layer 23':>13}")
    print(f"\nMist measured {MIST_MEASURED:,.2f} MB; ours now {columns[-1].peak:,.1f} MB "
          f"({columns[-1].peak / MIST_MEASURED - 1:+.2%}); the seed {columns[0].peak:,.1f} MB "
          f"({columns[0].peak / MIST_MEASURED - 1:+.2%})\n")
    for column in columns:
        print(f"{column.name}: peak at {column.point}")
    print("\nOurs (closed forms; the cost model's numbers above are the same sums):")
    for note in our_notes():
        print(f"  {note}")
    print("\nMist (closed forms):")
    for note in notes:
        print(f"  {note}")
    print("\nWhat changed between the columns:")
    print("  seed -> fused loss: the head's fp32 logits and the loss's log-softmax, its gradient and the logits' gradient\n"
          "    (3 x b*s*V*4 at the loss backward) give way to mist::linear_cross_entropy: chunks of ~N*H logits; the\n"
          "    peak moves to the recomputed layer. The math attention's score tensors are charged at the attention\n"
          "    op's own points (the seed's analysis put 3 of them on top of everything the layer saves: 4,296 MB).")
    print("  fused loss -> now: grad_dtype float16: the 2 micro-batches accumulate in the fp16 buffer (2P) instead\n"
          "    of an fp32 accumulator of every parameter (4P); the last micro-batch reduces each unit in fp32.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
