"""The price of a per-tensor activation policy: what a layer keeps, moves to the host and recomputes.

A policy (``ir.plan.ActivationPolicy``: nodes recomputed, fractions offloaded) is priced on the
layer's saved-tensor table (``passes.saved_tensors``, without or with sequence parallelism) exactly
as ``runtime.saved_activations`` runs it:

- **kept** (device bytes between a layer's forward and its backward): every node's saved bytes,
  less those of recomputed nodes and the offloaded fractions, plus the outputs the recomputation
  starts from (``held``: inputs of recomputed nodes that are not recomputed themselves) where autograd
  does not keep them anyway; a held value that autograd keeps is offloaded like any saved tensor (the
  runtime then holds the host copy, not the device storage, and brings it back for the replay);
- **offloaded** (bytes out in the forward, back in the backward): the fractions of the other nodes;
- **recompute** (seconds in the backward): the recomputed nodes' ops at the profile's op-class rates,
  plus the per-op overhead.
Everything is symbolic in ``b``, ``s``, ``t`` and evaluated per candidate by the stage model; the
activation MILP (``tuner.activation_milp``) reads the same numbers at one point (:func:`rows_at`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import sympy

from ..ir.plan import ActivationPolicy
from ..ir.vocabulary import B, S, T
from .block_functions import lambdify_bst
from .op_time import op_class_time


def held_values(table, recompute: set[str]) -> list[str]:
    """The values a recomputation of ``recompute`` starts from (read by a recomputed node, not recomputed)."""
    held: list[str] = []
    for tag in recompute:
        row = table.tensors.get(tag)
        for source in row.inputs if row is not None else ():
            if source not in recompute and source not in held:
                held.append(source)
    return held


def policy_bytes(table, policy: ActivationPolicy) -> tuple[sympy.Expr, sympy.Expr]:
    """(kept, offloaded) bytes per layer and micro-batch of ``policy`` on ``table`` (module docstring)."""
    recompute = set(policy.recompute)
    held = set(held_values(table, recompute))
    fractions = policy.offload_fractions
    kept, offloaded = sympy.Integer(0), sympy.Integer(0)
    for tag, row in table.tensors.items():
        if tag in recompute:
            continue
        fraction = fractions.get(tag, 0.0)
        kept += row.saved * (1 - fraction)
        offloaded += row.saved * fraction
        if tag in held and not row.output_saved and not shared_input(table, tag):
            kept += row.output
    return sympy.expand(kept), sympy.expand(offloaded)


def shared_input(table, tag: str) -> bool:
    """A layer input other than its hidden state (every layer reads it: holding it costs a layer nothing)."""
    return table.tensors[tag].kind == "input" and tag != next(iter(table.tensors))


def recompute_cost(table, recompute) -> tuple[dict[str, tuple[sympy.Expr, sympy.Expr]], int]:
    """FLOPs and bytes per op class of the recomputed nodes' ops, and how many ops they launch."""
    classes: dict[str, tuple[sympy.Expr, sympy.Expr]] = {}
    ops = 0
    for tag in recompute:
        row = table.tensors.get(tag)
        if row is None:
            continue
        ops += row.ops
        for op_class, flops, nbytes in row.cost:
            old = classes.get(op_class, (sympy.Integer(0), sympy.Integer(0)))
            classes[op_class] = (old[0] + flops, old[1] + nbytes)
    return classes, ops


def _function(expr: sympy.Expr) -> Callable:
    return lambdify_bst(expr)  # one numpy function per distinct expression in a process (policies share many)


@dataclass
class PolicyPrice:
    """A policy's lambdified price on one layer table."""

    kept: Callable
    offloaded: Callable
    classes: dict[str, tuple[Callable, Callable]]
    ops: int

    @classmethod
    def of(cls, table, policy: ActivationPolicy) -> "PolicyPrice":
        kept, offloaded = policy_bytes(table, policy)
        classes, ops = recompute_cost(table, policy.recompute)
        return cls(_function(kept), _function(offloaded),
                   {c: (_function(f), _function(b)) for c, (f, b) in classes.items()}, ops)

    def terms(self, hardware, dtype: str, b: np.ndarray, s: np.ndarray, t: np.ndarray) -> dict[str, np.ndarray]:
        """kept and offloaded bytes, recompute seconds, per candidate."""
        seconds = np.full(np.shape(b), self.ops * hardware.op_overhead, dtype=float)
        for op_class, (flops, nbytes) in self.classes.items():
            seconds = seconds + op_class_time(hardware, dtype, op_class, flops(b, s, t), nbytes(b, s, t))
        return {"kept": self.kept(b, s, t), "offloaded": self.offloaded(b, s, t), "recompute": seconds}


@dataclass(frozen=True)
class CopyRates:
    """What offloaded bytes cost a layer: host bandwidths and the compute its copies overlap with."""

    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    forward_s: float  # the layer's forward compute (the copies out overlap it)
    backward_s: float  # its backward compute (the copies back overlap it)

    def exposed(self, offloaded: float) -> float:
        if offloaded <= 0:
            return 0.0
        return (max(0.0, offloaded / self.d2h_bytes_per_s - self.forward_s)
                + max(0.0, offloaded / self.h2d_bytes_per_s - self.backward_s))


@dataclass(frozen=True)
class TensorRow:
    """One row of the table at one (b, s, t): what the activation MILP reads."""

    tag: str
    kind: str
    saved: float
    output: float
    output_saved: bool
    seconds: float  # running the node again
    inputs: tuple[str, ...]
    recomputable: bool
    offloadable: bool
    shared: bool = False  # a layer input every layer reads (holding it costs this layer nothing)
    tp_reduced: bool = False  # a row-parallel output or reads one (recomputable here only with one TP rank)


def rows_at(table, hardware, dtype: str, micro_batch: int, seq: int, degree: int) -> list[TensorRow]:
    """The table's rows priced at ``(b, s, t)`` for the MILP. With ``t`` > 1 a row-parallel output (and
    what reads it) is not offered for recomputation: its replay would all-reduce again, a collective the
    recompute price leaves out; with one rank it is a plain matmul (the residual after it can go too)."""
    values = {B: micro_batch, S: seq, T: degree}
    rows = []
    for tag, row in table.tensors.items():
        seconds = len(row.cost) * hardware.op_overhead
        for op_class, flops, nbytes in row.cost:
            seconds += float(op_class_time(hardware, dtype, op_class, float(sympy.sympify(flops).subs(values)),
                                           float(sympy.sympify(nbytes).subs(values))))
        rows.append(TensorRow(tag, row.kind, float(sympy.sympify(row.saved).subs(values)),
                              float(sympy.sympify(row.output).subs(values)), row.output_saved, seconds, row.inputs,
                              row.recomputable and not (degree > 1 and row.tp_reduced), row.offloadable,
                              shared_input(table, tag), row.tp_reduced))
    return rows


__all__ = ["CopyRates", "PolicyPrice", "TensorRow", "held_values", "policy_bytes", "recompute_cost", "rows_at", "shared_input"]
