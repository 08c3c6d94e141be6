"""Per-tensor activation policies as the stage model prices them: the layer's saved-tensor table, the
policies candidates may name (``act_policy``), and each candidate's kept / offloaded bytes and recompute
seconds, gathered once per distinct (policy, micro-batch, tp, sp); in a compiled model, the eager layer's
terms for those candidates (:func:`policy_layers_eager`). A mixin of
:class:`~mist_compiler.cost.stage_model.StageCostModel`, whose fields (``blocks``, ``policies``, the
profile and the caches) it reads."""
from __future__ import annotations

import numpy as np

from .activation_policy import CopyRates, PolicyPrice, rows_at
from .block_functions import SEQUENCE_LAYER
from .blocks import StageModelError
from .stage_api import StageCandidates


EAGER_LAYER, EAGER_SEQUENCE_LAYER = "eager_layer", "eager_layer_sp"  # a compiled model's layer run eagerly
COMPUTE_TERMS = ("forward_compute", "backward_compute", "weight_compute")


def policy_layers_eager(per_kind: dict, c: StageCandidates) -> dict:
    """The layer terms of candidates with a per-tensor policy from the eager layer (a compiled model's
    unit with a policy runs its eager program: ``lowering.compile``); the eager terms dropped after.
    Their checkpointed layers have no policy and stay compiled: a layer's compute is the mean over the
    stage's layers (the recomputation of checkpointed layers is priced from that mean too)."""
    eager = per_kind.pop(EAGER_LAYER, None)
    with_policy = np.asarray(c.act_policy) >= 0
    if eager is None or not with_policy.any():
        return per_kind
    n = np.maximum(np.asarray(c.num_layers, dtype=float), 1.0)
    share = np.clip(n - np.asarray(c.ckpt_layers, dtype=float), 0.0, None) / n  # layers that run the policy
    layer = per_kind["layer"]
    per_kind["layer"] = {
        name: np.where(with_policy, share * eager[name] + (1.0 - share) * values if name in COMPUTE_TERMS
                       else eager[name], values) if name in eager else values
        for name, values in layer.items()}
    return per_kind


