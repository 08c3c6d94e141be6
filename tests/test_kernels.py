"""Triton kernels (under TRITON_INTERPRET=1, in a fresh subprocess) against their torch references.

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
for dtype in (torch.float32, torch.float16):
    src = torch.randn(n); dst = torch.empty(n, dtype=dtype)
    kernels.cast_copy(dst, src)
    out[f"cast_copy {dtype}"] = (dst.float() - src.to(dtype).float()).abs().max().item()
p = torch.randn(n); g = torch.randn(n) * 1e-2; m = torch.randn(n) * 1e-3; v = torch.rand(n) * 1e-4
ref = [t.clone() for t in (p, g, m, v)]
for step in (1, 2, 7):
    kw = dict(step=step, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    kernels.adamw(p, g, m, v, **kw)
    kernels.adamw_torch(ref[0], ref[1], ref[2], ref[3], **kw)
out["adamw param"] = ((p - ref[0]).abs().max() / ref[0].abs().max()).item()
out["adamw exp_avg"] = ((m - ref[2]).abs().max() / ref[2].abs().max()).item()
out["adamw exp_avg_sq"] = ((v - ref[3]).abs().max() / ref[3].abs().max()).item()
for dtype in (torch.float32, torch.float16):
    tensors = [torch.randn(s).to(dtype) for s in ((3, 700), (1,), (1500,), (0,), (64, 33))]
    total = sum(t.numel() for t in tensors)
    flat = torch.full((total + 7,), -1.0)
    kernels.pack(tensors, flat, 0.5)
    want = torch.cat([t.reshape(-1).float() for t in tensors]) * 0.5
    out[f"pack {dtype}"] = (flat[:total] - want).abs().max().item() + float(flat[total:].ne(-1.0).any())
    back = [torch.zeros_like(t) for t in tensors]
    kernels.unpack(flat, back, 2.0)
    out[f"unpack {dtype}"] = max((b.float() - t.float()).abs().max().item() if t.numel() else 0.0
                                 for b, t in zip(back, tensors))
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
    tolerances = {"scale_accumulate": 1e-6, "cast_copy": 0.0, "adamw": 1e-6, "pack": 0.0, "unpack": 1e-3}
    bad = {k: e for k, e in errors.items() if e > next(t for p, t in tolerances.items() if k.startswith(p))}
    assert not bad, bad
    assert len(errors) == 15


def test_torch_adamw_matches_torch_optim_over_steps():
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(300))
    optimizer = torch.optim.AdamW([param], lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05)
    flat = param.detach().clone()
    exp_avg, exp_avg_sq = torch.zeros(300), torch.zeros(300)
    for step in range(1, 6):
        grad = torch.randn(300)
        param.grad = grad.clone()
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


def test_pack_and_unpack_torch_fallback_round_trip():
    tensors = [torch.randn(4, 5), torch.randn(3), torch.randn(2, 2)]
    flat = torch.zeros(30)
    kernels.pack(tensors, flat, 0.25)
    assert torch.equal(flat[:27], torch.cat([t.reshape(-1) for t in tensors]) * 0.25) and flat[27:].eq(0).all()
    back = [torch.empty_like(t) for t in tensors]
    kernels.unpack(flat, back, 4.0)
    for got, want in zip(back, tensors):
        torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="flat buffer must be 1-D contiguous with >= 27"):
        kernels.pack(tensors, torch.zeros(10))


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
    """One fp16-compute training step with the runtime's kernel calls (pack-scale, cast, AdamW) in Triton."""
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
