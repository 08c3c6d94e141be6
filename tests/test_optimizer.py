"""FlatAdamW over split (device/host) fp32 shards against torch.optim.AdamW."""
from __future__ import annotations

import pytest
import torch

from mist_compiler.runtime.offload import HostMemory, SplitBuffer
from mist_compiler.runtime.optimizer import AdamWConfig, FlatAdamW, FlatGrads, ShardState
from mist_compiler.runtime.streams import Streams


@pytest.mark.parametrize("opt_fraction", [0.0, 0.4, 1.0])
def test_flat_adamw_on_split_shards_matches_torch(opt_fraction):
    torch.manual_seed(0)
    config = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    params = [torch.nn.Parameter(torch.randn(37)), torch.nn.Parameter(torch.randn(50))]
    reference = torch.optim.AdamW(params, lr=config.lr, betas=config.betas, eps=config.eps,
                                  weight_decay=config.weight_decay)
    host = HostMemory()
    states = []
    for p in params:
        master = SplitBuffer(p.numel(), torch.float32, torch.device("cpu"), opt_fraction, host, "opt")
        master.write(0, p.detach().clone())
        states.append(ShardState(master, host, opt_fraction))
    optimizer = FlatAdamW(config)
    for _ in range(4):
        grads = [torch.randn(p.numel()) for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        reference.step()
        optimizer.step(states, [FlatGrads(g) for g in grads])
    for p, state in zip(params, states):
        got = state.master.read(0, state.master.numel, torch.device("cpu"), Streams(torch.device("cpu")))
        torch.testing.assert_close(got, p.detach(), rtol=1e-6, atol=1e-7)
    expected_host = sum(3 * (p.numel() - state.master.boundary) * 4 for p, state in zip(params, states))
    assert host.bytes_by_kind().get("opt", 0) == expected_host


@pytest.mark.parametrize("field, kwargs", [
    ("lr", {"lr": -1.0}), ("betas", {"betas": (0.9, 1.0)}), ("eps", {"eps": 0.0}),
    ("weight_decay", {"weight_decay": -0.1}),
])
def test_adamw_config_rejects_bad_values(field, kwargs):
    with pytest.raises(ValueError, match=f"AdamWConfig.{field}"):
        AdamWConfig(**kwargs)
