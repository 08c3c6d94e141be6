"""Low-precision gradients (plan ``grad_dtype`` = the param dtype) under ZeRO 0/1: the micro-batch
buffer is the accumulator. Its memory is half the fp32 accumulator's, and the accumulated, reduced
gradient stays within one param-dtype rounding per micro-batch of the fp32 path's."""
from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks
from stage_runtime_cases import Case, make_batches, train_with_runtime

from mist_compiler.ir.plan import Offload
from mist_compiler.models import build_model
from mist_compiler.runtime.stage_runtime import AdamWConfig, StageRuntime, StageRuntimeError

GRAD_ACCUM = 4


def _train(rank: int, world: int, case: Case) -> tuple[list[torch.Tensor], dict, dict]:
    grads: list[torch.Tensor] = []
    batches = make_batches(2, 8 * world, 16, 512)
    weights, memory = train_with_runtime(rank, world, case, batches, AdamWConfig(lr=1e-3), grads_out=grads)
    return grads, memory, weights


def _compare(rank: int, world: int, zero: int, dtype: torch.dtype) -> dict:
    """Gradients before the optimizer and memory, fp32 path against the low-precision path."""
    fp32 = _train(rank, world, Case(zero=zero, grad_accum=GRAD_ACCUM, param_dtype=dtype))
    low = _train(rank, world, Case(zero=zero, grad_accum=GRAD_ACCUM, param_dtype=dtype, grad_dtype=dtype))
    errors = [((a - b).norm() / b.norm()).item() for a, b in zip(low[0], fp32[0])]
    weight_error = max(((low[2][k].float() - v.float()).norm() / v.float().norm()).item() for k, v in fp32[2].items())
    return {"grad_errors": errors, "weight_error": weight_error, "grads_fp32": fp32[1]["device"]["grads"],
            "grads_low": low[1]["device"]["grads"]}


def _bound(dtype: torch.dtype) -> float:
    """One rounding of the buffer per micro-batch (norm-wise, relative)."""
    return GRAD_ACCUM * torch.finfo(dtype).eps


@pytest.mark.parametrize("zero", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_one_rank_accumulates_within_one_rounding_per_micro_batch(zero, dtype):
    result = _compare(0, 1, zero, dtype)
    assert max(result["grad_errors"]) < _bound(dtype), result["grad_errors"]
    assert result["weight_error"] < 0.05  # AdamW amplifies sign flips of tiny gradients (TORCH-NOTES 9)
    params = sum(p.numel() for p in build_model("gpt-tiny").parameters())
    size = torch.finfo(dtype).bits // 8
    # just before the step: the fp32 path holds the fp32 sum (ZeRO-0: in place; ZeRO-1, 1 rank: the
    # shard is everything), the low-precision path the param-dtype buffer (ZeRO-0) or the fp32 shard
    assert result["grads_fp32"] == pytest.approx(4 * params, rel=0.01)
    assert result["grads_low"] == pytest.approx((size if zero == 0 else 4) * params, rel=0.01)


def _two_rank_worker(rank: int, world: int) -> list[dict]:
    return [_compare(rank, world, zero, torch.float16) for zero in (0, 1)]


@pytest.mark.distributed
def test_two_ranks_reduce_in_fp32_after_accumulating_in_the_buffer():
    params = sum(p.numel() for p in build_model("gpt-tiny").parameters())
    for rank_results in run_ranks(_two_rank_worker, world=2, timeout_s=200):
        for zero, result in zip((0, 1), rank_results):
            assert max(result["grad_errors"]) < _bound(torch.float16), (zero, result["grad_errors"])
            # at the step: ZeRO-0 the all-reduced mean (fp32 path) vs back in the fp16 buffer; ZeRO-1 the fp32 shard
            expected_low = 2 * params if zero == 0 else 4 * params / 2
            assert result["grads_low"] == pytest.approx(expected_low, rel=0.01), zero


def test_grad_dtype_must_be_fp32_or_the_param_dtype():
    units = [("a", torch.nn.Linear(2, 2))]
    with pytest.raises(StageRuntimeError, match="grad_dtype"):
        StageRuntime(units, dp_group=None, zero=0, offload=Offload(), optimizer=AdamWConfig(),
                     device=torch.device("cpu"), param_dtype=torch.float16, grad_dtype=torch.bfloat16)
