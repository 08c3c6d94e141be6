"""Peak-memory sanity of the stage runtime: ZeRO-3 halves weights per rank on 2 ranks; offload moves bytes to host.

Measured from the runtime's own buffers (``memory_report``: device-resident bytes by kind, and the
host registry where every offloaded tensor is entered) and, independently, from the storages the
model's parameters point at, just before the optimizer step of a 2-rank training step.
"""
from __future__ import annotations

import pytest

from dist_utils import run_ranks
from stage_runtime_cases import Case, memory_worker
from mist_compiler.ir.plan import Offload
from mist_compiler.models import build_model


@pytest.mark.distributed
def test_zero3_halves_weights_and_offload_moves_half_to_host():
    cases = [Case(zero=0), Case(zero=3), Case(zero=0, offload=Offload(weights=0.5)),
             Case(zero=2, offload=Offload(grads=0.5, opt=0.5)), Case(zero=1, offload=Offload(acts=0.5)),
             Case(zero=1), Case(zero=2)]
    reports = run_ranks(memory_worker, world=2, args=(cases,), timeout_s=150)
    params = sum(p.numel() for p in build_model("gpt-tiny").parameters())
    for rank_reports in reports:
        zero0, zero3, offloaded, zero2_off, acts, zero1, zero2 = rank_reports
        # closed form just before the step (fp32, dp=2, fp32 master aliases the weights), in units of 4P bytes:
        # weights 1 (ZeRO-3: 1/dp); reduced grads 1 (ZeRO>=1: 1/dp); Adam moments 2 (ZeRO>=1: 2/dp)
        expected = {0: (1, 1, 2), 1: (1, 0.5, 1), 2: (1, 0.5, 1), 3: (0.5, 0.5, 1)}
        for zero, report in ((0, zero0), (1, zero1), (2, zero2), (3, zero3)):
            got = tuple(report["device"][kind] / (4 * params) for kind in ("weights", "grads", "opt"))
            assert all(abs(g - e) < 0.01 for g, e in zip(got, expected[zero])), (zero, got)
        assert zero0["device"]["weights"] >= params * 4
        assert zero0["device"]["weights"] < params * 4 * 1.01
        # ZeRO-3: only this rank's shard stays resident once the step's backward is done
        assert abs(zero3["device"]["weights"] / zero0["device"]["weights"] - 0.5) < 0.01
        assert zero3["param_storage_bytes"] == 0
        assert zero0["param_storage_bytes"] == zero0["device"]["weights"]
        # weights offload 0.5: about half of the weight bytes live in host memory instead
        assert abs(offloaded["device"]["weights"] / zero0["device"]["weights"] - 0.5) < 0.01
        assert abs(offloaded["host"]["weights"] / zero0["device"]["weights"] - 0.5) < 0.01
        assert "weights" not in zero0["host"]
        # ZeRO-2 with grads and opt offload 0.5: half of the sharded accumulator / Adam state on the host
        assert abs(zero2_off["host"]["grads"] - params * 4 / 2 / 2) / (params * 4) < 0.01
        assert abs(zero2_off["host"]["opt"] - 3 * params * 4 / 2 / 2) / (params * 4) < 0.01
        # activations offload 0.5: about half of the saved activation bytes went to the host
        assert zero0["acts_offloaded"] == 0
        share = acts["acts_offloaded"] / (acts["acts_offloaded"] + acts["acts_kept"])
        # (greedy in save order, each storage counted once: it stops short of the fraction by less than
        # one saved tensor, and gpt-tiny's unit saves few, large ones)
        assert 0.3 < share <= 0.5, share
