"""The attention dispatch: SDPA on CPU (what capture sees), flash-attn's layout handled right."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mist_compiler.models import attention


def _qkv(kv_heads: int, heads: int = 4, requires_grad: bool = False):
    torch.manual_seed(0)
    q = torch.randn(2, heads, 16, 8, requires_grad=requires_grad)
    k = torch.randn(2, kv_heads, 16, 8, requires_grad=requires_grad)
    v = torch.randn(2, kv_heads, 16, 8, requires_grad=requires_grad)
    return q, k, v


def _reference(q, k, v):
    repeats = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_cpu_runs_sdpa(kv_heads):
    q, k, v = _qkv(kv_heads)
    assert attention.attention_kernel(q) == "sdpa"
    torch.testing.assert_close(attention.causal_attention(q, k, v), _reference(q, k, v), rtol=0, atol=0)


def _fake_flash_attn_func(q, k, v, causal):
    """flash-attn's contract: [batch, seq, heads, head_dim] in and out, grouped-query keys/values."""
    assert causal and q.shape[2] % k.shape[2] == 0 and q.stride(-1) == 1
    return _reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_flash_attn_path_converts_layouts(monkeypatch, kv_heads):
    monkeypatch.setattr(attention, "flash_attn_func", _fake_flash_attn_func)
    monkeypatch.setattr(attention, "flash_attn_applies", lambda q: True)
    q, k, v = _qkv(kv_heads, requires_grad=True)
    out = attention.causal_attention(q, k, v)
    expected = _reference(q, k, v)
    torch.testing.assert_close(out, expected)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)


def test_flash_attn_never_claims_cpu_or_fp32_tensors(monkeypatch):
    monkeypatch.setattr(attention, "flash_attn_func", _fake_flash_attn_func)
    q, _, _ = _qkv(4)
    assert not attention.flash_attn_applies(q)  # CPU
    assert not attention.flash_attn_applies(q.half())  # still CPU


@pytest.mark.skipif(not torch.cuda.is_available() or attention.flash_attn_func is None,
                    reason="flash-attn runs on a CUDA device with flash-attn installed")
def test_flash_attn_matches_sdpa_on_the_gpu():
    q, k, v = (t.cuda().bfloat16() for t in _qkv(2))
    assert attention.attention_kernel(q).startswith("flash-attn")
    torch.testing.assert_close(attention.causal_attention(q, k, v).float(), _reference(q, k, v).float(),
                               rtol=2e-2, atol=2e-2)