class PolicyTerms:
    """The per-tensor policy half of the stage model."""

    def layer_table(self, sp: bool):
        """The layer's saved-tensor table (``passes.saved_tensors``) as priced with or without sequence
        parallelism; None when the analysis made none. A compiled model's is the eager layer's: a unit
        with a policy runs its eager program (``lowering.compile``)."""
        layer = self.blocks["layer"].eager if self.blocks["layer"].eager is not None else self.blocks["layer"]
        block = layer.sequence if sp else layer
        return block.tensors if block is not None else None

    def add_policy(self, policy) -> int:
        """Register a per-tensor policy (``ir.plan.ActivationPolicy``); its index for ``act_policy``."""
        if policy in self.policies:
            return self.policies.index(policy)
        self.policies.append(policy)
        return len(self.policies) - 1

    def layer_rows(self, tp: int, sp: bool, micro_batch: int = 1) -> tuple[list, CopyRates] | None:
        """The layer's table priced at ``(micro_batch, seq_len, tp)`` and the copy rates of one layer there:
        what the activation MILP reads (None without a table)."""
        table = self.layer_table(sp)
        if table is None:
            return None
        one = np.ones(1)
        kind = SEQUENCE_LAYER if sp else "layer"
        eager = EAGER_SEQUENCE_LAYER if sp else EAGER_LAYER
        if eager in self._functions:  # a compiled model runs a layer with a policy eagerly
            kind = eager
        terms = self._block_terms(kind, micro_batch * one, tp * one, (np.ones(1, int), np.full(1, tp)))
        rates = CopyRates(self.hardware.d2h_bandwidth, self.hardware.h2d_bandwidth,
                          float(terms["forward_compute"][0]), float(terms["backward_compute"][0]))
        return rows_at(table, self.hardware, self.dtype, micro_batch, self.seq_len, tp), rates

    def policies_can_pay(self, tp: int, sp: bool) -> bool:
        """Whether a layer with a per-tensor policy can be faster than the same layer checkpointed whole.

        A compiled model runs a layer with a policy eagerly (``lowering.compile``). Where the eager
        layer keeping everything already takes as long as the compiled layer run forward twice, every
        policy is slower than checkpointing the layer. A checkpointed layer keeps only its input, and
        activation offload can move that too, so checkpointing matches a policy's memory as well (up to
        the recomputation's transient in the backward). Such policies are not solved or priced (a Llama
        layer: eager RMSNorm and SwiGLU run and keep fp32 copies the fused kernels do not; pruning them
        changed no plan of ``benchmarks/plan_quality.py``). Compared at micro-batch 1 and 8; always
        true for an eager model."""
        eager = EAGER_SEQUENCE_LAYER if sp else EAGER_LAYER
        if eager not in self._functions:
            return True
        b, t = np.array([1.0, 8.0]), np.full(2, float(tp))
        tp_shape = (np.ones(2, int), np.full(2, tp))
        compiled = self._block_terms(SEQUENCE_LAYER if sp else "layer", b, t, tp_shape)
        run_eagerly = self._block_terms(eager, b, t, tp_shape)
        keep_all = sum(run_eagerly[name] for name in COMPUTE_TERMS)
        checkpointed = sum(compiled[name] for name in COMPUTE_TERMS) + compiled["forward_compute"]
        return bool((keep_all < checkpointed).any())

    def _policy_terms(self, policy: np.ndarray, b: np.ndarray, t: np.ndarray, sp: np.ndarray) -> dict[str, np.ndarray]:
        """kept / offloaded bytes and recompute seconds of each candidate's policy (zeros without one)."""
        out = {name: np.zeros(len(policy)) for name in ("kept", "offloaded", "recompute")}
        chosen = np.flatnonzero(policy >= 0)
        if not len(chosen):
            return out
        # one integer per (policy, micro-batch, tp, sp): a 1-D unique is much cheaper than one by rows
        if b[chosen].max() >= 1 << 21 or t[chosen].max() >= 1 << 11:
            raise StageModelError("micro-batch or tensor-parallel degree out of the range per-tensor policies price")
        keys = ((policy[chosen].astype(np.int64) * (1 << 21) + b[chosen].astype(np.int64)) * (1 << 11)
                + t[chosen].astype(np.int64)) * 2 + sp[chosen].astype(np.int64)
        unique, inverse = np.unique(keys, return_inverse=True)
        values = self._tables_cache.get(b"policy" + unique.tobytes())
        if values is None:
            values = self._policy_values(unique)
            self._tables_cache[b"policy" + unique.tobytes()] = values
        for name in out:
            out[name][chosen] = values[name][inverse.reshape(-1)]
        return out

    def _policy_values(self, unique: np.ndarray) -> dict[str, np.ndarray]:
        """The terms of each (policy, micro-batch, tp, sp) code of ``_policy_terms``."""
        values = {name: np.zeros(len(unique)) for name in ("kept", "offloaded", "recompute")}
        for row, code in enumerate(unique.tolist()):
            key = (code >> 33, (code >> 12) & ((1 << 21) - 1), (code >> 1) & ((1 << 11) - 1), code & 1)
            index, batch, degree, with_sp = key
            if key not in self._policy_cache:
                if (index, with_sp) not in self._policy_prices:
                    table = self.layer_table(bool(with_sp))
                    if table is None:
                        raise StageModelError("per-tensor activation policies need the layer's saved-tensor table")
                    self._policy_prices[(index, with_sp)] = PolicyPrice.of(table, self.policies[index])
                price = self._policy_prices[(index, with_sp)]
                one = np.ones(1)
                self._policy_cache[key] = {name: float(value[0]) for name, value in price.terms(
                    self.hardware, self.dtype, batch * one, self.seq_len * one, degree * one).items()}
            for name in values:
                values[name][row] = self._policy_cache[key][name]
        return values
