"""mist::linear_cross_entropy: values and gradients against the unfused loss, its registrations
(fake, autograd, FLOPs), its memory against the closed form, the Triton kernels under the
interpreter, and the vocabulary-parallel variant on 2 gloo ranks."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mist_compiler.ops import slice_columns, linear_cross_entropy, vocab_parallel_linear_cross_entropy, workspace_points
from mist_compiler.ops.linear_cross_entropy import flops, reference_loss
from mist_compiler.profiling.live_memory import DevicePeakMemory


def _inputs(n=37, h=16, v=300, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    hidden = torch.randn(n, h).to(dtype).requires_grad_()
    weight = (torch.randn(v, h) * 0.3).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,))
    labels[[3, 7]] = -100
    return hidden, weight, labels


def _grads(fn, hidden, weight, labels, **kw):
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    loss = fn(h, w, labels, **kw)
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fp32_matches_the_unfused_loss(reduction):
    hidden, weight, labels = _inputs()
    got = _grads(linear_cross_entropy, hidden, weight, labels, reduction=reduction)
    want = _grads(reference_loss, hidden, weight, labels, reduction=reduction)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert got[0].dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_accumulates_in_fp32(dtype):
    """Against the unfused loss on the same low-precision logits, upcast before the softmax (what
    `logits.float()` models do): the loss agrees to fp32 rounding, gradients to one rounding."""
    hidden, weight, labels = _inputs(dtype=dtype)

    def upcast_after_head(h, w, y, **kw):
        return torch.nn.functional.cross_entropy((h @ w.t()).float(), y, **kw)

    got = _grads(linear_cross_entropy, hidden, weight, labels)
    want = _grads(upcast_after_head, hidden, weight, labels)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    eps = torch.finfo(dtype).eps
    for a, b in zip(got[1:], want[1:]):
        assert a.dtype == dtype
        assert ((a.float() - b.float()).abs().max() / b.float().abs().max()).item() < 4 * eps


def test_all_labels_ignored_gives_nan_like_cross_entropy():
    hidden, weight, labels = _inputs()
    labels[:] = -100
    assert torch.isnan(linear_cross_entropy(hidden, weight, labels))
    assert torch.isnan(reference_loss(hidden, weight, labels))


def test_slices_bound_the_chunk_by_the_input():
    assert slice_columns(50304, 2048) == 2048  # a slice's logits [N, H]: the size of the hidden input
    assert slice_columns(50, 200) == 50  # never more than V
    assert slice_columns(0, 64) == 1


def test_a_vocabulary_not_a_multiple_of_the_slice_is_exact():
    hidden, weight, labels = _inputs(n=9, h=8, v=43)  # 5 full slices of 8 and one of 3
    hidden.requires_grad_(), weight.requires_grad_()
    loss = linear_cross_entropy(hidden, weight, labels)
    grads = torch.autograd.grad(loss, (hidden, weight))
    expected = reference_loss(hidden, weight, labels)
    expected_grads = torch.autograd.grad(expected, (hidden, weight))
    torch.testing.assert_close(loss, expected)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)


def test_opcheck_fake_and_autograd_registrations():
    hidden, weight, labels = _inputs(n=9, h=8, v=40)
    torch.library.opcheck(torch.ops.mist.linear_cross_entropy.default, (hidden, weight, labels, -100, "mean"))


def test_flop_counter_counts_2nhv_forward_6nhv_backward():
    n, h, v = 12, 8, 50
    hidden, weight, labels = _inputs(n=n, h=h, v=v)
    with FlopCounterMode(display=False) as counter:
        linear_cross_entropy(hidden, weight, labels).backward()
    counts = {str(op): c
              for op, c in counter.get_flop_counts()["Global"].items()}
    assert counts["mist.linear_cross_entropy"] == flops(n, v, h, "forward") == 2 * n * h * v
    assert counts["mist.linear_cross_entropy_backward"] == flops(n, v, h, "backward") == 6 * n * h * v


def _measured_peaks(n: int, h: int, v: int, dtype: torch.dtype) -> tuple[int, int]:
    """(forward, backward) peak of live CPU bytes above the inputs (hidden, weight, labels)."""
    size = torch.tensor([], dtype=dtype).element_size()
    with DevicePeakMemory("cpu") as probe:
        torch.manual_seed(0)
        hidden = torch.randn(n, h).to(dtype).requires_grad_()
        weight = (torch.randn(v, h) * 0.1).to(dtype).requires_grad_()
        labels = torch.randint(0, v, (n,))
        base = (n * h + v * h) * size + n * 8
        probe.reset_peak()
        loss = linear_cross_entropy(hidden, weight, labels)
        forward = probe.peak_bytes - base
        probe.reset_peak()
        loss.backward()
        backward = probe.peak_bytes - base
    return forward, backward


def test_peak_memory_is_the_closed_form_and_never_n_by_v():
    """fp32 forward + backward on CPU: the peak of live tensors is the outputs plus the largest of
    ``workspace_points`` (the formula the memory-analysis pass charges), far below one N x V."""
    n, h, v = 2048, 64, 4096
    forward, backward = _measured_peaks(n, h, v, torch.float32)
    lse = n * 4
    forward_model = lse + max(workspace_points(n, v, h, 4, 4, "forward"))
    backward_model = lse + (n * h + v * h) * 4 + max(workspace_points(n, v, h, 4, 4, "backward"))
    assert forward < n * v * 4 / 8 and backward < n * v * 4 / 4
    rows = 32 * n  # the torch twins' per-row label indices and maxima (int64, bool, fp32): not in the GPU kernels
    assert abs(forward - forward_model) <= 0.01 * forward_model + rows, (forward, forward_model)
    assert abs(backward - backward_model) <= 0.01 * backward_model + rows, (backward, backward_model)


def test_low_precision_peak_stays_bounded_on_cpu():
    """bf16 on CPU (the torch twins upcast chunks: more than the GPU model, still no N x V)."""
    n, h, v = 2048, 64, 4096
    forward, backward = _measured_peaks(n, h, v, torch.bfloat16)
    gpu_backward = n * 4 + (n * h + v * h) * 2 + max(workspace_points(n, v, h, 2, 2, "backward"))
    assert forward < n * v * 2 / 4
    assert gpu_backward * 0.8 <= backward <= gpu_backward + 3 * n * h * 4


KERNEL_CHECKS = r"""
import json, torch
from mist_compiler.ops import chunk_kernels as k
from mist_compiler.ops import linear_cross_entropy
from mist_compiler.ops.linear_cross_entropy import reference_loss
assert k.INTERPRET and k.HAVE_TRITON, "interpreter not active"
torch.manual_seed(0)
out = {}
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    x = (torch.randn(4, 2100) * 3).to(dtype)  # three column blocks, the last one masked
    labels = torch.tensor([0, 2099, -100, 1500])
    for start in (0, 1000):
        lse, target, lse_t, target_t = (torch.empty(4) for _ in range(4))
        k.chunk_forward(x.clone(), labels, lse, target, start, -100)
        k.chunk_forward_torch(x.clone(), labels, lse_t, target_t, start, -100)
        out[f"forward {dtype} {start}"] = max((lse - lse_t).abs().max().item(), (target - target_t).abs().max().item())
        grad, grad_t, scale = x.clone(), x.clone(), torch.tensor([0.3])
        k.chunk_backward(grad, labels, lse_t, scale, start, -100)
        k.chunk_backward_torch(grad_t, labels, lse_t, scale, start, -100)
        out[f"backward {dtype} {start}"] = (grad.float() - grad_t.float()).abs().max().item()
