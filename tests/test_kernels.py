"""The runtime's flat-buffer math: the Triton kernel (under TRITON_INTERPRET=1, in a fresh subprocess)
against its torch twin, and the fused AdamW against ``torch.optim.AdamW``.

The interpreter must be switched on before ``@triton.jit`` runs, and other tests of this session
import ``mist_compiler.runtime.kernels`` without it, so the checks run in a subprocess.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from mist_compiler.runtime import kernels

CHECKS = r"""
import json, torch
from mist_compiler.runtime import kernels
assert kernels.INTERPRET and kernels.HAVE_TRITON, "interpreter not active"
torch.manual_seed(0)
out = {}
n = 2500  # three programs of BLOCK=1024, the last one masked
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    src = torch.randn(n).to(dtype)
    for accumulate in (False, True):
        dst = torch.randn(n)
        want = dst.clone(); kernels.scale_accumulate_torch(want, src, 0.5, accumulate)
        kernels.scale_accumulate(dst, src, 0.5, accumulate)
        out[f"scale_accumulate {dtype} acc={accumulate}"] = (dst - want).abs().max().item()
print("RESULT" + json.dumps(out))
"""


def test_triton_kernels_match_torch_under_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", CHECKS], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    errors = json.loads(line[len("RESULT"):])
    bad = {k: e for k, e in errors.items() if e > 1e-6}
    assert not bad, bad
    assert len(errors) == 6


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["fused", "chunked-low-precision"])
def test_adamw_matches_torch_optim_over_steps(grad_dtype):
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(300))
    optimizer = torch.optim.AdamW([param], lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05)
    flat = param.detach().clone()
    exp_avg, exp_avg_sq = torch.zeros(300), torch.zeros(300)
    for step in range(1, 6):
        grad = torch.randn(300).to(grad_dtype)
        param.grad = grad.float()
        optimizer.step()
        kernels.adamw(flat, grad, exp_avg, exp_avg_sq, step=step, lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05)
    torch.testing.assert_close(flat, param.detach(), rtol=1e-6, atol=1e-7)


def test_kernels_reject_mismatched_tensors():
    with pytest.raises(ValueError, match="scale_accumulate: tensors must be contiguous with 4 elements"):
        kernels.scale_accumulate(torch.zeros(4), torch.zeros(5), 1.0, False)
    with pytest.raises(ValueError, match="adamw"):
        kernels.adamw(torch.zeros(4, 2).t(), torch.zeros(8), torch.zeros(8), torch.zeros(8), step=1, lr=1.0,
                      betas=(0.9, 0.9), eps=1e-8, weight_decay=0.0)


def test_scale_accumulate_torch_fallback_casts_and_scales():
    dst = torch.ones(6)
    kernels.scale_accumulate(dst, torch.full((6,), 2.0, dtype=torch.bfloat16), 0.25, accumulate=True)
    assert torch.equal(dst, torch.full((6,), 1.5))
    kernels.scale_accumulate(dst, torch.full((6,), 4.0), 0.5, accumulate=False)
    assert torch.equal(dst, torch.full((6,), 2.0))


RUNTIME_STEP = r"""
import json, sys, torch
sys.path.insert(0, "tests")
from mist_compiler.runtime import kernels
from mist_compiler.runtime.stage_runtime import AdamWConfig
from mist_compiler.ir.plan import Offload
from stage_runtime_cases import Case, make_batches, train_with_runtime
assert kernels.INTERPRET
case = Case(zero=1, grad_accum=2, param_dtype=torch.float16, offload=Offload(opt=0.5))
weights, _ = train_with_runtime(0, 1, case, make_batches(1, 4, 8, 512), AdamWConfig(lr=1e-3, weight_decay=0.1))
print("RESULT" + json.dumps({k: v.float().tolist() for k, v in weights.items()}))
"""


def test_runtime_step_through_triton_kernels_matches_the_torch_path():
    """One fp16-compute training step with the runtime's gradient packing (scale_accumulate) in Triton."""
    pytest.importorskip("triton")
    from stage_runtime_cases import Case, make_batches, train_with_runtime

    from mist_compiler.ir.plan import Offload
    from mist_compiler.runtime.stage_runtime import AdamWConfig

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", RUNTIME_STEP], env=env, capture_output=True, text=True,
                          timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    triton_weights = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))[len("RESULT"):])
    case = Case(zero=1, grad_accum=2, param_dtype=torch.float16, offload=Offload(opt=0.5))
    torch_weights, _ = train_with_runtime(0, 1, case, make_batches(1, 4, 8, 512), AdamWConfig(lr=1e-3, weight_decay=0.1))
    assert set(triton_weights) == set(torch_weights)
    for name, value in torch_weights.items():
        # fp16 weights: the kernels and torch may round the last bit differently
        torch.testing.assert_close(torch.tensor(triton_weights[name]), value.float(), rtol=2e-3, atol=2e-4)
