"""An analytic stage cost model used as a TEST DOUBLE for the tuner's search logic.

It implements the ``StageCostModel`` protocol with a few closed-form GPT-like terms (compute from
6*N*tokens FLOPs, TP all-reduces, DP gradient sync, ZeRO sharding, checkpoint recompute,
overlappable offload traffic). It is NOT the project's cost model (that is
``mist_compiler.cost.stage_model``): the tests that use it check the Pareto/partition/search logic,
whose answers must be right for any cost model that keeps the protocol.
"""
from __future__ import annotations

import numpy as np

from mist_compiler.cost.stage_api import StageCandidates, StageEstimates


class AnalyticStageModel:
    def __init__(self, hidden: int = 64, ffn: int = 256, vocab: int = 512, seq_len: int = 128,
                 device_memory_bytes: float = 2e8, peak_flops: float = 1e12,
                 intra_bw: float = 50e9, inter_bw: float = 5e9, pcie_bw: float = 10e9) -> None:
        self.hidden, self.ffn, self.vocab, self.seq_len = hidden, ffn, vocab, seq_len
        self.device_memory_bytes = device_memory_bytes
        self.peak_flops = peak_flops
        self.intra_bw, self.inter_bw, self.pcie_bw = intra_bw, inter_bw, pcie_bw
        self.calls = 0
        self.rows = 0

    def evaluate(self, c: StageCandidates) -> StageEstimates:
        self.calls += 1
        self.rows += len(c)
        h, s, v = float(self.hidden), float(self.seq_len), float(self.vocab)
        layer_params = 4 * h * h + 2 * h * self.ffn
        params = c.num_layers * layer_params + (c.has_pre + c.has_post) * v * h
        tp = c.tp.astype(float)
        dp = c.dp.astype(float)
        b = c.micro_batch.astype(float)
        local = params / tp
        weights = 2 * local * (1 - c.offload_weights) / np.where(c.zero >= 3, dp, 1)
        grads = 2 * local * (1 - c.offload_grads) / np.where(c.zero >= 2, dp, 1)
        opt = 12 * local * (1 - c.offload_opt) / np.where(c.zero >= 1, dp, 1)
        act_layer = s * b * h * (10 + 24 / tp)
        ckpt_layer = 2 * s * b * h
        acts = c.inflight * ((c.num_layers - c.ckpt_layers) * act_layer + c.ckpt_layers * ckpt_layer) * (1 - c.offload_acts)
        logits = c.has_post * 4 * s * b * v / tp
        peak = weights + grads + opt + acts + act_layer + logits
        tokens = b * s
        compute = 6 * tokens * local / self.peak_flops
        recompute = 2 * tokens * c.ckpt_layers * layer_params / tp / self.peak_flops
        tp_comm = np.where(tp > 1, 4 * c.num_layers * 2 * tokens * h * 2 / self.intra_bw, 0.0)
        link = np.where(c.nodes > 1, self.inter_bw, self.intra_bw)
        copy = (2 * local * c.offload_weights * 2 + c.offload_acts * acts / np.maximum(c.inflight, 1) * 2) / self.pcie_bw
        stable = compute + recompute + tp_comm + np.maximum(0.0, copy - 0.5 * compute)
        sync = np.where(dp > 1, 2 * 2 * local * (dp - 1) / dp / link, 0.0)
        gather = np.where(c.zero >= 3, 2 * local / link, 0.0)
        opt_copy = (12 * local * c.offload_opt + 2 * local * c.offload_grads) / np.where(c.zero >= 1, dp, 1) * 2 / self.pcie_bw
        delta = sync + gather + opt_copy + 1e-4
        return StageEstimates(stable, delta, peak, {"compute": compute, "acts": acts})