hidden = torch.randn(21, 8, requires_grad=True); weight = torch.randn(50, 8, requires_grad=True)
labels = torch.randint(0, 50, (21,)); labels[2] = -100
loss = linear_cross_entropy(hidden, weight, labels); loss.backward()
h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
ref = reference_loss(h2, w2, labels); ref.backward()
out["op loss"] = abs(loss.item() - ref.item())
out["op grads"] = max((hidden.grad - h2.grad).abs().max().item(), (weight.grad - w2.grad).abs().max().item())
print("RESULT" + json.dumps(out))
"""


def test_triton_chunk_kernels_match_torch_under_interpreter():
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", KERNEL_CHECKS], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))[len("RESULT"):])
    assert len(errors) == 14
    # bf16 stores truncate instead of rounding under the interpreter (TORCH-NOTES section 5): one ulp
    bad = {key: e for key, e in errors.items() if e > (4e-3 if "bfloat16" in key else 1e-5)}
    assert not bad, bad


def test_vocab_parallel_on_one_device_is_the_op():
    hidden, weight, labels = _inputs()
    got = _grads(vocab_parallel_linear_cross_entropy, hidden, weight, labels)
    want = _grads(linear_cross_entropy, hidden, weight, labels)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _vocab_parallel_rank(rank: int, world: int, reduction: str) -> dict:
    hidden, weight, labels = _inputs(v=300)
    part = weight.shape[0] // world
    shard = weight.detach()[rank * part:(rank + 1) * part].clone().requires_grad_()
    h = hidden.detach().clone().requires_grad_()
    loss = vocab_parallel_linear_cross_entropy(h, shard, labels, group=torch.distributed.group.WORLD,
                                               reduction=reduction)
    loss.backward()
    return {"loss": loss.item(), "grad_hidden": h.grad.tolist(), "grad_shard": shard.grad.tolist()}


@pytest.mark.distributed
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_vocab_parallel_on_two_ranks_matches_one_device(reduction):
    from mist_compiler.launch.local_ranks import run_ranks

    results = run_ranks(_vocab_parallel_rank, 2, args=(reduction,))
    hidden, weight, labels = _inputs(v=300)
    loss, grad_hidden, grad_weight = _grads(reference_loss, hidden, weight, labels, reduction=reduction)
    for result in results:
        assert result["loss"] == pytest.approx(loss.item(), rel=1e-6)
        torch.testing.assert_close(torch.tensor(result["grad_hidden"]), grad_hidden, rtol=1e-5, atol=1e-6)
    shards = torch.cat([torch.tensor(r["grad_shard"]) for r in results])
    torch.testing.assert_close(shards, grad_weight, rtol=1e-5, atol=1e-6)
